"""A contract's validation run and its file: ``<store>/validation.json``.

`certkv validate` writes the file and `certkv report` reads it back, so both go through this module:
the file carries its ``format_version`` and the hashes of the contract and the records it was
computed from. A file computed from other records is stale and recomputed rather than shown; a
file of another format version is refused in one line (:mod:`certkv.core.file_format`). Torch-free.
"""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import ValidationError

from certkv.atomic_io import write_text_atomic
from certkv.calibration.certification import ContractRecords, preview_spec
from certkv.contract.schema import Contract
from certkv.contract.spec import certification_spec
from certkv.core.file_format import check_format_version
from certkv.core.spec import delta_of
from certkv.core.validation import ValidationResult, validate

#: The validation file's name in the store folder.
VALIDATION_FILE = "validation.json"

#: The layout of ``validation.json``; a reader takes this version only.
FORMAT_VERSION = 1

#: What writes a validation file, named when a file of another version is refused.
REWRITE = "certkv validate CONTRACT"


def run_validation(
    contract: Contract, evidence: ContractRecords, splits: int = 1000, calibration_fraction: float = 0.5, seed: int = 0
) -> ValidationResult:
    """certkv.core.validation.validate on the contract's spec and the loaded records."""
    return validate(
        evidence.table,
        preview_spec(certification_spec(contract, evidence.kv_amax), evidence),
        n_splits=splits,
        calibration_fraction=calibration_fraction,
        seed=seed,
    )


def write_validation(result: ValidationResult, contract: Contract, evidence: ContractRecords, path: Path) -> Path:
    """The result plus its format version and the hashes it was computed from, so a report can
    tell a stale file."""
    data = {"format_version": FORMAT_VERSION, **result.to_dict()}
    data["delta"] = delta_of(result.contract.confidence)
    data["contract_sha256"] = contract.sha256()
    data["records_sha256"] = evidence.records_sha256
    return write_text_atomic(path, json.dumps(data, indent=1, ensure_ascii=False) + "\n")


def read_validation(path: Path, contract: Contract, evidence: ContractRecords) -> ValidationResult | None:
    """A validation.json computed from these very records under this contract, else None (no
    file, or a stale one: a report recomputes it).

    Raises CertkvError, in one line, for a file of another ``format_version``.
    """
    path = Path(path)
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    check_format_version(data.pop("format_version", None), FORMAT_VERSION, path, REWRITE)
    if data.pop("contract_sha256", None) != contract.sha256() or data.pop("records_sha256", None) != evidence.records_sha256:
        return None
    data.pop("delta", None)
    try:
        return ValidationResult.model_validate(data)
    except ValidationError:
        return None
