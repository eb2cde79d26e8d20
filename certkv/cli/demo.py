"""`certkv demo`: calibrate, certify, validate and report the shipped demo contract in one go.

The demo contract and its requests ship inside the package (:mod:`certkv.demo`). They are copied
into ``--dir`` (default ``./certkv-demo``) and run from there, so the store and the report land in
``<dir>/runs/demo``, never inside the installation, and the copy is the contract to pass to
``certkv certify`` or ``certkv report`` later. Its last lines say which certificate is deployed
(the contract's: stratified per task for the packaged demo) beside the pooled comparison.

The four steps are the functions of :mod:`certkv.workflow`, each printed as its own command prints
it (``show_*`` of :mod:`certkv.cli.calibrate`, :mod:`certkv.cli.certify`, :mod:`certkv.cli.validate`
and :mod:`certkv.cli.report`), so the demo's output is the four commands' output in a row.
"""

from __future__ import annotations

from pathlib import Path

import typer

from certkv.demo import DEFAULT_DEMO_DIR
from certkv.errors import CertkvError


def demo(
    folder: Path = typer.Option(
        Path(DEFAULT_DEMO_DIR), "--dir",
        help="folder the demo contract and requests are copied into and run from (its store: <dir>/runs/demo)",
    ),
    contract_path: Path | None = typer.Option(
        None, "--contract", help="run this contract in place instead of the packaged demo (--dir is then unused)"
    ),
    limit: int | None = typer.Option(None, "--limit", help="calibrate at most this many requests (a quick look)"),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="no progress bar"),
) -> None:
    """Run the whole pipeline on the demo contract: calibrate → certify → validate → report."""
    from rich.console import Console

    from certkv import workflow
    from certkv.cli.calibrate import show_calibration
    from certkv.cli.certify import show_certification
    from certkv.cli.report import notice, show_report
    from certkv.cli.validate import show_validation
    from certkv.contract.loading import load_contract
    from certkv.demo import copy_demo
    from certkv.report.tables import say
    from certkv.report.text import deployed_text

    if contract_path is not None:
        if not contract_path.is_file():
            raise CertkvError(f"--contract {contract_path} not found; pass an existing contract YAML")
        path = contract_path
    else:
        path = copy_demo(folder)
    console = Console()
    typer.echo(f"demo contract: {path}")
    partial = limit is not None  # a quick look: a preview without guarantee
    console.rule("1/4 calibrate: full cache and every candidate on every request")
    contract, label = load_contract(path), str(path)
    progress = Console(stderr=True)  # the progress bar and summary table, where `certkv calibrate` shows them
    show_calibration(contract, workflow.calibrate(contract, limit=limit, quiet=quiet, console=progress), quiet, progress)
    console.rule("2/4 certify: exact binomial tests, fixed-sequence family-wise control")
    certified = workflow.certify(contract, contract_label=label, allow_incomplete=partial)
    show_certification(contract, certified)
    console.rule("3/4 validate: 1000 random splits, certkv vs empirical thresholding")
    show_validation(workflow.validate(contract, contract_label=label, splits=1000, seed=0, allow_incomplete=partial))
    console.rule("4/4 report")
    show_report(workflow.report(contract, contract_label=label, splits=1000, seed=0, allow_incomplete=partial,
                                notify=notice))
    say(console, deployed_text(certified.operating_point, certified.pooled))
    console.print(
        f"the demo contract is {path}: pass it to `certkv certify {path}` or `certkv report {path}` later; "
        "rerunning `certkv demo` with the same --dir resumes its store",
        highlight=False, markup=False,
    )
