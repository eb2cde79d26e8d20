"""`certkv certify`: certify a contract's calibration records and write the operating point.

Torch-free on purpose: a certificate is checked from the records alone, so anyone can re-certify
a store (or a loss table from another system) on a machine without the model stack. Everything
this command imports is numpy/scipy/pydantic/rich, inside the function body. The console shows
one row per sequence (:mod:`certkv.report.console`), readable in 80 columns and in logs;
``--wide`` adds every candidate, which the JSON always holds.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import typer

if TYPE_CHECKING:
    from certkv.contract.schema import Contract
    from certkv.workflow import Certification


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
) -> None:
    """Test every candidate of the contract and write the certified operating point."""
    from certkv.contract.loading import load_contract
    from certkv.workflow import certify as certify_contract

    contract = load_contract(contract_path)
    result = certify_contract(contract, contract_label=str(contract_path), records=records, output=output,
                              allow_incomplete=allow_incomplete)
    show_certification(contract, result, wide=wide)


def show_certification(contract: Contract, result: Certification, *, wide: bool = False) -> None:
    """What `certkv certify` prints on stdout: the decision (one row per sequence, or every candidate
    when `wide`), the pooled comparison of a stratified point, and the file written."""
    from rich.console import Console

    from certkv.report.console import print_operating_point

    print_operating_point(contract, result.evidence, result.operating_point, Console(), result.path, wide=wide,
                          pooled=result.pooled)
