"""The report's figures: risk against KV retained, per-task violation rates, repeated-split validation.

Each function returns a matplotlib figure and :func:`save_figure` writes it as a PNG; the HTML page
(:mod:`certkv.report.html`) embeds the PNGs, so the figures are the only place matplotlib is used.
Importing this module is cheap and side-effect free: matplotlib is imported, and the Agg backend
selected, inside the functions that draw, so importing certkv never changes a user's matplotlib
backend. Which candidates are drawn, and the status colours' meaning, come from
:mod:`certkv.report.text`, so the figures and the words cannot disagree.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

from certkv.report.text import (
    METHOD_LABELS,
    candidate_status,
    contract_delta,
    cost_words,
    hidden_count,
    sequence_name,
    shown_candidates,
)

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from certkv.core.operating_point import OperatingPoint
    from certkv.core.validation import ValidationResult

#: The PNG files a report draws, in the order the page shows them.
FIGURES = ("risk_vs_kv.png", "per_task.png", "validation.png")


def _pyplot() -> ModuleType:
    """matplotlib.pyplot on the Agg backend, selected here rather than at import time."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


#: Marker colours of a candidate's status (:func:`certkv.report.text.candidate_status`).
_STATUS_COLORS = {"certified": "#1a9850", "not certified": "#d73027", "not tested": "#9e9e9e"}
_RISK_BLUE = "#4575b4"


