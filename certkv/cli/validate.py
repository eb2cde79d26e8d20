"""`certkv validate`: repeated calibration/test splits of the records, certkv vs empirical thresholding.

It answers "does the certificate hold on requests it has not seen, and what does the usual
practice (pick the cheapest candidate whose calibration rate is ≤ ε) cost in broken promises?".
Torch-free: it only reads records.
"""

from __future__ import annotations

import json
from pathlib import Path

import typer

VALIDATION_FILE = "validation.json"


def validate(
    contract_path: Path = typer.Argument(..., metavar="CONTRACT", help="the contract YAML"),
    splits: int = typer.Option(1000, "--splits", help="number of random calibration/test splits"),
    calibration_fraction: float = typer.Option(0.5, "--calibration-fraction", help="share of requests in the calibration half"),
    seed: int = typer.Option(0, "--seed", help="seed of the split generator"),
    records: Path | None = typer.Option(None, "--records", help="use a CSV/JSONL loss table instead of the store"),
    output: Path | None = typer.Option(None, "--output", "-o", help="validation JSON; default <store>/validation.json"),
    allow_incomplete: bool = typer.Option(
        False, "--allow-incomplete", help="use an unfinished store for a preview (no guarantee)"
    ),
) -> None:
    """Split the calibration records many times and check both selection methods on the test half."""
    from rich.console import Console

    from certkv.calibration.records import default_output, load_records
    from certkv.contract.loading import load_contract
    from certkv.report.tables import say_path

    contract = load_contract(contract_path)
    evidence = load_records(contract, records, contract_label=str(contract_path), allow_incomplete=allow_incomplete)
    result = run_validation(contract, evidence, splits, calibration_fraction, seed)
    target = output or default_output(contract, VALIDATION_FILE)
    write_validation(result, contract, evidence, target)
    console = Console()
    print_validation(result, console)
    say_path(console, "wrote", target)


def run_validation(contract, evidence, splits: int = 1000, calibration_fraction: float = 0.5, seed: int = 0):
    """certkv.core.validation.validate on the contract's spec and the loaded records."""
    from certkv.contract.spec import certification_spec
    from certkv.core.validation import validate as run

    return run(evidence.table, certification_spec(contract), n_splits=splits,
               calibration_fraction=calibration_fraction, seed=seed)


def write_validation(result, contract, evidence, path: Path) -> Path:
    """The result plus the hashes it was computed from, so a report can tell a stale file."""
    from certkv.core.spec import delta_of

    data = result.to_dict()
    data["delta"] = delta_of(result.contract.confidence)
    data["contract_sha256"] = contract.sha256()
    data["records_sha256"] = evidence.records_sha256
    from certkv.atomic_io import write_text_atomic

    return write_text_atomic(path, json.dumps(data, indent=1, ensure_ascii=False) + "\n")


def read_validation(path: Path, contract, evidence):
    """A validation.json computed from these very records under this contract, else None."""
    from pydantic import ValidationError

    from certkv.core.validation import ValidationResult

    path = Path(path)
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    if data.pop("contract_sha256", None) != contract.sha256() or data.pop("records_sha256", None) != evidence.records_sha256:
        return None
    data.pop("delta", None)
    try:
        return ValidationResult.model_validate(data)
    except ValidationError:
        return None


def print_validation(result, console) -> None:
    """Both methods side by side, with δ: the certificate's promised bound on failures.

    A narrow table (method, share of splits above ε with its count and 95% interval, mean KV,
    fallback share) that fits 80 columns, then each method's most chosen policies on a line of
    their own: policy names are long and would otherwise fold the table in a log.

    Parameters
    ----------
    result : certkv.core.validation.ValidationResult
    console : rich.console.Console
        80 columns without a TTY unless ``COLUMNS`` says otherwise; nothing printed is cut.
    """
    from certkv.report.tables import add_row, narrow_table, print_table, say
    from certkv.report.text import METHOD_LABELS, contract_delta, fmt_share

    eps = result.contract.risk
    delta = contract_delta(result.contract)
    title = (
        f"{result.n_splits} splits of {result.n_requests} requests: {result.n_calibration} calibrate, "
        f"{result.n_test} test (seed {result.seed}); ε = {eps:g}, δ = {delta:g}"
    )
    table = narrow_table([("method", "left"), ("test risk > ε", "right"), ("95% CI", "right"),
                          ("mean KV", "right"), ("fallback", "right")])
    for name, m in result.methods.items():
        add_row(
            table,
            METHOD_LABELS.get(name, name),
            f"{fmt_share(m.exceed_fraction)} ({m.exceed_count})",
            f"{100 * m.exceed_ci_low:.1f}–{100 * m.exceed_ci_high:.1f}%",
            f"{m.mean_kv_retained:.3f}",
            fmt_share(m.fallback_share),
        )
    print_table(console, table, title=title)
    say(console, "test risk > ε: share (count) of splits whose test half exceeds ε; mean KV: mean KV retained "
                 "of the chosen policy; fallback: share of splits that chose the full cache.")
    for name, m in result.methods.items():
        top = sorted(m.chosen.items(), key=lambda kv: -kv[1])[:2]
        chosen = ", ".join(f"{p} ({100 * c / result.n_splits:.0f}%)" for p, c in top) or "—"
        say(console, f"most chosen by {METHOD_LABELS.get(name, name)}: {chosen}")
    say(
        console,
        f"certkv promises that its choice's true risk exceeds ε = {eps:g} with probability at most δ = {delta:g}; "
        "empirical thresholding promises nothing. Test halves are finite and splits overlap, so these shares "
        "are noisy and descriptive, not a test of the guarantee.",
    )
