"""The console output of `certkv certify` and `certkv validate`, readable in 80 columns and in logs.

A contract with a gate grid has hundreds of candidates (the demo: 216 in 24 sequences); a table
of all of them squeezed into a terminal or a CI log is unreadable. So the console shows one row
per *sequence*: how far testing got, where it stopped and why, and the best certified candidate,
followed by the choice, the chosen policy's tasks, the guarantee and the notes. The full
candidate table is in the operating-point JSON and the HTML report, and ``--wide`` prints it here,
at its natural width. Every table goes through :mod:`certkv.report.tables`, so no value is ever
cut to ``0.0…``.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from certkv.report import text
from certkv.report.tables import Justify, add_row, narrow_table, print_table, say, say_path

if TYPE_CHECKING:
    from rich.console import Console

    from certkv.calibration.certification import ContractRecords
    from certkv.contract.schema import Contract
    from certkv.core.operating_point import OperatingPoint
    from certkv.core.validation import ValidationResult


def print_operating_point(contract: Contract, evidence: ContractRecords, op: OperatingPoint, console: Console,
                          target: Path | None = None, wide: bool = False, pooled: OperatingPoint | None = None) -> None:
    """Print a certificate for a reader of a terminal or a log.

    Parameters
    ----------
    contract : Contract
        The contract certified (its name and gate grid are shown).
    evidence : certkv.calibration.certification.ContractRecords
        The records certified: source, hash and skipped requests.
    op : OperatingPoint
        The result to show; a stratified one gets a row per stratum (:func:`print_strata`).
    console : rich.console.Console
        Where to print; without a TTY rich assumes 80 columns unless ``COLUMNS`` says otherwise,
        and every line here fits that (paths excepted, which are never broken).
    target : path, optional
        Where the JSON was written, named last so it is the line a user copies.
    wide : bool
        Every candidate at the table's natural width and a sentence per sequence, instead of one
        row per sequence: for wide terminals, pagers and files (per stratum when stratified).
    pooled : OperatingPoint, optional
        A stratified point's pooled comparison
        (:func:`certkv.calibration.certification.pooled_comparison`), shown beside it, labelled as
        never deployed.
    """
    say_path(console, "evidence:", evidence.source)
    say(console, f"records sha256 {evidence.records_sha256[:12]}")
    delta = text.contract_delta(op.contract)
    say(console, f"{contract.name}: {op.contract.procedure}, τ = {op.contract.tolerance:g}, ε = {op.contract.risk:g}, "
                 f"confidence {op.contract.confidence:g} (δ = {delta:g}), n = {op.n}")
    console.print()
    if op.is_stratified:
        print_strata(op, console, wide, pooled)
    else:
        print_decision(op, console, wide)
    say(console, text.guarantee_text(op), label="Guarantee", style="bold")
    print_coverage(op, console)
    for note in text.all_notes(contract, evidence, op):
        say(console, note, label="note", style="yellow")
    if not wide:
        where = "the operating point JSON" + (" written below" if target is not None else "")
        if op.is_stratified:
            say(console, f"Each stratum's candidates: `certkv certify --wide`, {where} (strata.entries), "
                         "or `certkv report`.")
        else:
            say(console, f"All {len(op.candidates)} candidates: `certkv certify --wide`, {where}, or `certkv report`.")
    if target is not None:
        say_path(console, "wrote", target)


def print_decision(op: OperatingPoint, console: Console, wide: bool = False) -> None:
    """An ordinary operating point's evidence and choice: its sequences (or, `wide`, every candidate
    and a sentence per sequence), the choice or fallback, and the chosen policy's tasks. Shared by a
    pooled point and each stratum's entry, which is one."""
    if wide:
        print_candidates(op, console)
        for line in text.sequence_summaries(op):
            say(console, f"  {line}")
    else:
        print_sequences(op, console)
    console.print()
    print_choice(op, console)
    print_per_task(op, console)


