"""What a certificate means, in words: the sentences and rows the console and the HTML page share.

The console (`certkv certify`, `certkv validate`) and the HTML report (`certkv report`) explain the
same evidence, so the words live here once: where each sequence stopped and why, the status of
each candidate, the choice, the notes and the guarantee with its scope. The scope caveat (the
guarantee covers the calibration distribution, i.e. the declared task mix, not each task) is added
wherever the guarantee is shown, because a reader who skips it overestimates what was certified.

Which candidates the figures draw (:func:`shown_candidates`) is decided here too, not in
:mod:`certkv.report.figures`: the page's words must say what the figures leave out, and the
words must not need matplotlib. Nothing here imports matplotlib, rich or jinja2.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from certkv.core.policy_names import parse_policy_name
from certkv.core.procedures import FIXED_ORDER, procedure_of  # FIXED_ORDER: stop at the first failure
from certkv.kv_formats.spec import parse_format

if TYPE_CHECKING:
    from certkv.calibration.certification import ContractRecords
    from certkv.contract.schema import Contract
    from certkv.core.operating_point import CandidateResult, ContractSummary, OperatingPoint
    from certkv.core.spec import GateSettings
    from certkv.core.validation import ValidationResult

SCOPE_CAVEAT = (
    "The guarantee covers the calibration distribution (the declared task mix), not each task "
    "or each request on its own."
)
STRATA_CAVEAT = (
    "Each stratum's guarantee covers requests drawn like that stratum's calibration requests, not each "
    "request on its own."
)

METHOD_LABELS = {"certkv": "certkv (certified)", "empirical_thresholding": "empirical thresholding"}


# ----------------------------------------------------------------------------- numbers


def fmt_bound(x: float) -> str:
    """A risk or bound with 4 significant digits (``0.07169``): short enough for an 80-column
    row, precise enough to tell a bound from ε, and never cut (the caller prints all of it)."""
    return f"{x:.4g}"


def fmt_p(p: float | None) -> str:
    """A p-value or level with 3 significant digits; ``—`` when there is none (a fallback)."""
    return "—" if p is None else f"{p:.3g}"


def fmt_share(x: float) -> str:
    """A share as a percentage with one decimal (``6.5%``)."""
    return f"{100 * x:.1f}%"


def member_label(policy: str, stem: str) -> str:
    """How a row that already names a sequence (its stem) names one of its candidates.

    ``snapkv@0.50+drop0.1`` in sequence ``snapkv+drop0.1`` is ``@0.50``, the retention exactly as
    written, which keeps an 80-column row short; a candidate of another stem (an interleaved
    ``order``, a foreign loss table) keeps its full name, so the label is never ambiguous.
    """
    parsed = parse_policy_name(policy)
    if parsed.kv_retained is None or parsed.stem != stem:
        return policy
    return policy[len(parsed.display): len(policy) - len(parsed.gate)]


# ----------------------------------------------------------------------------- candidates


def is_stratum_point(op: OperatingPoint) -> bool:
    """Whether `op` is a stratified point or one stratum's entry: its coverage requires a stratum."""
    return op.coverage is not None and op.coverage.stratum_required


def guarantee_text(op: OperatingPoint) -> str:
    """The operating point's guarantee, with its scope caveat always present: the declared task mix
    for a pooled certificate, each stratum's own requests for a stratified one (where "not each
    task" would be wrong: by task, each task is certified)."""
    text = op.guarantee.strip()
    caveat = STRATA_CAVEAT if is_stratum_point(op) else SCOPE_CAVEAT
    if caveat not in text and "calibration distribution (the declared task mix)" not in text:
        text = f"{text} {caveat}"
    return text


def candidate_status(op: OperatingPoint, candidate: CandidateResult) -> str:
    """'certified', 'not certified' or 'not tested' (fixed-sequence testing stopped before it)."""
    if candidate.certified:
        return "certified"
    stop = op.sequences[candidate.sequence]
    if (
        op.contract.procedure in FIXED_ORDER
        and stop.stopped_at is not None
        and candidate.position > stop.stopped_at
    ):
        return "not tested"
    return "not certified"


