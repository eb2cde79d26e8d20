"""`certkv certify`: certify a contract's calibration records and write the operating point.

Torch-free on purpose: a certificate is checked from the records alone, so anyone can re-certify
a store (or a loss table from another system) on a machine without the model stack. Everything
this command imports is numpy/scipy/pydantic/rich, inside the function body.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer


def certify(
    contract_path: Path = typer.Argument(..., metavar="CONTRACT", help="the contract YAML"),
    records: Optional[Path] = typer.Option(
        None, "--records", help="certify a CSV/JSONL loss table (request_id, policy, kv_retained, loss) instead of the store"
    ),
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="operating point JSON; default <store>/operating_point.json"),
    allow_incomplete: bool = typer.Option(
        False, "--allow-incomplete", help="use an unfinished store for a preview (no guarantee)"
    ),
) -> None:
    """Test every candidate of the contract and write the certified operating point."""
    from rich.console import Console

    from certkv.core.certify import certify as run_certify
    from certkv.contract.loading import load_contract
    from certkv.contract.spec import certification_spec
    from certkv.calibration.records import default_output, load_records, mark_incomplete

    contract = load_contract(contract_path)
    spec = certification_spec(contract)
    evidence = load_records(contract, records, contract_label=str(contract_path), allow_incomplete=allow_incomplete)
    op = run_certify(evidence.table, spec, contract_sha256=contract.sha256(), records_sha256=evidence.records_sha256)
    mark_incomplete(op, evidence)
    target = output or default_output(contract, "operating_point.json")
    op.write_json(target)
    print_operating_point(contract, evidence, op, Console(), target)


def print_operating_point(contract, evidence, op, console, target: Path | None = None) -> None:
    """The ladder, where each sequence stopped, the choice, per-task flags and the guarantee."""
    from rich.table import Table

    from certkv.report import text as reporting

    eps = op.contract.risk
    delta = reporting.contract_delta(op.contract)
    console.print(f"evidence: {evidence.source} (records sha256 {evidence.records_sha256[:12]})", soft_wrap=True, highlight=False)
    table = Table(
        title=(
            f"{contract.name}: {op.contract.procedure}, τ = {op.contract.tolerance:g}, ε = {eps:g}, "
            f"confidence {op.contract.confidence:g} (δ = {delta:g}), n = {op.n}"
        )
    )
    rows = reporting.ladder_rows(op)
    gated = any(r["gated_share"] is not None for r in rows)  # gate columns only when the contract has a gate
    gate_cols = [("mean KV", "right"), ("gated", "right")] if gated else []
    for col, justify in [("seq", "right"), ("policy", "left"), ("n", "right"), ("k", "right"),
                         ("empirical risk", "right"), ("upper bound", "right"), ("p-value", "right"),
                         ("tested level", "right"), *gate_cols, ("status", "left")]:
        table.add_column(col, justify=justify)
    style = {"certified": "green", "not certified": "red", "not tested": "dim"}
    for r in rows:
        gate_cells = []
        if gated:
            share = "—" if r["gated_share"] is None else f"{100 * r['gated_share']:.1f}%"
            gate_cells = [f"{r['mean_kv']:.3f}", share]
        table.add_row(
            str(r["sequence"]), r["policy"] + (" ★" if r["chosen"] else ""), str(r["n"]), str(r["k"]),
            f"{r['empirical_risk']:.4f}", f"{r['upper_bound']:.4f}", f"{r['p_value']:.3g}", f"{r['level']:.3g}",
            *gate_cells, f"[{style[r['status']]}]{r['status']}[/]",
            style="bold" if r["chosen"] else None,
        )
    console.print(table)
    for line in reporting.sequence_summaries(op):
        console.print(f"  {line}", highlight=False)
    console.print()
    label = "[bold red]Fallback[/]" if op.fallback else "[bold green]Chosen[/]"
    console.print(f"{label}: {reporting.choice_summary(op)}", highlight=False)
    if op.per_task and not op.fallback:
        tasks = Table(title=f"per-task breakdown of {op.policy}")
        for col, justify in [("task", "left"), ("n", "right"), ("violations", "right"), ("rate", "right"), (f"vs ε = {eps:g}", "left")]:
            tasks.add_column(col, justify=justify)
        for name, b in sorted(op.per_task.items()):
            flag = "[bold red]above ε[/]" if b.exceeds_risk else "≤ ε"
            tasks.add_row(name, str(b.n), str(b.violations), f"{b.rate:.4f}", flag)
        console.print(tasks)
    console.print(f"[bold]Guarantee:[/] {reporting.guarantee_text(op)}", highlight=False)
    skipped = reporting.skipped_note(evidence)
    for note in [n for n in (skipped, reporting.gate_note(contract)) if n] + list(op.notes):
        console.print(f"[yellow]note:[/] {note}", highlight=False)
    if target is not None:
        console.print(f"wrote {target}", soft_wrap=True, highlight=False)
