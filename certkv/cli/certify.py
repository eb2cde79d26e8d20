"""`certkv certify`: certify a contract's calibration records and write the operating point.

Torch-free on purpose: a certificate is checked from the records alone, so anyone can re-certify
a store (or a loss table from another system) on a machine without the model stack. Everything
this command imports is numpy/scipy/pydantic/rich, inside the function body. The console shows
one row per sequence (:mod:`certkv.report.console`), readable in 80 columns and in logs;
``--wide`` adds every candidate, which the JSON always holds.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer


def certify(
    contract_path: Path = typer.Argument(..., metavar="CONTRACT", help="the contract YAML"),
    records: Path | None = typer.Option(
        None, "--records", help="certify a CSV/JSONL loss table (request_id, policy, kv_retained, loss) instead of the store"
    ),
    output: Path | None = typer.Option(None, "--output", "-o", help="operating point JSON; default <store>/operating_point.json"),
    allow_incomplete: bool = typer.Option(
        False, "--allow-incomplete", help="use an unfinished store for a preview (no guarantee)"
    ),
    wide: bool = typer.Option(
        False, "--wide", help="print every candidate (a wide table) instead of one row per sequence"
    ),
) -> tuple[Any, Any]:
    """Test every candidate of the contract and write the certified operating point."""
    # Returns (operating point, pooled comparison or None) for `certkv demo`, whose last lines name
    # the deployed one; on the command line main() sees the tuple as the command's result and exits
    # 0, since only an int is an exit code. (Not in the docstring: that is --help.) The return type
    # is (OperatingPoint, OperatingPoint | None), spelled Any because typer evaluates the hints when
    # the command is registered and the core is imported only in here.
    from rich.console import Console

    from certkv.calibration.certification import certify_contract_with_comparison, default_output
    from certkv.contract.loading import load_contract
    from certkv.report.console import print_operating_point

    contract = load_contract(contract_path)
    evidence, op, pooled = certify_contract_with_comparison(
        contract, records, contract_label=str(contract_path), allow_incomplete=allow_incomplete
    )
    target = output or default_output(contract, "operating_point.json")
    op.write_json(target)  # the contract's point only: the pooled comparison is never deployed
    print_operating_point(contract, evidence, op, Console(), target, wide=wide, pooled=pooled)
    return op, pooled