def failure_reason(op: OperatingPoint, c: CandidateResult) -> str:
    """Why candidate `c` was not certified, in a few words: its bound exceeds ε, or (Holm) its
    bound is below ε but the step-down stopped at an earlier candidate."""
    if c.risk_upper_bound > op.contract.risk:
        return f"upper bound {fmt_bound(c.risk_upper_bound)} > ε = {op.contract.risk:g}"
    return f"upper bound {fmt_bound(c.risk_upper_bound)} ≤ ε but Holm's step-down stopped before it"


def _failure(op: OperatingPoint, c: CandidateResult) -> str:
    return f"{c.violations}/{c.n} violations, {failure_reason(op, c)}"


def by_sequence(op: OperatingPoint) -> list[list[CandidateResult]]:
    """The candidates of each sequence in test order, indexed like ``op.sequences``."""
    seqs: list[list[CandidateResult]] = [[] for _ in op.sequences]
    for c in op.candidates:
        seqs[c.sequence].append(c)
    return [sorted(s, key=lambda c: c.position) for s in seqs]


def policy_stem(policy: str) -> str:
    """A policy name without its retention: ``snapkv@0.50+drop0.1`` → ``snapkv+drop0.1``."""
    return parse_policy_name(policy).stem


def sequence_name(cands: Sequence[CandidateResult]) -> str:
    """A sequence's name: its candidates' shared stem (``snapkv+drop0.1``), ``empty`` for none."""
    return policy_stem(cands[0].policy) if cands else "empty"


def best_certified(cands: Sequence[CandidateResult]) -> CandidateResult | None:
    """The candidate of a sequence that the certifier's own rule
    (:func:`certkv.core.certify.select_candidates`: least mean KV retained, then fewer violations,
    then test order) picks among the sequence's certified ones, or None.

    Showing it per sequence tells a reader what each press could deliver, not only the winner."""
    from certkv.core.certify import select_candidates

    if not cands:
        return None
    index = int(select_candidates([c.certified for c in cands], [c.mean_kv_retained for c in cands],
                                  [c.violations for c in cands]))
    return cands[index] if index >= 0 else None


def sequence_rows(op: OperatingPoint) -> list[dict[str, Any]]:
    """One record per sequence, for a narrow console table: name, how far testing got, where it
    stopped (or first failed) and why, and the best certified candidate.

    A gate grid turns a contract into hundreds of candidates but only tens of sequences, and a
    sequence's story (certified down to here, stopped there because of this bound) is what a
    reader of a log needs; the candidates are in the JSON.

    Returns
    -------
    list of dict
        Per sequence, in ``op.sequences`` order: ``index``, ``name`` (the stem), ``level``,
        ``certified`` and ``total`` (counts), ``stop`` (the first candidate not certified, or
        None; :func:`failure_reason` says why), ``best`` (:func:`best_certified`, or None) and
        ``chosen`` (whether ``best`` is the operating point's choice). Values are the operating
        point's own, unformatted, so each medium formats them its own way.
    """
    rows = []
    for stop, cands in zip(op.sequences, by_sequence(op)):
        failed = cands[stop.stopped_at] if stop.stopped_at is not None else None
        best = best_certified(cands)
        rows.append(
            {
                "index": stop.index,
                "name": sequence_name(cands),
                "level": stop.level,
                "certified": stop.certified,
                "total": len(stop.policies),
                "stop": failed,
                "best": best,
                "chosen": best is not None and not op.fallback and best.policy == op.policy,
            }
        )
    return rows


def sequence_summaries(op: OperatingPoint) -> list[str]:
    """One sentence per sequence: how far testing went and why it stopped."""
    out = []
    for stop, cands in zip(op.sequences, by_sequence(op)):
        level = f"level {stop.level:.4g}" if stop.level is not None else "Holm's step-down levels"
        head = f"sequence {stop.index} ({sequence_name(cands)}, {level}): {stop.certified}/{len(stop.policies)} certified"
        if stop.stopped_at is None:
            out.append(f"{head}; every candidate passed, down to {stop.policies[-1]}.")
            continue
        failed = cands[stop.stopped_at]
        if op.contract.procedure in FIXED_ORDER:
            untested = len(stop.policies) - stop.stopped_at - 1
            tail = f"; {untested} later candidate{'s' if untested != 1 else ''} not tested" if untested else ""
            out.append(f"{head}; stopped at {failed.policy}: {_failure(op, failed)}{tail}.")
        else:
            out.append(f"{head}; first failure {failed.policy}: {_failure(op, failed)}.")
    return out


