"""What a certificate means, in words and pictures: shared text, the figures and the HTML report.

The console (`certkv certify`, `certkv validate`) and the HTML report (`certkv report`) explain the
same evidence, so the sentences live here once: where each sequence stopped and why, the status of
each candidate, and the guarantee with its scope. The scope caveat (the guarantee covers the
calibration distribution, i.e. the declared task mix, not each task) is added wherever the
guarantee is shown, because a reader who skips it overestimates what was certified.

Importing this module is cheap: matplotlib is imported, and the Agg backend selected, inside the
functions that draw, so importing certkv never changes a user's matplotlib backend.
"""

from __future__ import annotations

import base64
import html
from datetime import datetime, timezone
from pathlib import Path

from certkv.core.policy_names import parse_policy_name

SCOPE_CAVEAT = (
    "The guarantee covers the calibration distribution (the declared task mix), not each task "
    "or each request on its own."
)
FIGURES = ("risk_vs_kv.png", "per_task.png", "validation.png")
METHOD_LABELS = {"certkv": "certkv (certified)", "empirical_thresholding": "empirical thresholding"}

# ----------------------------------------------------------------------------- words


def guarantee_text(op) -> str:
    """The operating point's guarantee, with the calibration-distribution caveat always present."""
    text = op.guarantee.strip()
    if "calibration distribution (the declared task mix)" not in text:
        text = f"{text} {SCOPE_CAVEAT}"
    return text


def candidate_status(op, candidate) -> str:
    """'certified', 'not certified' or 'not tested' (fixed-sequence testing stopped before it)."""
    if candidate.certified:
        return "certified"
    stop = op.sequences[candidate.sequence]
    if (
        op.contract.procedure == "fixed_sequence"
        and stop.stopped_at is not None
        and candidate.position > stop.stopped_at
    ):
        return "not tested"
    return "not certified"


def _failure(op, c) -> str:
    why = (
        f"upper bound {c.risk_upper_bound:.4g} > ε = {op.contract.risk:g}"
        if c.risk_upper_bound > op.contract.risk
        else f"upper bound {c.risk_upper_bound:.4g} ≤ ε but Holm's step-down stopped before it"
    )
    return f"{c.violations}/{c.n} violations, {why}"


def sequence_summaries(op) -> list[str]:
    """One sentence per sequence: how far testing went and why it stopped."""
    out = []
    by_seq: dict[int, list] = {}
    for c in op.candidates:
        by_seq.setdefault(c.sequence, []).append(c)
    for stop in op.sequences:
        cands = sorted(by_seq.get(stop.index, []), key=lambda c: c.position)
        name = _sequence_name(cands)
        level = f"level {stop.level:.4g}" if stop.level is not None else "Holm's step-down levels"
        head = f"sequence {stop.index} ({name}, {level}): {stop.certified}/{len(stop.policies)} certified"
        if stop.stopped_at is None:
            out.append(f"{head}; every candidate passed, down to {stop.policies[-1]}.")
            continue
        failed = cands[stop.stopped_at]
        if op.contract.procedure == "fixed_sequence":
            untested = len(stop.policies) - stop.stopped_at - 1
            tail = f"; {untested} later candidate{'s' if untested != 1 else ''} not tested" if untested else ""
            out.append(f"{head}; stopped at {failed.policy}: {_failure(op, failed)}{tail}.")
        else:
            out.append(f"{head}; first failure {failed.policy}: {_failure(op, failed)}.")
    return out


def _sequence_name(cands) -> str:
    if not cands:
        return "empty"
    return policy_stem(cands[0].policy)


def policy_stem(policy: str) -> str:
    """A policy name without its retention: ``snapkv@0.50+drop0.1`` → ``snapkv+drop0.1``."""
    return parse_policy_name(policy).stem


