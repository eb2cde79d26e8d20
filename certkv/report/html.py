"""The report's HTML page: one self-contained file explaining a certificate.

The layout lives in a Jinja2 template (``templates/report.html.j2``) with autoescaping on, so
every name that comes from a contract or a loss table is escaped by the template engine rather
than by hand, and the page's structure can be read and changed without reading Python. This
module only gathers what the page says (from :mod:`certkv.report.text`, so the console and the
page use the same sentences) and embeds the figures as base64 data URIs: the page must open
anywhere, offline and on its own, e.g. as a CI artifact or an e-mail attachment.
"""

from __future__ import annotations

import base64
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from certkv.atomic_io import write_text_atomic
from certkv.report import text
from certkv.report.figures import draw_figures

if TYPE_CHECKING:
    import jinja2

    from certkv.calibration.certification import ContractRecords
    from certkv.contract.schema import Contract
    from certkv.core.operating_point import OperatingPoint
    from certkv.core.validation import ValidationResult

TEMPLATE = "report.html.j2"
_STATUS_CLASS = {"certified": "certified", "not certified": "not", "not tested": "untested"}


def _environment() -> jinja2.Environment:
    """A Jinja2 environment over the package's templates; autoescape on whatever the file name,
    and undefined names an error (a typo in the template must fail, not print nothing)."""
    import jinja2

    return jinja2.Environment(
        loader=jinja2.PackageLoader("certkv.report", "templates"),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
    )


def _data_uri(path: Path) -> str:
    """A PNG as a data URI, so the page carries its figures inside it."""
    return "data:image/png;base64," + base64.b64encode(Path(path).read_bytes()).decode("ascii")


def _ladder(op: OperatingPoint) -> dict[str, Any]:
    """The candidate table: header and rows of pre-formatted cells, gate columns only when gated."""
    rows = text.ladder_rows(op)
    gated = any(r["gated_share"] is not None for r in rows)
    header = ["sequence", "policy", "n", "k", "empirical risk", "upper bound", "p-value", "tested level"]
    header += [*(["mean KV", "gated"] if gated else []), "status"]
    cells = []
    for r in rows:
        values = [str(r["n"]), str(r["k"]), f"{r['empirical_risk']:.4f}", f"{r['upper_bound']:.4f}",
                  text.fmt_p(r["p_value"]), f"{r['level']:.3g}"]
        if gated:
            share = "—" if r["gated_share"] is None else text.fmt_share(r["gated_share"])
            values += [f"{r['mean_kv']:.3f}", share]
        cells.append({
            "sequence": str(r["sequence"]),
            "policy": r["policy"],
            "cells": values,
            "status": r["status"],
            "status_class": _STATUS_CLASS[r["status"]],
            "chosen": r["chosen"],
        })
    return {"header": header, "rows": cells}


def _per_task(op: OperatingPoint) -> dict[str, Any]:
    """The chosen policy's tasks, or why there is no such table."""
    if op.fallback:
        return {"kind": "fallback"}
    if not op.per_task:
        return {"kind": "none"}
    rows = [{"task": t, "n": b.n, "violations": b.violations, "rate": f"{b.rate:.4f}", "over": b.exceeds_risk}
            for t, b in sorted(op.per_task.items())]
    return {"kind": "table", "policy": op.policy, "rows": rows}