def ladder_rows(op: OperatingPoint) -> list[dict[str, Any]]:
    """The full candidate table shared by `certkv certify --wide` and the HTML page, in contract
    order; values unformatted so each medium formats them its own way."""
    return [
        {
            "sequence": c.sequence,
            "policy": c.policy,
            "n": c.n,
            "k": c.violations,
            "empirical_risk": c.empirical_risk,
            "upper_bound": c.risk_upper_bound,
            "p_value": c.p_value,
            "level": c.level,
            "status": candidate_status(op, c),
            "chosen": (not op.fallback) and c.policy == op.policy,
            "mean_kv": c.mean_kv_retained,
            "gated_share": c.gated_share if c.gate is not None else None,
        }
        for c in sorted(op.candidates, key=lambda c: (c.sequence, c.position))
    ]


def shown_candidates(op: OperatingPoint) -> list[list[CandidateResult]]:
    """The candidates the figures draw, by sequence: every ungated one, plus the chosen candidate's
    gated family (same press entry and gate setting). A gate grid multiplies the candidates, and
    drawing all of them makes the figures unreadable; the tables list every one."""
    chosen = None if op.fallback else next((c for c in op.candidates if c.policy == op.policy), None)
    family = policy_stem(chosen.policy) if chosen is not None and chosen.gate is not None else None
    shown = [[c for c in seq if c.gate is None or policy_stem(c.policy) == family] for seq in by_sequence(op)]
    shown = [seq for seq in shown if seq]
    return shown or [seq for seq in by_sequence(op) if seq]  # a spec of gated candidates only: all


def hidden_count(op: OperatingPoint) -> int:
    """How many candidates the figures leave out (see :func:`shown_candidates`)."""
    return len(op.candidates) - sum(len(s) for s in shown_candidates(op))


def gated_figure_note(op: OperatingPoint) -> str:
    """What the figures leave out when the contract has a gate grid (the table lists everything)."""
    hidden = hidden_count(op)
    if not hidden:
        return ""
    extra = " and the chosen candidate's gated sequence" if op.gate is not None else ""
    return (f" The figures show the ungated sequences{extra}; the {hidden} other gated candidates are in the "
            "table below (gated: share of requests their gate sends to the full cache, counted at memory 1.0).")


# ----------------------------------------------------------------------------- the choice and notes


def gate_text(gate: GateSettings) -> str:
    """A gate setting in words, e.g. ``full cache when agreement drop < 0.1 or certificate > 0.5``."""
    parts = []
    if gate.agreement_drop is not None:
        parts.append(f"agreement drop < {gate.agreement_drop:g}")
    if gate.certificate is not None:
        parts.append(f"certificate > {gate.certificate:g}")
    if getattr(gate, "confidence", None) is not None:
        parts.append(f"lowest token probability < {gate.confidence:.4g}")
    if getattr(gate, "lookahead", None) is not None:
        parts.append(f"lookahead evicted mass > {gate.lookahead:.4g}")
    if gate.learned is not None and gate.learned_threshold is not None:
        parts.append(f"learned score > {gate.learned_threshold:.4g} ({len(gate.learned.features)} features)")
    if gate.recompute is not None:
        parts.append(f"a token's probability < {gate.recompute:.4g} (restart mid-answer)")
    if gate.certificate_recompute is not None:
        parts.append(f"a step's certificate > {gate.certificate_recompute:.4g} (restart mid-answer)")
    placed = ""
    if getattr(gate, "quantile", None) is not None:
        placed = f", placed at pilot quantile {gate.quantile:g}"
    return "full cache when " + " or ".join(parts) + placed