def gate_text(gate) -> str:
    """A gate setting in words, e.g. ``full cache when agreement drop < 0.1 or certificate > 0.5``."""
    parts = []
    if gate.agreement_drop is not None:
        parts.append(f"agreement drop < {gate.agreement_drop:g}")
    if gate.certificate is not None:
        parts.append(f"certificate > {gate.certificate:g}")
    return "full cache when " + " or ".join(parts)


def choice_summary(op) -> str:
    """The chosen policy and its memory in one sentence (nominal and realised retention)."""
    if op.fallback:
        return f"full cache (fallback): {op.reason}"
    actual = "" if op.kv_retained_actual is None else f", realised {op.kv_retained_actual:.3f}"
    gate = ""
    if op.gate is not None:
        gate = f", gated ({gate_text(op.gate)}: {100 * op.gated_share:.1f}% of calibration requests)"
    return (
        f"{op.policy} (press {op.press}{gate}): kv_retained {op.kv_retained:g} nominal{actual}, "
        f"mean memory {op.mean_kv_retained:.3f}, so {100 * (1 - op.mean_kv_retained):.1f}% of the KV "
        f"cache saved; {op.violations}/{op.n} violations, risk upper bound {op.risk_upper_bound:.4g} "
        f"≤ ε = {op.contract.risk:g}"
    )


def skipped_note(records) -> str | None:
    """Requests the calibration skipped are not in n; say so, with an example reason."""
    if not records.skipped:
        return None
    first = records.skipped[0]
    return (
        f"{len(records.skipped)} request(s) were skipped during calibration (e.g. {first['request_id']}: "
        f"{first['reason']}) and are not part of n; the guarantee covers requests like those calibrated."
    )


def gate_note(contract) -> str | None:
    """How the contract's gate grid entered the test: gated candidates, derived from the base
    candidates' records, each in its own sequence (or in the interleaved order)."""
    gate = getattr(contract, "gate", None)
    if gate is None:
        return None
    n_gated = len(contract.gated_candidates())
    m = len(contract.sequences())
    split = "one interleaved order at the full δ" if contract.order is not None else f"δ split over {m} sequences"
    grid = []
    if gate.agreement_drop:
        grid.append(f"agreement_drop {gate.agreement_drop}")
    if gate.certificate:
        grid.append(f"certificate {gate.certificate}")
    return (
        f"gate grid ({', '.join(grid)}): {n_gated} gated candidates derived from the base candidates' records "
        f"(loss 0 and memory 1.0 on requests the gate sends to the full cache), tested with the others ({split})"
    )


def validation_line(result, method: str) -> str:
    """How often a method's choice exceeded ε on the test half, with its 95% interval."""
    m = result.methods[method]
    return (
        f"{METHOD_LABELS.get(method, method)}: test risk > ε in {100 * m.exceed_fraction:.1f}% of "
        f"{result.n_splits} splits (95% CI {100 * m.exceed_ci_low:.1f}–{100 * m.exceed_ci_high:.1f}%), "
        f"mean KV retained {m.mean_kv_retained:.3f}, fallback in {100 * m.fallback_share:.1f}% of splits"
    )


def contract_delta(contract_summary) -> float:
    """δ = 1 − confidence without the subtraction's float noise."""
    from certkv.core.spec import delta_of

    return delta_of(contract_summary.confidence)


# ----------------------------------------------------------------------------- figures