def print_choice(op: OperatingPoint, console: Console, label: str = "") -> None:
    """``Chosen: …`` or ``Fallback: …`` (with `label`, e.g. a stratum's name, before it)."""
    if op.fallback:
        say(console, text.choice_summary(op), label=f"{label}Fallback", style="bold red")
    else:
        say(console, text.choice_summary(op), label=f"{label}Chosen", style="bold green")


def print_strata(op: OperatingPoint, console: Console, wide: bool = False, pooled: OperatingPoint | None = None) -> None:
    """A stratified point: a row per stratum, each stratum's choice in words, the pooled memory and
    the pooled comparison; `wide` adds each stratum's own evidence, printed as the ordinary
    operating point it is (:func:`print_decision`)."""
    assert op.strata is not None, "a stratified operating point"
    if wide:
        for name, entry in op.strata.entries.items():
            console.rule(f"{op.strata.by} {name}: {entry.n} certification requests", style="dim")
            print_decision(entry, console, wide=True)
            say(console, text.guarantee_text(entry), label="Guarantee", style="bold")
        console.rule(style="dim")
    print_strata_table(op, console)
    console.print()
    for name, entry in op.strata.entries.items():
        print_choice(entry, console, label=f"{name}: ")
    print_choice(op, console)
    if op.strata.by != "task":  # by task the strata rows are the tasks already
        print_per_task(op, console)
    if pooled is not None:
        console.print()
        print_comparison(op, pooled, console)
    console.print()


def print_strata_table(op: OperatingPoint, console: Console) -> None:
    """One row per stratum: n, policy, gated share, violations, bound, mean KV, why it fell back."""
    rows = text.stratum_rows(op)
    table = narrow_table([("stratum", "left"), ("n", "right"), ("policy", "left"), ("gated", "right"),
                          ("k", "right"), ("bound", "right"), ("mean KV", "right"), ("fallback", "left")])
    for r in rows:
        gated = "—" if r["gated_share"] is None else text.fmt_share(r["gated_share"])
        add_row(table, r["name"], str(r["n"]), r["policy"], gated, str(r["violations"]), text.fmt_bound(r["bound"]),
                f"{r['mean_kv']:.3f}", r["reason"] or "—", style="red" if r["fallback"] else None)
    print_table(console, table, title=text.strata_header(op))
    say(console, f"pooled {text.memory_words(op)} {op.mean_kv_retained:.3f} over the {op.n} certification requests "
                 "(each stratum weighted by its n); gated: share of the stratum's requests its gate sends to the "
                 "full cache; k: violations; bound: the stratum's risk upper bound.")


def print_comparison(op: OperatingPoint, pooled: OperatingPoint, console: Console) -> None:
    """The stratified certificate and the pooled comparison side by side, with each one's memory."""
    table = narrow_table([("certificate", "left"), ("policy", "left"), ("mean KV", "right"), ("k/n", "right"),
                          ("deployed", "left")])
    for r in text.comparison_rows(op, pooled):
        add_row(table, r["label"], r["policy"], f"{r['mean_kv']:.3f}", r["kn"], r["deployed"],
                style="bold" if r["deployed"].startswith("yes") else "dim")
    print_table(console, table, title="stratified vs pooled:")
    say(console, text.comparison_text(op, pooled))


def print_coverage(op: OperatingPoint, console: Console) -> None:
    """The coverage envelope in one line (nothing for a file written before it existed)."""
    line = text.coverage_text(op)
    if line:
        say(console, line, label="Coverage", style="bold")


def sequence_cells(op: OperatingPoint, row: dict[str, Any]) -> list[str]:
    """One sequence's cells as :func:`print_sequences` shows them: number, name (the candidates'
    stem), certified/total, best certified, where testing stopped, its k/n and its bound."""
    stem = row["name"]
    best = "—"
    if row["best"] is not None:
        best = text.member_label(row["best"].policy, stem) + (" ★" if row["chosen"] else "")
    stop, kn, bound = "—", "—", "—"
    if row["stop"] is not None:
        c = row["stop"]
        stop, kn = text.member_label(c.policy, stem), f"{c.violations}/{c.n}"
        bound = text.fmt_bound(c.risk_upper_bound) + ("" if c.risk_upper_bound > op.contract.risk else "*")
    return [str(row["index"]), stem, f"{row['certified']}/{row['total']}", best, stop, kn, bound]