def choice_summary(op: OperatingPoint) -> str:
    """The chosen policy and its memory in one sentence (nominal and realised retention); for a
    stratified point, each stratum's policy and the pooled memory (:func:`stratified_summary`)."""
    if op.is_stratified and not op.fallback:
        return stratified_summary(op)
    if op.fallback:
        return f"full cache (fallback): {op.reason}"
    actual = "" if op.kv_retained_actual is None else f", realised {op.kv_retained_actual:.3f}"
    gate = ""
    if op.gate is not None:
        gate = f", gated ({gate_text(op.gate)}: {fmt_share(op.gated_share)} of calibration requests)"
    return (
        f"{op.policy} (press {op.press}{_format(op)}{gate}): kv_retained {op.kv_retained:g} nominal{actual}, "
        f"mean memory {op.mean_kv_retained:.3f}{_measure(op)}, so {100 * (1 - op.mean_kv_retained):.1f}% of the KV "
        f"cache saved; {op.violations}/{op.n} violations, risk upper bound {fmt_bound(op.risk_upper_bound)} "
        f"≤ ε = {op.contract.risk:g}{_engine(op)}"
    )


def _format(op: OperatingPoint) -> str:
    """The point's KV format, after its press (nothing for a 16-bit point)."""
    if op.kv_format is None:
        return ""
    return f", KV stored as {parse_format(op.kv_format).name}"


def _engine(op: OperatingPoint) -> str:
    """Where a serving engine stores the point's format alike (the certificate speaks for certkv's runtime)."""
    if op.engine_setting is None:
        return ""
    return f". In an engine: {op.engine_setting} (its kernels differ: certify the engine itself)"


def _measure(op: OperatingPoint) -> str:
    """What the mean memory measures, when it is a generation's cost rather than the nominal share."""
    if op.contract.kv_cost == "bytes" and op.mean_kv_bytes is not None:
        return f" (peak KV bytes over a 16-bit cache's; {op.mean_kv_bytes:.3f} over its decoding steps)"
    return {"peak": " (peak KV)", "time": " (KV-time)"}.get(op.contract.kv_cost, "")


def stratified_summary(op: OperatingPoint) -> str:
    """A stratified point in one sentence: each stratum's policy, the memory pooled over the strata
    (each weighted by its certification requests) and the summed violations."""
    assert op.strata is not None, "a stratified operating point"
    by = op.strata.by
    parts = [f"{name} {'full cache (fallback)' if e.fallback else e.policy}" for name, e in op.strata.entries.items()]
    return (
        f"per {by}: {'; '.join(parts)}. Mean memory {op.mean_kv_retained:.3f} pooled over the {op.n} "
        f"certification requests, so {100 * (1 - op.mean_kv_retained):.1f}% of the KV cache saved; "
        f"{op.violations}/{op.n} violations, largest stratum bound {fmt_bound(op.risk_upper_bound)} "
        f"≤ ε = {op.contract.risk:g} ({joint_or_not(op)})"
    )


def joint_or_not(op: OperatingPoint) -> str:
    """Whether the strata's bounds hold together, which the largest of them needs to mean anything joint."""
    assert op.strata is not None, "a stratified operating point"
    if op.strata.simultaneous:
        return "all strata's bounds hold together"
    return "each stratum's bound at its own confidence, not jointly"


def short_reason(op: OperatingPoint) -> str:
    """Why a stratum fell back, in a table cell's few words (the note gives the whole reason)."""
    if not op.fallback:
        return ""
    reason = op.reason or ""
    if "too small to certify" in reason:
        return "too small"
    if "no candidate was certified" in reason:
        return "none certified"
    return reason.split(";")[0][:24]


def stratum_rows(op: OperatingPoint) -> list[dict[str, Any]]:
    """One record per stratum of a stratified point, unformatted: name, n, policy (``full`` on a
    fallback), gated share (None without a gate), violations, bound, mean KV and short reason."""
    assert op.strata is not None, "a stratified operating point"
    return [
        {
            "name": name,
            "n": e.n,
            "policy": "full" if e.fallback else e.policy,
            "gated_share": e.gated_share if e.gate is not None and not e.fallback else None,
            "violations": e.violations,
            "bound": e.risk_upper_bound,
            "mean_kv": e.mean_kv_retained,
            "fallback": e.fallback,
            "reason": short_reason(e),
        }
        for name, e in op.strata.entries.items()
    ]