def _summary_rows(contract: Contract, records: ContractRecords, op: OperatingPoint,
                  validation: ValidationResult) -> list[dict[str, Any]]:
    """The summary box's label/value rows; ``code`` marks hashes, shown in a fixed-width font."""
    eps = op.contract.risk
    delta = text.contract_delta(op.contract)
    actual = "—" if op.kv_retained_actual is None else f"{op.kv_retained_actual:.3f}"
    bound = "largest stratum bound" if op.is_stratified else "upper bound"
    rows = [
        ("contract", contract.name),
        ("evidence", f"{records.source}: n = {op.n} requests"),
        ("tolerance τ / risk ε / confidence 1−δ",
         f"{op.contract.tolerance:g} / {eps:g} / {op.contract.confidence:g} (δ = {delta:g})"),
        ("procedure", op.contract.procedure),
        ("choice", op.policy + (" (fallback)" if op.fallback else "")),
        ("kv_retained nominal / realised / mean memory", f"{op.kv_retained:g} / {actual} / {op.mean_kv_retained:.3f}"),
        ("KV saved", f"{100 * (1 - op.mean_kv_retained):.1f}%"),
        (f"violations / {bound}", f"{op.violations}/{op.n} / {text.fmt_bound(op.risk_upper_bound)}"),
        *[(text.METHOD_LABELS.get(n, n) + " in validation", text.validation_line(validation, n).split(": ", 1)[1])
          for n in validation.methods],
    ]
    out = [{"label": label, "value": value, "code": False} for label, value in rows]
    out += [{"label": "contract sha256", "value": str(op.contract_sha256), "code": True},
            {"label": "records sha256", "value": str(op.records_sha256), "code": True}]
    return out


def _validation_rows(validation: ValidationResult) -> list[list[str]]:
    return [
        [text.METHOD_LABELS.get(name, name), text.fmt_share(m.exceed_fraction),
         f"{100 * m.exceed_ci_low:.1f}–{100 * m.exceed_ci_high:.1f}%", f"{m.mean_kv_retained:.3f}",
         text.fmt_share(m.fallback_share)]
        for name, m in validation.methods.items()
    ]


def _validation_strata(validation: ValidationResult) -> list[dict[str, Any]]:
    """Each stratum's own validation rows (empty for a pooled result)."""
    return [{"name": f"{validation.by} {name}", "n": sub.n_requests, "rows": _validation_rows(sub)}
            for name, sub in (validation.strata or {}).items()]


def _panel(op: OperatingPoint, images: dict[str, str], risk: str | None, tasks: str | None,
           title: str = "") -> dict[str, Any]:
    """One ordinary operating point's evidence as the page shows it: the whole page's for a pooled
    point, one stratum's for a stratified one (each entry is an ordinary point). `risk` and `tasks`
    name its figures (None: it tested nothing, so there is nothing to draw)."""
    return {
        "title": title,
        "choice": text.choice_summary(op),
        "guarantee": text.guarantee_text(op),
        "fallback": op.fallback,
        "reason": op.reason or "",
        "gated_figure_note": text.gated_figure_note(op),
        "risk_image": images.get(risk) if risk else None,
        "tasks_image": images.get(tasks) if tasks else None,
        "stops": text.sequence_summaries(op),
        "ladder": _ladder(op),
        "per_task": _per_task(op),
    }


def _panels(op: OperatingPoint, images: dict[str, str]) -> list[dict[str, Any]]:
    """The page's evidence panels: one for a pooled point, one per stratum for a stratified one."""
    if op.strata is None:  # pooled
        return [_panel(op, images, "risk_vs_kv.png", "per_task.png")]
    from certkv.report.figures import stratum_figure_names

    names = stratum_figure_names(op)
    panels = []
    for stratum, entry in op.strata.entries.items():
        risk, tasks = names[stratum] if stratum in names else (None, None)  # no figures: it tested nothing
        panels.append(_panel(entry, images, risk, tasks, title=f"{op.strata.by} {stratum}: {entry.n} certification requests"))
    return panels