def print_sequences(op: OperatingPoint, console: Console) -> None:
    """One row per sequence, laid out for 80 columns, with a legend that says what the cells mean."""
    rows = text.sequence_rows(op)
    fixed = op.contract.procedure in text.FIXED_ORDER
    levels = {r["level"] for r in rows}
    if len(levels) == 1 and None not in levels:
        how = f"at level {text.fmt_bound(levels.pop())}"
    else:
        how = "at Holm's step-down levels"
    order = "each tested most KV first" if fixed else "every candidate tested"
    n_cert = sum(c.certified for c in op.candidates)
    title = (f"{len(rows)} sequence{'s' if len(rows) != 1 else ''}, {len(op.candidates)} candidates, "
             f"{order} {how}: {n_cert} certified")
    stop_header = "stopped at" if fixed else "failed at"
    table = narrow_table([("seq", "right"), ("sequence", "left"), ("certified", "right"), ("best", "left"),
                          (stop_header, "left"), ("k/n", "right"), ("bound", "right")])
    for row in rows:
        add_row(table, *sequence_cells(op, row), style="bold" if row["chosen"] else None)
    print_table(console, table, title=title)
    eps = f"{op.contract.risk:g}"
    holm = any(r["stop"] is not None and r["stop"].risk_upper_bound <= op.contract.risk for r in rows)
    stopped = (
        f"stopped at: the first candidate not certified, its violations k/n and upper bound (> ε = {eps}); "
        "the candidates after it are not tested."
        if fixed else
        f"failed at: the first candidate not certified, its violations k/n and upper bound (> ε = {eps}"
        + ("; * ≤ ε, but Holm's step-down stopped before it" if holm else "")
        + "); the later candidates are tested too (--wide lists them)."
    )
    say(console, f"best: the sequence's certified candidate with the least memory (★ chosen). {stopped}")


def print_candidates(op: OperatingPoint, console: Console) -> None:
    """Every candidate, in contract order, at the table's natural width (``--wide``)."""
    rows = text.ladder_rows(op)
    gated = any(r["gated_share"] is not None for r in rows)  # gate columns only when the contract has a gate
    columns: list[tuple[str, Justify]] = [
        ("seq", "right"), ("policy", "left"), ("n", "right"), ("k", "right"), ("empirical risk", "right"),
        ("upper bound", "right"), ("p-value", "right"), ("tested level", "right"),
    ]
    columns += [("mean KV", "right"), ("gated", "right")] if gated else []
    table = narrow_table([*columns, ("status", "left")])
    style = {"certified": "green", "not certified": "red", "not tested": "dim"}
    for r in rows:
        gate_cells = []
        if gated:
            share = "—" if r["gated_share"] is None else text.fmt_share(r["gated_share"])
            gate_cells = [f"{r['mean_kv']:.3f}", share]
        add_row(
            table, str(r["sequence"]), r["policy"] + (" ★" if r["chosen"] else ""), str(r["n"]), str(r["k"]),
            f"{r['empirical_risk']:.4f}", f"{r['upper_bound']:.4f}", text.fmt_p(r["p_value"]), f"{r['level']:.3g}",
            *gate_cells, r["status"],
            style="bold" if r["chosen"] else style[r["status"]],
        )
    print_table(console, table, natural=True)


def print_per_task(op: OperatingPoint, console: Console) -> None:
    """The chosen policy's own violation rate per task, flagged when above ε (the certificate
    covers the mix, not each task)."""
    if not op.per_task or op.fallback:
        return
    eps = op.contract.risk
    table = narrow_table([("task", "left"), ("n", "right"), ("violations", "right"), ("rate", "right"),
                          (f"vs ε = {eps:g}", "left")])
    for name, b in sorted(op.per_task.items()):
        add_row(table, name, str(b.n), str(b.violations), f"{b.rate:.4f}", "above ε" if b.exceeds_risk else "≤ ε",
                style="bold red" if b.exceeds_risk else None)
    print_table(console, table, title=f"per-task breakdown of {op.policy}:")