def _pyplot():
    """matplotlib.pyplot on the Agg backend, selected here rather than at import time."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _by_sequence(op) -> list[list]:
    seqs: list[list] = [[] for _ in op.sequences]
    for c in op.candidates:
        seqs[c.sequence].append(c)
    return [sorted(s, key=lambda c: c.position) for s in seqs]


def shown_candidates(op) -> list[list]:
    """The candidates the figures draw, by sequence: every ungated one, plus the chosen candidate's
    gated family (same press entry and gate setting). A gate grid multiplies the candidates, and
    drawing all of them makes the figures unreadable; the tables list every one."""
    chosen = None if op.fallback else next((c for c in op.candidates if c.policy == op.policy), None)
    family = policy_stem(chosen.policy) if chosen is not None and chosen.gate is not None else None
    shown = [[c for c in seq if c.gate is None or policy_stem(c.policy) == family] for seq in _by_sequence(op)]
    shown = [seq for seq in shown if seq]
    return shown or [seq for seq in _by_sequence(op) if seq]  # a spec of gated candidates only: all


def _hidden_count(op) -> int:
    return len(op.candidates) - sum(len(s) for s in shown_candidates(op))


def plot_risk_vs_kv(op, title: str | None = None):
    """Empirical risk and Clopper–Pearson upper bound against kv_retained, one panel per sequence.

    Values far above ε would squash the interesting region near ε, so the y axis stops at a few ε
    and larger values are drawn on the top edge with their value written next to them.
    """
    plt = _pyplot()
    from matplotlib.lines import Line2D

    eps = op.contract.risk
    seqs = shown_candidates(op)
    shown = [c for seq in seqs for c in seq]
    values = [v for c in shown for v in (c.empirical_risk, c.risk_upper_bound)]
    top = max(values) * 1.12 if max(values) <= 4 * eps else 4 * eps
    top = min(max(top, 2 * eps), 1.05)
    n_panels = len(seqs)
    all_x = [c.kv_retained for c in shown]
    pad = max(0.05, 0.08 * (max(all_x) - min(all_x)))
    xlim = (min(1.02, max(all_x) + pad), max(0.0, min(all_x) - pad))  # most KV on the left: test order
    fig, axes = plt.subplots(1, n_panels, figsize=(max(8.5, 5.2 * n_panels), 5.0), sharey=True, squeeze=False)
    chosen = None if op.fallback else op.policy
    colors = {"certified": "#1a9850", "not certified": "#d73027", "not tested": "#9e9e9e"}
    for ax, cands in zip(axes[0], seqs):
        x = [c.kv_retained for c in cands]
        emp = [min(c.empirical_risk, top) for c in cands]
        ub = [min(c.risk_upper_bound, top) for c in cands]
        ax.fill_between(x, emp, ub, color="#4575b4", alpha=0.10, linewidth=0)
        ax.plot(x, emp, "-", color="#4575b4", lw=1.5, zorder=2)
        ax.plot(x, ub, "--", color="#4575b4", lw=1.5, zorder=2)
        for c in cands:
            status = candidate_status(op, c)
            col = colors[status]
            ax.plot(c.kv_retained, min(c.empirical_risk, top), "o", ms=6, color="#4575b4", zorder=3)
            ax.plot(c.kv_retained, min(c.risk_upper_bound, top), "v", ms=9, zorder=4,
                    markerfacecolor=col if status == "certified" else "white", markeredgecolor=col, markeredgewidth=1.8)
            if c.risk_upper_bound > top:  # drawn on the top edge: write the true bound just above it
                ax.annotate(f"↑{c.risk_upper_bound:.2f}", (c.kv_retained, top), textcoords="offset points",
                            xytext=(0, 6), ha="center", va="bottom", fontsize=8, color="#444444", annotation_clip=False)
            if c.policy == chosen:
                ax.plot(c.kv_retained, min(c.risk_upper_bound, top), "*", ms=30, color="#fdae61",
                        markeredgecolor="black", zorder=3.5)
                # Risk rises towards less KV (right), so the top-left corner is free for the label.
                ax.annotate(f"chosen: {c.policy}", (c.kv_retained, min(c.risk_upper_bound, top)),
                            xytext=(0.03, 0.93), textcoords="axes fraction", ha="left", va="top", fontsize=9,
                            weight="bold", arrowprops=dict(arrowstyle="->", color="black", lw=1,
                                                           shrinkB=12, connectionstyle="arc3,rad=0.15"))
        ax.axhline(eps, color="black", lw=1.2, ls=":")
        ax.text(0.99, eps, f" ε = {eps:g}", transform=ax.get_yaxis_transform(), va="bottom", ha="right", fontsize=9)
        stop = op.sequences[cands[0].sequence] if cands else None
        level = f"tested at level {stop.level:.3g}" if stop is not None and stop.level is not None else "Holm step-down"
        ax.set_title(f"{_sequence_name(cands)}  ({level})", fontsize=11, pad=20)
        ax.set_xlabel("KV retained (nominal fraction kept)  →  more eviction")
        ax.set_xlim(*xlim)
        ax.set_ylim(0, top)
        ax.grid(alpha=0.3)
    clip_note = "" if max(values) <= top else f"\n(above {top:.2g}: drawn on the top edge, bound written)"
    axes[0][0].set_ylabel(f"violation rate (share of requests){clip_note}")
    handles = [
        Line2D([], [], color="#4575b4", marker="o", lw=1.5, label="empirical risk k/n"),
        Line2D([], [], color="#4575b4", marker="v", ls="--", lw=1.5, markerfacecolor="white",
               label="Clopper–Pearson upper bound"),
        Line2D([], [], color=colors["certified"], marker="v", ls="", ms=9, label="certified (bound ≤ ε)"),
        Line2D([], [], color=colors["not certified"], marker="v", ls="", ms=9, markerfacecolor="white",
               markeredgewidth=1.8, label="not certified"),
        Line2D([], [], color="black", ls=":", label="risk target ε"),
    ]
    if any(candidate_status(op, c) == "not tested" for c in shown):
        handles.insert(4, Line2D([], [], color=colors["not tested"], marker="v", ls="", ms=9, markerfacecolor="white",
                                 markeredgewidth=1.8, label="not tested (sequence stopped)"))
    if chosen:
        handles.append(Line2D([], [], color="#fdae61", marker="*", ls="", ms=14, markeredgecolor="black",
                              label="chosen operating point"))
    ncol = min(len(handles), 3 if n_panels == 1 else 4)
    fig.legend(handles=handles, loc="lower center", ncol=ncol, fontsize=9, frameon=False)
    what = "fallback to the full cache" if op.fallback else f"chosen {op.policy}"
    hidden = _hidden_count(op)
    hidden_note = f"; {hidden} other gated candidates are in the table, not drawn" if hidden else ""
    fig.suptitle(
        title or f"Violation risk vs KV retained: {what}\n"
        f"n = {op.n}, ε = {eps:g}, confidence {op.contract.confidence:g}, {op.contract.procedure}{hidden_note}",
        fontsize=12,
    )
    legend_rows = -(-len(handles) // ncol)
    fig.tight_layout(rect=(0, 0.045 * legend_rows + 0.02, 1, 0.97))
    return fig


def plot_per_task(op, title: str | None = None):
    """Heatmap of each task's own violation rate under each candidate; cells above ε are flagged.

    The certificate covers the task mix, so a task can sit above ε under a certified candidate;
    this figure shows which.
    """
    plt = _pyplot()
    import numpy as np
    from matplotlib.colors import TwoSlopeNorm
    from matplotlib.patches import Rectangle

    eps = op.contract.risk
    groups = shown_candidates(op)
    cands = [c for seq in groups for c in seq]
    tasks = sorted({t for c in cands for t in c.per_task})
    if not tasks:
        fig, ax = plt.subplots(figsize=(7, 2.5))
        ax.axis("off")
        ax.text(0.5, 0.5, "The records have no task column: no per-task breakdown.", ha="center", va="center", fontsize=12)
        fig.suptitle(title or "Per-task violation rates", fontsize=12)
        return fig
    # Candidates on rows: contracts have many more candidates than tasks, and a tall figure stays
    # legible when a page scales it to its width, a very wide one does not.
    rates = np.array([[c.per_task[t].rate if t in c.per_task else np.nan for t in tasks] for c in cands])
    vmax = max(2 * eps, float(np.nanmax(rates)), eps * 1.01)
    norm = TwoSlopeNorm(vmin=0.0, vcenter=eps, vmax=vmax)
    width = max(6.5, 0.95 * len(tasks) + 4.5)
    height = max(3.4, 0.36 * len(cands) + 2.4)
    fig, ax = plt.subplots(figsize=(width, height))
    im = ax.imshow(rates, cmap="RdYlGn_r", norm=norm, aspect="auto")
    for i, c in enumerate(cands):
        for j, t in enumerate(tasks):
            cell = c.per_task.get(t)
            if cell is None:
                continue
            over = cell.rate > eps
            r, g, b, _ = im.cmap(norm(cell.rate))
            ink = "white" if 0.299 * r + 0.587 * g + 0.114 * b < 0.45 else "black"  # readable on dark cells
            ax.text(j, i, f"{100 * cell.rate:.0f}%" if cell.rate >= 0.1 else f"{100 * cell.rate:.1f}%",
                    ha="center", va="center", fontsize=8, weight="bold" if over else "normal", color=ink)
    for i, c in enumerate(cands):
        if not op.fallback and c.policy == op.policy:
            ax.add_patch(Rectangle((-0.5, i - 0.5), len(tasks), 1, fill=False, lw=2.5, edgecolor="black"))
    bounds = np.cumsum([len(s) for s in groups])[:-1]
    for b in bounds:
        ax.axhline(b - 0.5, color="white", lw=3)
    labels = [f"{c.policy}{' ✓' if c.certified else ''}" for c in cands]
    ax.set_yticks(range(len(cands)), labels, fontsize=9)
    n_of = {t: next(c.per_task[t].n for c in cands if t in c.per_task) for t in tasks}
    ax.set_xticks(range(len(tasks)), [f"{t}\n(n={n_of[t]})" for t in tasks], rotation=30 if len(tasks) > 6 else 0,
                  ha="right" if len(tasks) > 6 else "center", fontsize=9)
    ax.set_ylabel("candidate (test order)")
    ax.set_xlabel("task      (✓ = certified; black box = chosen policy)")
    bar = fig.colorbar(im, ax=ax, fraction=0.05, pad=0.02)
    bar.set_label("task's own violation rate")
    bar.ax.axhline(eps, color="black", lw=2)
    ticks = sorted({0.0, eps / 2, eps, float(f"{(eps + vmax) / 2:.2g}"), vmax})
    bar.set_ticks(ticks, labels=[f"ε = {100 * t:.3g}%" if t == eps else f"{100 * t:.3g}%" for t in ticks])
    hidden = _hidden_count(op)
    hidden_note = f"\n({hidden} other gated candidates not shown)" if hidden else ""
    fig.suptitle(title or f"Per-task violation rates (green ≤ ε < red; bold: task above ε){hidden_note}", fontsize=12)
    fig.tight_layout()
    return fig


def plot_validation(result, title: str | None = None):
    """Histograms of the chosen policy's test-half violation rate over splits, both methods."""
    plt = _pyplot()
    import numpy as np

    eps = result.contract.risk
    n_test = result.n_test
    all_risks = np.concatenate([np.asarray(m.test_risks) for m in result.methods.values()])
    k_max = int(round(max(all_risks.max(), eps * 1.5) * n_test)) + 1
    step = max(1, int(np.ceil(k_max / 60)))  # at most ~60 bins, each a whole number of violations
    edges = (np.arange(0, k_max + step + 1, step) - 0.5) / n_test
    fig, ax = plt.subplots(figsize=(8.5, 5.2))
    colors = {"certkv": "#1a9850", "empirical_thresholding": "#d73027"}
    names = list(result.methods)
    labels = []
    for method in names:
        m = result.methods[method]
        labels.append(
            f"{METHOD_LABELS.get(method, method)}: {100 * m.exceed_fraction:.1f}% of splits exceed ε "
            f"(95% CI {100 * m.exceed_ci_low:.1f}–{100 * m.exceed_ci_high:.1f}%), mean KV retained {m.mean_kv_retained:.2f}"
        )
    # Side-by-side bars per bin (overlapping translucent bars mix into a third colour).
    ax.hist([result.methods[m].test_risks for m in names], bins=edges, color=[colors.get(m, "#4575b4") for m in names],
            label=labels, edgecolor="white", lw=0.3)
    exceed_edge = (np.floor(eps * n_test + 1e-9) + 0.5) / n_test  # first count above ε·n_test starts here
    ax.axvspan(exceed_edge, edges[-1], color="#d73027", alpha=0.07, lw=0, label="test risk above ε (counts as exceeding)")
    ax.axvline(eps, color="black", ls=":", lw=1.5, label=f"risk target ε = {eps:g}")
    ax.set_xlabel(f"test-half violation rate of the chosen policy (n_test = {n_test}; a full-cache fallback scores 0)")
    ax.set_ylabel("number of splits")
    ax.set_xlim(edges[0], edges[-1])
    ax.grid(alpha=0.3)
    fig.legend(*ax.get_legend_handles_labels(), loc="lower center", fontsize=8.5, frameon=False, ncol=1)
    delta = contract_delta(result.contract)
    fig.suptitle(
        title or f"Repeated-split validation: {result.n_splits} splits, {result.n_calibration} calibrate / {n_test} test "
        f"(ε = {eps:g}, δ = {delta:g})",
        fontsize=12,
    )
    fig.tight_layout(rect=(0, 0.2, 1, 1))
    return fig


