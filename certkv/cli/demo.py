"""`certkv demo`: calibrate, certify, validate and report the shipped demo contract in one go."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from certkv.errors import CertkvError

REPO_ROOT = Path(__file__).resolve().parents[2]
DEMO_CONTRACT = REPO_ROOT / "contracts" / "demo.yaml"


def demo(
    contract_path: Optional[Path] = typer.Option(None, "--contract", help="another contract; default contracts/demo.yaml"),
    limit: Optional[int] = typer.Option(None, "--limit", help="calibrate at most this many requests (a quick look)"),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="no progress bar"),
) -> None:
    """Run the whole pipeline on the demo contract: calibrate → certify → validate → report."""
    from rich.console import Console

    from certkv.cli.calibrate import calibrate
    from certkv.cli.certify import certify
    from certkv.cli.report import report
    from certkv.cli.validate import validate

    path = contract_path or DEMO_CONTRACT
    if not path.is_file():
        raise CertkvError(
            f"demo contract {path} not found; run `certkv demo` from a clone of the certkv repository "
            "(installed with `pip install -e .`) or pass --contract"
        )
    console = Console()
    console.rule("1/4 calibrate: full cache and every candidate on every request")
    calibrate(path, limit=limit, new_store=False, quiet=quiet, device=None, dtype=None)
    console.rule("2/4 certify: exact binomial tests, fixed-sequence family-wise control")
    partial = limit is not None  # a quick look: a preview without guarantee
    certify(path, records=None, output=None, allow_incomplete=partial)
    console.rule("3/4 validate: 1000 random calibration/test splits, certkv vs empirical thresholding")
    validate(path, splits=1000, calibration_fraction=0.5, seed=0, records=None, output=None, allow_incomplete=partial)
    console.rule("4/4 report")
    report(path, output=None, records=None, splits=1000, seed=0, allow_incomplete=partial)