def plot_risk_vs_kv(op: OperatingPoint, title: str | None = None, subject: str = "") -> Figure:
    """Empirical risk and Clopper–Pearson upper bound against kv_retained, one panel per sequence.
    `subject` (e.g. ``task multi_key: ``) starts the default title: a stratum's figure says whose it is.

    Values far above ε would squash the interesting region near ε, so the y axis stops at a few ε
    and larger values are drawn on the top edge with their value written next to them.
    """
    plt = _pyplot()
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
    for ax, cands in zip(axes[0], seqs):
        _risk_panel(ax, op, cands, top, chosen)
        ax.set_xlim(*xlim)
    clip_note = "" if max(values) <= top else f"\n(above {top:.2g}: drawn on the top edge, bound written)"
    axes[0][0].set_ylabel(f"violation rate (share of requests){clip_note}")
    handles = _risk_legend(any(candidate_status(op, c) == "not tested" for c in shown), chosen is not None)
    ncol = min(len(handles), 3 if n_panels == 1 else 4)
    fig.legend(handles=handles, loc="lower center", ncol=ncol, fontsize=9, frameon=False)
    what = "fallback to the full cache" if op.fallback else f"chosen {op.policy}"
    hidden = hidden_count(op)
    hidden_note = f"; {hidden} other gated candidates are in the table, not drawn" if hidden else ""
    fig.suptitle(
        title or f"{subject}Violation risk vs KV retained: {what}\n"
        f"n = {op.n}, ε = {eps:g}, confidence {op.contract.confidence:g}, {op.contract.procedure}{hidden_note}",
        fontsize=12,
    )
    legend_rows = -(-len(handles) // ncol)
    fig.tight_layout(rect=(0, 0.045 * legend_rows + 0.02, 1, 0.97))
    return fig


def _risk_panel(ax, op: OperatingPoint, cands: list, top: float, chosen: str | None) -> None:
    """One sequence's panel of :func:`plot_risk_vs_kv`: risk and bound per candidate, values above
    `top` drawn on the top edge with the true bound written, the chosen candidate starred."""
    eps = op.contract.risk
    x = [c.kv_retained for c in cands]
    emp = [min(c.empirical_risk, top) for c in cands]
    ub = [min(c.risk_upper_bound, top) for c in cands]
    ax.fill_between(x, emp, ub, color=_RISK_BLUE, alpha=0.10, linewidth=0)
    ax.plot(x, emp, "-", color=_RISK_BLUE, lw=1.5, zorder=2)
    ax.plot(x, ub, "--", color=_RISK_BLUE, lw=1.5, zorder=2)
    for c in cands:
        status = candidate_status(op, c)
        col = _STATUS_COLORS[status]
        ax.plot(c.kv_retained, min(c.empirical_risk, top), "o", ms=6, color=_RISK_BLUE, zorder=3)
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
    ax.set_title(f"{sequence_name(cands)}  ({level})", fontsize=11, pad=20)
    ax.set_xlabel("KV retained (nominal fraction kept)  →  more eviction")
    ax.set_ylim(0, top)
    ax.grid(alpha=0.3)


def _risk_legend(any_untested: bool, any_chosen: bool) -> list:
    """The legend entries of :func:`plot_risk_vs_kv`, in the order it shows them."""
    from matplotlib.lines import Line2D

    handles = [
        Line2D([], [], color=_RISK_BLUE, marker="o", lw=1.5, label="empirical risk k/n"),
        Line2D([], [], color=_RISK_BLUE, marker="v", ls="--", lw=1.5, markerfacecolor="white",
               label="Clopper–Pearson upper bound"),
        Line2D([], [], color=_STATUS_COLORS["certified"], marker="v", ls="", ms=9, label="certified (bound ≤ ε)"),
        Line2D([], [], color=_STATUS_COLORS["not certified"], marker="v", ls="", ms=9, markerfacecolor="white",
               markeredgewidth=1.8, label="not certified"),
        Line2D([], [], color="black", ls=":", label="risk target ε"),
    ]
    if any_untested:
        handles.insert(4, Line2D([], [], color=_STATUS_COLORS["not tested"], marker="v", ls="", ms=9,
                                 markerfacecolor="white", markeredgewidth=1.8, label="not tested (sequence stopped)"))
    if any_chosen:
        handles.append(Line2D([], [], color="#fdae61", marker="*", ls="", ms=14, markeredgecolor="black",
                              label="chosen operating point"))
    return handles


def plot_per_task(op: OperatingPoint, title: str | None = None, subject: str = "") -> Figure:
    """Heatmap of each task's own violation rate under each candidate; cells above ε are flagged
    (`subject` starts the default title, as for :func:`plot_risk_vs_kv`).

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
    _write_rates(ax, im, norm, cands, tasks, eps)
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
    _rate_colorbar(fig, ax, im, eps, vmax)
    hidden = hidden_count(op)
    hidden_note = f"\n({hidden} other gated candidates not shown)" if hidden else ""
    fig.suptitle(title or f"{subject}Per-task violation rates (green ≤ ε < red; bold: task above ε){hidden_note}",
                 fontsize=12)
    fig.tight_layout()
    return fig


def _write_rates(ax, im, norm, cands: list, tasks: list[str], eps: float) -> None:
    """Each heatmap cell's rate as text, bold above ε, in an ink readable on the cell's colour."""
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


def _rate_colorbar(fig, ax, im, eps: float, vmax: float) -> None:
    """The heatmap's colour bar, ε marked by a line and a tick of its own."""
    bar = fig.colorbar(im, ax=ax, fraction=0.05, pad=0.02)
    bar.set_label("task's own violation rate")
    bar.ax.axhline(eps, color="black", lw=2)
    ticks = sorted({0.0, eps / 2, eps, float(f"{(eps + vmax) / 2:.2g}"), vmax})
    bar.set_ticks(ticks, labels=[f"ε = {100 * t:.3g}%" if t == eps else f"{100 * t:.3g}%" for t in ticks])


def plot_validation(result: ValidationResult, title: str | None = None) -> Figure:
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
            f"(95% CI {100 * m.exceed_ci_low:.1f}–{100 * m.exceed_ci_high:.1f}%), {cost_words(result.contract.kv_cost)} "
            f"{m.mean_kv_retained:.2f}"
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


def save_figure(fig: Figure, path: Path) -> Path:
    """Save as PNG and free the figure (reports draw several; pyplot keeps them alive otherwise)."""
    plt = _pyplot()
    from certkv.atomic_io import atomic_write

    path = Path(path)
    with atomic_write(path, "wb") as fh:
        fig.savefig(fh, format="png", dpi=110)
    plt.close(fig)
    return path



def draw_figures(op: OperatingPoint, validation: ValidationResult, out_dir: str | Path) -> dict[str, Path]:
    """Draw a report's figures into `out_dir`; file name → path, in the order the page shows them.

    A pooled point gets the three of :data:`FIGURES`. A stratified point gets each stratum's own
    risk and per-task figures (:func:`stratum_figure_names`; none for a stratum too small to test
    anything) and the validation of all strata together. Each figure is saved (and freed) before
    the next is drawn, so a report of a large gate grid holds one figure in memory at a time.
    """
    out = Path(out_dir)
    draw: dict[str, Callable[[], Figure]] = {"validation.png": lambda: plot_validation(validation)}
    if op.strata is not None:  # stratified
        names = stratum_figure_names(op)
        for stratum, entry in op.strata.entries.items():
            if stratum in names:
                risk, tasks = names[stratum]
                subject = f"{op.strata.by} {stratum}: "
                draw[risk] = partial(plot_risk_vs_kv, entry, subject=subject)
                draw[tasks] = partial(plot_per_task, entry, subject=subject)
    else:
        draw["risk_vs_kv.png"] = lambda: plot_risk_vs_kv(op)
        draw["per_task.png"] = lambda: plot_per_task(op)
    order = [name for name in draw if name != "validation.png"] + ["validation.png"]
    return {name: save_figure(draw[name](), out / name) for name in order}


def stratum_figure_names(op: OperatingPoint) -> dict[str, tuple[str, str]]:
    """Per stratum with candidates, its (risk, per-task) PNG names: ``risk_vs_kv_<stratum>.png``
    with the name reduced to file-safe characters (and numbered when two reduce alike)."""
    import re

    assert op.strata is not None, "a stratified operating point"
    names: dict[str, tuple[str, str]] = {}
    used: set[str] = set()
    for i, (stratum, entry) in enumerate(op.strata.entries.items()):
        if not entry.candidates:
            continue
        slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", stratum).strip("._") or "stratum"
        if slug in used:
            slug = f"{slug}-{i}"
        used.add(slug)
        names[stratum] = (f"risk_vs_kv_{slug}.png", f"per_task_{slug}.png")
    return names


__all__ = [
    "FIGURES",
    "draw_figures",
    "plot_per_task",
    "plot_risk_vs_kv",
    "plot_validation",
    "save_figure",
    "stratum_figure_names",
]