def save_figure(fig, path: Path) -> Path:
    """Save as PNG and free the figure (reports draw several; pyplot keeps them alive otherwise)."""
    plt = _pyplot()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ----------------------------------------------------------------------------- HTML

_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;color:#222}
h1{margin-bottom:0.2em} h2{margin-top:1.6em;border-bottom:1px solid #ddd;padding-bottom:0.2em}
.summary{background:#f6f8fa;border:1px solid #d0d7de;border-radius:6px;padding:1em 1.3em}
.guarantee{background:#eef7ee;border-left:4px solid #1a9850;padding:0.7em 1em;margin:1em 0}
.fallback{background:#fdf0ee;border-left:4px solid #d73027;padding:0.7em 1em;margin:1em 0}
table{border-collapse:collapse;font-size:0.9em;margin:0.6em 0} th,td{border:1px solid #d0d7de;padding:0.25em 0.6em;text-align:right}
th{background:#f6f8fa} td.l,th.l{text-align:left} tr.chosen td{background:#fff3cd;font-weight:bold}
.certified{color:#1a7f37} .not{color:#cf222e} .untested{color:#888} .over{color:#cf222e;font-weight:bold}
img{max-width:100%;border:1px solid #eee} .muted{color:#666;font-size:0.9em}
"""


def _img(path: Path, alt: str) -> str:
    data = base64.b64encode(Path(path).read_bytes()).decode("ascii")
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{data}">'


def _table(header: list[str], rows: list[list[str]], left: int = 1, row_classes: list[str] | None = None) -> str:
    e = html.escape
    head = "".join(f'<th class="l">{e(h)}</th>' if i < left else f"<th>{e(h)}</th>" for i, h in enumerate(header))
    thead = f"<thead><tr>{head}</tr></thead>" if any(header) else ""
    body = []
    for r, row in enumerate(rows):
        cls = f' class="{row_classes[r]}"' if row_classes and row_classes[r] else ""
        cells = "".join(f'<td class="l">{c}</td>' if i < left else f"<td>{c}</td>" for i, c in enumerate(row))
        body.append(f"<tr{cls}>{cells}</tr>")
    return f"<table>{thead}<tbody>{''.join(body)}</tbody></table>"


def _fmt_p(p) -> str:
    return "—" if p is None else f"{p:.3g}"


def ladder_rows(op) -> list[dict]:
    """The candidate table shared by the console and the HTML page, in contract order."""
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


def render_html(contract, records, op, validation, figures: dict[str, Path], notes: list[str] | None = None) -> str:
    """One self-contained page: summary, guarantee with its scope, ladder, per-task, validation."""
    e = html.escape
    eps = op.contract.risk
    delta = contract_delta(op.contract)
    status_cls = {"certified": "certified", "not certified": "not", "not tested": "untested"}
    ladder = ladder_rows(op)
    gated = any(r["gated_share"] is not None for r in ladder)
    gate_cols = ["mean KV", "gated"] if gated else []

    def gate_cells(r):
        if not gated:
            return []
        share = "—" if r["gated_share"] is None else f"{100 * r['gated_share']:.1f}%"
        return [f"{r['mean_kv']:.3f}", share]

    ladder_html = _table(
        ["sequence", "policy", "n", "k", "empirical risk", "upper bound", "p-value", "tested level", *gate_cols, "status"],
        [
            [str(r["sequence"]), e(r["policy"]) + (" ★" if r["chosen"] else ""), str(r["n"]), str(r["k"]),
             f"{r['empirical_risk']:.4f}", f"{r['upper_bound']:.4f}", _fmt_p(r["p_value"]), f"{r['level']:.3g}",
             *gate_cells(r), f'<span class="{status_cls[r["status"]]}">{e(r["status"])}</span>']
            for r in ladder
        ],
        left=2,
        row_classes=["chosen" if r["chosen"] else "" for r in ladder],
    )
    stops = "".join(f"<li>{e(s)}</li>" for s in sequence_summaries(op))
    if op.per_task and not op.fallback:
        task_rows = [
            [e(t), str(b.n), str(b.violations), f"{b.rate:.4f}",
             '<span class="over">above ε</span>' if b.exceeds_risk else "≤ ε"]
            for t, b in sorted(op.per_task.items())
        ]
        per_task = f"<p>Tasks of the chosen policy {e(op.policy)}:</p>" + _table(
            ["task", "n", "violations", "rate", f"vs ε = {eps:g}"], task_rows
        )
    elif op.fallback:
        per_task = "<p>The full cache is used: no task loses utility.</p>"
    else:
        per_task = "<p>The records have no task column.</p>"
    val_rows = [
        [e(METHOD_LABELS.get(name, name)), f"{100 * m.exceed_fraction:.1f}%",
         f"{100 * m.exceed_ci_low:.1f}–{100 * m.exceed_ci_high:.1f}%", f"{m.mean_kv_retained:.3f}",
         f"{100 * m.fallback_share:.1f}%"]
        for name, m in validation.methods.items()
    ]
    val_table = _table(["method", "splits with test risk > ε", "95% CI", "mean KV retained", "fallback share"], val_rows)
    box_class = "fallback" if op.fallback else "guarantee"
    all_notes = [n for n in (skipped_note(records), gate_note(contract)) if n] + [*(notes or []), *op.notes]
    notes_html = "".join(f"<li>{e(n)}</li>" for n in all_notes)
    kv_saved = f"{100 * (1 - op.mean_kv_retained):.1f}%"
    actual = "—" if op.kv_retained_actual is None else f"{op.kv_retained_actual:.3f}"
    summary_rows = [
        ["contract", e(contract.name)],
        ["evidence", f"{e(records.source)}: n = {op.n} requests"],
        ["tolerance τ / risk ε / confidence 1−δ", f"{op.contract.tolerance:g} / {eps:g} / {op.contract.confidence:g} (δ = {delta:g})"],
        ["procedure", e(op.contract.procedure)],
        ["choice", e(op.policy) + (" (fallback)" if op.fallback else "")],
        ["kv_retained nominal / realised / mean memory", f"{op.kv_retained:g} / {actual} / {op.mean_kv_retained:.3f}"],
        ["KV saved", kv_saved],
        ["violations / upper bound", f"{op.violations}/{op.n} / {op.risk_upper_bound:.4g}"],
        *[[e(METHOD_LABELS.get(n, n)) + " in validation", e(validation_line(validation, n).split(": ", 1)[1])]
          for n in validation.methods],
        ["contract sha256", f"<code>{e(str(op.contract_sha256))}</code>"],
        ["records sha256", f"<code>{e(str(op.records_sha256))}</code>"],
    ]
    summary_table = _table(["", ""], summary_rows)
    created = datetime.now(timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z")
    reason = f"<p><b>Why the fallback:</b> {e(op.reason or '')}</p>" if op.fallback else ""
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>certkv report: {e(contract.name)}</title>
<style>{_CSS}</style></head><body>
<h1>certkv report: {e(contract.name)}</h1>
<p class="muted">Generated {created} by certkv {e(op.certkv_version)}.</p>
<div class="summary">
<p><b>Choice:</b> {e(choice_summary(op))}</p>
<div class="{box_class}"><b>Guarantee.</b> {e(guarantee_text(op))}</div>
{reason}
{summary_table}
</div>
<h2>Risk against KV retained</h2>
<p>For each candidate sequence (tested in the contract's order, most KV first): the empirical violation rate k/n and
its Clopper–Pearson upper bound at the tested level. A candidate is certified when its bound is at most ε.{gated_figure_note(op)}</p>
{_img(figures["risk_vs_kv.png"], "risk vs KV retained")}
<ul>{stops}</ul>
{ladder_html}
<h2>Per-task violation rates</h2>
<p>The certificate covers the task mix; an individual task can exceed ε even under a certified candidate.</p>
{_img(figures["per_task.png"], "per-task violation rates")}
{per_task}
<h2>Repeated-split validation</h2>
<p>{validation.n_splits} random splits of the {validation.n_requests} requests into {validation.n_calibration} for
calibration and {validation.n_test} for testing (seed {validation.seed}). Each method picks a policy on the calibration
half; the histogram shows the picked policy's violation rate on the test half. The certificate promises that its
choice's true risk exceeds ε with probability at most δ = {delta:g}; test halves are finite and splits overlap, so these
fractions are a noisy, descriptive check.</p>
{_img(figures["validation.png"], "validation histogram")}
{val_table}
{f"<h2>Notes</h2><ul>{notes_html}</ul>" if all_notes else ""}
</body></html>
"""


def gated_figure_note(op) -> str:
    """What the figures leave out when the contract has a gate grid (the table lists everything)."""
    hidden = _hidden_count(op)
    if not hidden:
        return ""
    extra = " and the chosen candidate's gated sequence" if op.gate is not None else ""
    return (f" The figures show the ungated sequences{extra}; the {hidden} other gated candidates are in the "
            "table below (gated: share of requests their gate sends to the full cache, counted at memory 1.0).")


def write_report(contract, records, op, validation, out_dir, notes: list[str] | None = None) -> dict[str, Path]:
    """Draw the three figures and the HTML page into `out_dir`; return their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    figures = {
        "risk_vs_kv.png": save_figure(plot_risk_vs_kv(op), out / "risk_vs_kv.png"),
        "per_task.png": save_figure(plot_per_task(op), out / "per_task.png"),
        "validation.png": save_figure(plot_validation(validation), out / "validation.png"),
    }
    page = out / "report.html"
    page.write_text(render_html(contract, records, op, validation, figures, notes), encoding="utf-8")
    return {**figures, "report.html": page}


__all__ = [
    "FIGURES",
    "SCOPE_CAVEAT",
    "candidate_status",
    "choice_summary",
    "gate_text",
    "guarantee_text",
    "ladder_rows",
    "plot_per_task",
    "plot_risk_vs_kv",
    "plot_validation",
    "policy_stem",
    "render_html",
    "sequence_summaries",
    "shown_candidates",
    "validation_line",
    "write_report",
]