def strata_header(op: OperatingPoint) -> str:
    """What was stratified, and at which confidence each stratum was certified."""
    s = op.strata
    assert s is not None, "a stratified operating point"
    reading = (f"jointly: each at confidence {s.confidence:.12g} = 1 − δ/{len(s.entries)}" if s.simultaneous
               else f"each on its own at confidence {s.confidence:.12g}")
    return f"{len(s.entries)} {s.by} strata, certified {reading}:"


def comparison_rows(op: OperatingPoint, pooled: OperatingPoint) -> list[dict[str, Any]]:
    """The stratified certificate (deployed) and the pooled comparison (strata removed, not
    deployed), side by side: label, policy, mean KV retained, violations/n, deployed."""
    def row(label: str, point: OperatingPoint, policy: str, deployed: str) -> dict[str, Any]:
        return {"label": label, "policy": policy, "mean_kv": point.mean_kv_retained,
                "kn": f"{point.violations}/{point.n}", "deployed": deployed}

    assert op.strata is not None, "a stratified operating point"
    stratified = "full cache (fallback)" if op.fallback else f"per {op.strata.by} ({len(op.strata.entries)} strata)"
    pooled_policy = "full cache (fallback)" if pooled.fallback else pooled.policy
    return [row("stratified", op, stratified, "yes (the contract's)"),
            row("pooled", pooled, pooled_policy, "no: comparison only")]


def comparison_text(op: OperatingPoint, pooled: OperatingPoint) -> str:
    """The comparison in words: which one is deployed, and what the pooled one is."""
    assert op.strata is not None, "a stratified operating point"
    return (
        f"stratified: the contract's certificate (strata by {op.strata.by}), deployed; pooled: the same contract "
        "and records certified with the strata removed (one certificate for the whole mix), a comparison only, "
        "never deployed. mean KV: mean KV retained over the certification requests."
    )


def deployed_text(op: OperatingPoint, pooled: OperatingPoint | None = None) -> str:
    """Which certificate is deployed (the contract's: stratified when it has strata) and its memory;
    with the pooled comparison's policy and memory after it, marked as not deployed."""
    if op.strata is not None:  # stratified
        every = ", every one fell back to the full cache" if op.fallback else ""
        what = f"stratified per {op.strata.by} ({len(op.strata.entries)} strata{every})"
    else:
        what = "the full cache (fallback)" if op.fallback else op.policy
    line = f"deployed: the contract's operating point, {what}, {memory_words(op)} {op.mean_kv_retained:.3f}"
    if pooled is not None:
        policy = "full cache (fallback)" if pooled.fallback else pooled.policy
        line += (f"; pooled comparison (strata removed, not deployed): {policy}, "
                 f"{memory_words(pooled)} {pooled.mean_kv_retained:.3f}")
    return line


#: What a contract's ``kv_cost`` averages over the certification requests, in words.
COST_WORDS = {"kv_retained": "mean KV retained", "peak": "mean peak KV", "time": "mean KV-time",
              "bytes": "mean KV bytes (of a 16-bit cache's)"}


def cost_words(kv_cost: str) -> str:
    """What a point's mean memory (``mean_kv_retained``, the contract's ``kv_cost`` averaged) is, in words."""
    return COST_WORDS.get(kv_cost, "mean KV retained")


def memory_words(op: OperatingPoint) -> str:
    """What a point's mean memory is, in words (:func:`cost_words` of its contract's ``kv_cost``)."""
    return cost_words(op.contract.kv_cost)


def coverage_text(op: OperatingPoint) -> str | None:
    """The coverage envelope in one sentence (None for a file written before it existed): what was
    calibrated, so what the runtime serves; anything outside is answered from the full cache."""
    cov = op.coverage
    if cov is None:
        return None
    parts = []
    if cov.strata:
        need = " (a request must name one)" if cov.stratum_required else ""
        parts.append(f"{cov.by} {', '.join(cov.strata)}{need}")
    if cov.context_tokens is not None:
        low, high = cov.context_tokens
        margin = f" widened by {cov.context_margin:g}" if cov.context_margin else ""
        parts.append(f"contexts of {low}-{high} tokens{margin}")
    if cov.max_new_tokens is not None:
        parts.append(f"decode {cov.max_new_tokens} tokens")
    what = "; ".join(parts) or "nothing recorded"
    return f"{what}. Requests outside it are answered from the full cache (reason uncovered)."