def _strata(op: OperatingPoint, pooled: OperatingPoint | None) -> dict[str, Any] | None:
    """A stratified point's summary: its per-stratum rows and the pooled comparison beside it."""
    if not op.is_stratified:
        return None
    rows = [{**r, "gated": "—" if r["gated_share"] is None else text.fmt_share(r["gated_share"]),
             "bound": text.fmt_bound(r["bound"]), "mean_kv": f"{r['mean_kv']:.3f}"} for r in text.stratum_rows(op)]
    comparison = None
    if pooled is not None:
        comparison = {"rows": [{**r, "mean_kv": f"{r['mean_kv']:.3f}"} for r in text.comparison_rows(op, pooled)],
                      "text": text.comparison_text(op, pooled)}
    return {"header": text.strata_header(op), "rows": rows, "comparison": comparison,
            "pooled_kv": f"{op.mean_kv_retained:.3f}"}


def page_context(contract: Contract, records: ContractRecords, op: OperatingPoint, validation: ValidationResult,
                 figures: dict[str, Path], notes: list[str] | None = None,
                 pooled: OperatingPoint | None = None) -> dict[str, Any]:
    """Everything the template shows, as plain strings, numbers and lists (no HTML in them)."""
    images = {name: _data_uri(path) for name, path in figures.items()}
    return {
        "name": contract.name,
        "created": datetime.now(UTC).isoformat(timespec="seconds").replace("+00:00", "Z"),
        "version": op.certkv_version,
        "choice": text.choice_summary(op),
        "guarantee": text.guarantee_text(op),
        "fallback": op.fallback,
        "reason": op.reason or "",
        "coverage": text.coverage_text(op) or "",
        "summary": _summary_rows(contract, records, op, validation),
        "strata": _strata(op, pooled),
        "panels": _panels(op, images),
        "validation_image": images["validation.png"],
        "eps": f"{op.contract.risk:g}",
        "delta": f"{text.contract_delta(op.contract):g}",
        "validation": validation,
        "validation_rows": _validation_rows(validation),
        "validation_strata": _validation_strata(validation),
        "notes": text.all_notes(contract, records, op, notes),
        "memory": text.memory_words(op),
    }


def render_html(contract: Contract, records: ContractRecords, op: OperatingPoint, validation: ValidationResult,
                figures: dict[str, Path], notes: list[str] | None = None, pooled: OperatingPoint | None = None) -> str:
    """One self-contained page: summary, guarantee with its scope, ladder, per-task, validation;
    for a stratified point a panel per stratum and the pooled comparison in the summary.

    Parameters
    ----------
    contract, records, op, validation
        The contract, the records certified (:class:`~certkv.calibration.certification.ContractRecords`),
        their operating point and a repeated-split validation of the same records.
    figures : dict of str to path
        The PNGs of :func:`~certkv.report.figures.draw_figures`, embedded as data URIs.
    notes : list of str, optional
        Extra notes (e.g. a stale operating point on disk), listed with the certifier's.
    pooled : OperatingPoint, optional
        A stratified point's pooled comparison (strata removed; never deployed).

    Returns
    -------
    str
        The page; it loads nothing from elsewhere, so it can be mailed or archived alone.
    """
    context = page_context(contract, records, op, validation, figures, notes, pooled)
    return _environment().get_template(TEMPLATE).render(**context)


def write_report(contract: Contract, records: ContractRecords, op: OperatingPoint, validation: ValidationResult,
                 out_dir: str | Path, notes: list[str] | None = None, pooled: OperatingPoint | None = None) -> dict[str, Path]:
    """Draw the figures and the HTML page into `out_dir`.

    Parameters
    ----------
    contract, records, op, validation, notes, pooled
        As for :func:`render_html`.
    out_dir : path
        Created when missing; existing files of the same names are replaced.

    Returns
    -------
    dict of str to Path
        The figures (``risk_vs_kv.png``, ``per_task.png``, ``validation.png``; per stratum for a
        stratified point) and ``report.html``.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    figures = draw_figures(op, validation, out)
    page = out / "report.html"
    write_text_atomic(page, render_html(contract, records, op, validation, figures, notes, pooled))
    return {**figures, "report.html": page}


__all__ = ["TEMPLATE", "page_context", "render_html", "write_report"]
