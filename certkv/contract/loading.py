"""Reading a contract file: strict YAML (no duplicate keys, ``5e-2`` is a float), then the schema.

Every failure is one :class:`~certkv.errors.CertkvError` line naming the file, the key and the fix.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from certkv.contract.schema import Contract
from certkv.errors import CertkvError, format_validation_error


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate keys (PyYAML keeps the last one silently) and reads
    ``5e-2`` as a float (YAML 1.1 needs a dot, which users rarely write)."""

    def construct_mapping(self, node, deep=False):
        keys = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in keys:
                mark = key_node.start_mark
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} (line {mark.line + 1}, column {mark.column + 1})", mark
                )
            keys.add(key)
        return super().construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
        |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
        |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""",
        re.X,
    ),
    list("-+0123456789."),
)


def parse_contract(data: Any, source: str = "contract", base_dir: str | Path | None = None) -> Contract:
    """Validate an already-parsed mapping; errors become one-line CertkvErrors naming `source`."""
    if not isinstance(data, dict):
        kind = "an empty file" if data is None else type(data).__name__
        raise CertkvError(f"{source}: the top level must be a mapping of contract keys (name, requests, ...), got {kind}")
    try:
        contract = Contract.model_validate(data)
    except ValidationError as exc:
        raise CertkvError(format_validation_error(exc, source)) from None
    return contract.with_base_dir(base_dir if base_dir is not None else Path.cwd())


def load_contract(path: str | Path) -> Contract:
    """Read and validate a contract file; relative paths in it resolve against its folder."""
    path = Path(path)
    if not path.is_file():
        raise CertkvError(f"contract file {path} does not exist")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise CertkvError(f"{path}: cannot read the contract ({exc})") from None
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise CertkvError(f"{path}: invalid YAML{where}: {problem}") from None
    return parse_contract(data, str(path), path.resolve().parent)