def skipped_note(records: ContractRecords) -> str | None:
    """Requests the calibration skipped are not in n; say so, with an example reason."""
    if not records.skipped:
        return None
    first = records.skipped[0]
    return (
        f"{len(records.skipped)} request(s) were skipped during calibration (e.g. {first['request_id']}: "
        f"{first['reason']}) and are not part of n; the guarantee covers requests like those calibrated."
    )


def gate_note(contract: Contract) -> str | None:
    """How the contract's gate grid entered the test: gated candidates, derived from the base
    candidates' records, each in its own sequence (or in the interleaved order)."""
    gate = getattr(contract, "gate", None)
    if gate is None:
        return None
    from certkv.contract.spec import gated_candidates, sequences

    n_gated = len(gated_candidates(contract))
    m = len(sequences(contract))
    split = "one interleaved order at the full δ" if contract.order is not None else f"δ split over {m} sequences"
    if procedure_of(contract.procedure).orders_by_pilot:
        split = "one sequence ordered by pilot risk, at the full δ"
    grid = []
    if gate.agreement_drop:
        grid.append(f"agreement_drop {gate.agreement_drop}")
    if gate.certificate:
        grid.append(f"certificate {gate.certificate}")
    for kind in ("confidence", "lookahead", "learned"):
        block = getattr(gate, kind, None)
        if block is not None:
            grid.append(f"{kind} quantiles {block.quantiles}")
    if not grid:
        return None
    return (
        f"gate grid ({', '.join(grid)}): {n_gated} gated candidates derived from the base candidates' records "
        f"(loss 0 and memory 1.0 on requests the gate sends to the full cache), tested with the others ({split})"
    )


def all_notes(contract: Contract, records: ContractRecords, op: OperatingPoint, extra: list[str] | None = None) -> list[str]:
    """Every note a reader of the certificate needs, in one order for the console and the page:
    skipped requests, the gate grid, the caller's notes, then the certifier's (per-task, incomplete)."""
    return [n for n in (skipped_note(records), gate_note(contract)) if n] + [*(extra or []), *op.notes]


# ----------------------------------------------------------------------------- validation


def validation_line(result: ValidationResult, method: str) -> str:
    """How often a method's choice exceeded ε on the test half, with its 95% interval."""
    m = result.methods[method]
    return (
        f"{METHOD_LABELS.get(method, method)}: test risk > ε in {fmt_share(m.exceed_fraction)} of "
        f"{result.n_splits} splits (95% CI {100 * m.exceed_ci_low:.1f}–{100 * m.exceed_ci_high:.1f}%), "
        f"{cost_words(result.contract.kv_cost)} {m.mean_kv_retained:.3f}, fallback in {fmt_share(m.fallback_share)} of splits"
    )


def contract_delta(contract_summary: ContractSummary) -> float:
    """δ = 1 − confidence without the subtraction's float noise."""
    from certkv.core.spec import delta_of

    return delta_of(contract_summary.confidence)


__all__ = [
    "METHOD_LABELS",
    "SCOPE_CAVEAT",
    "STRATA_CAVEAT",
    "all_notes",
    "best_certified",
    "by_sequence",
    "candidate_status",
    "choice_summary",
    "comparison_rows",
    "comparison_text",
    "contract_delta",
    "coverage_text",
    "deployed_text",
    "failure_reason",
    "fmt_bound",
    "fmt_p",
    "fmt_share",
    "gate_note",
    "gate_text",
    "gated_figure_note",
    "guarantee_text",
    "hidden_count",
    "is_stratum_point",
    "ladder_rows",
    "member_label",
    "policy_stem",
    "sequence_name",
    "sequence_rows",
    "sequence_summaries",
    "short_reason",
    "shown_candidates",
    "skipped_note",
    "strata_header",
    "stratified_summary",
    "stratum_rows",
    "validation_line",
]