def print_validation(result: ValidationResult, console: Console) -> None:
    """Both methods side by side, with δ: the certificate's promised bound on failures.

    A narrow table (method, share of splits above ε with its count and 95% interval, mean KV,
    fallback share) that fits 80 columns, then each method's most chosen policies on a line of
    their own: policy names are long and would otherwise fold the table in a log. A stratified
    result (``result.strata``) shows its pooled table first, then each stratum's own table and
    choices, printed the same way (each is an ordinary result).

    Parameters
    ----------
    result : certkv.core.validation.ValidationResult
    console : rich.console.Console
        80 columns without a TTY unless ``COLUMNS`` says otherwise; nothing printed is cut.
    """
    eps = result.contract.risk
    delta = text.contract_delta(result.contract)
    title = (
        f"{result.n_splits} splits of {result.n_requests} requests: {result.n_calibration} calibrate, "
        f"{result.n_test} test (seed {result.seed}); ε = {eps:g}, δ = {delta:g}"
    )
    if result.strata:
        title = f"all {len(result.strata)} {result.by} strata together, {title}"
    print_validation_table(result, console, title)
    say(console, f"test risk > ε: share (count) of splits whose test half exceeds ε; mean KV: "
                 f"{text.cost_words(result.contract.kv_cost)} of the chosen policy; fallback: share of splits that chose "
                 "the full cache"
                 + (" (strata together: share of test requests a fallback answered)." if result.strata else "."))
    if result.strata:
        for name, sub in result.strata.items():
            console.print()
            print_validation_table(sub, console, f"{result.by} {name}: {sub.n_requests} requests, "
                                                 f"{sub.n_calibration} calibrate, {sub.n_test} test")
            print_most_chosen(sub, console)
    else:
        print_most_chosen(result, console)
    per = ""
    if result.strata:
        per = (f" for each {result.by} stratum (each certified at confidence "
               f"{next(iter(result.strata.values())).contract.confidence:.12g})")
    say(
        console,
        f"certkv promises that its choice's true risk exceeds ε = {eps:g} with probability at most δ = {delta:g}{per}; "
        "empirical thresholding promises nothing. Test halves are finite and splits overlap, so these shares "
        "are noisy and descriptive, not a test of the guarantee.",
    )


def print_validation_table(result: ValidationResult, console: Console, title: str) -> None:
    """One result's methods, a row each: splits above ε (count), its 95% CI, mean KV, fallback."""
    table = narrow_table([("method", "left"), ("test risk > ε", "right"), ("95% CI", "right"),
                          ("mean KV", "right"), ("fallback", "right")])
    for name, m in result.methods.items():
        add_row(
            table,
            text.METHOD_LABELS.get(name, name),
            f"{text.fmt_share(m.exceed_fraction)} ({m.exceed_count})",
            f"{100 * m.exceed_ci_low:.1f}–{100 * m.exceed_ci_high:.1f}%",
            f"{m.mean_kv_retained:.3f}",
            text.fmt_share(m.fallback_share),
        )
    print_table(console, table, title=title)


def print_most_chosen(result: ValidationResult, console: Console) -> None:
    """Each method's two most chosen policies, with the share of splits that chose them."""
    for name, m in result.methods.items():
        top = sorted(m.chosen.items(), key=lambda kv: -kv[1])[:2]
        chosen = ", ".join(f"{p} ({100 * c / result.n_splits:.0f}%)" for p, c in top) or "—"
        say(console, f"most chosen by {text.METHOD_LABELS.get(name, name)}: {chosen}")


__all__ = [
    "print_candidates",
    "print_choice",
    "print_comparison",
    "print_coverage",
    "print_decision",
    "print_most_chosen",
    "print_operating_point",
    "print_per_task",
    "print_sequences",
    "print_strata",
    "print_strata_table",
    "print_validation",
    "print_validation_table",
    "sequence_cells",
]
