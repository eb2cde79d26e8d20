"""The coverage envelope: what a certificate was calibrated on, so the runtime can tell what it covers.

A certificate holds for requests drawn like the calibration requests; a context four times longer
than any calibrated one, or a task never calibrated, is outside it. Every operating point records
its :class:`Coverage` — the strata seen (tasks, or the values of ``strata.by``), the context-length
range in tokens of the requests that certified, the contract's relative margin around that range
and the decode length — and the runtime answers a request outside it from the full cache with
reason ``uncovered`` (:meth:`Coverage.uncovered`). Torch-free.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt
from pydantic import BaseModel, ConfigDict, Field


class Coverage(BaseModel):
    """What was calibrated: requests outside it are answered from the full cache.

    ``by`` is the request field the strata are read from (``task`` or ``metadata.<key>``; null
    when the records carry no such label) and ``strata`` the values seen. ``stratum_required``:
    the operating point is stratified, so a request must name its stratum; otherwise a request
    may leave its stratum out, and one it names must be among ``strata``. ``context_tokens`` is the
    [min, max] context length (tokens) of the requests that certified (null when the records lack
    lengths: lengths are then not checked), widened to [min·(1 − m), max·(1 + m)] by
    ``context_margin`` m. ``max_new_tokens`` is the calibrated decode length.

    Examples
    --------
    >>> cover = Coverage(by="task", strata=["qa"], context_tokens=(100, 200), context_margin=0.5)
    >>> cover.context_range()
    (50.0, 300.0)
    >>> cover.uncovered("qa", 250) is None, cover.uncovered("code", 150)
    (True, "task 'code' was not calibrated; calibrated: qa")
    """

    model_config = ConfigDict(extra="forbid")
    by: str | None = None
    strata: list[str] | None = None
    stratum_required: bool = False
    context_tokens: tuple[int, int] | None = None
    context_margin: float = Field(default=0.0, ge=0.0)
    max_new_tokens: int | None = None

    def context_range(self) -> tuple[float, float] | None:
        """The served context-length range in tokens: the calibrated one, widened by the margin."""
        if self.context_tokens is None:
            return None
        low, high = self.context_tokens
        return low * (1.0 - self.context_margin), high * (1.0 + self.context_margin)

    def uncovered(self, stratum: str | None, context_tokens: int) -> str | None:
        """Why a request is outside the envelope (one line), or None when it is covered.

        Parameters
        ----------
        stratum : str or None
            The request's stratum (its task, or its ``strata.by`` value); None when not given.
        context_tokens : int
            The request's context length in the calibrated model's tokens.
        """
        return self.uncovered_stratum(stratum) or self.uncovered_context(context_tokens)

    def uncovered_stratum(self, stratum: str | None) -> str | None:
        """Why a request of `stratum` (None: it names none) is outside the calibrated strata, or None.
        Half of :meth:`uncovered`, for a caller that learns the context length only later (``certkv
        gateway`` reads it from the candidate's answer)."""
        if stratum is None:
            if self.stratum_required:
                return (
                    f"the operating point is certified per {self.by} and the request names no stratum; "
                    f"pass one of: {_listed(self.strata)}"
                )
        elif self.strata is not None and stratum not in self.strata:
            return f"{self.by} {stratum!r} was not calibrated; calibrated: {_listed(self.strata)}"
        return None

    def uncovered_context(self, context_tokens: int) -> str | None:
        """Why a context of `context_tokens` tokens is outside the served range (:meth:`context_range`),
        or None; the other half of :meth:`uncovered`."""
        served = self.context_range()
        if served is not None and not served[0] <= context_tokens <= served[1]:
            low, high = self.context_tokens or served
            margin = f" widened by {self.context_margin:g}" if self.context_margin else ""
            return f"context of {context_tokens} tokens is outside the calibrated {low}-{high} tokens{margin}"
        return None


def coverage_of(
    context_tokens: npt.ArrayLike | None,
    labels: Sequence[str | None] | None,
    by: str | None,
    *,
    stratum_required: bool = False,
    context_margin: float = 0.0,
    max_new_tokens: int | None = None,
) -> Coverage:
    """The envelope of a set of certification requests.

    Parameters
    ----------
    context_tokens : array of shape (R,) or None
        Context length per request (NaN where unknown); the range spans the known ones.
    labels : sequence of R str (None allowed) or None
        Each request's stratum (task) label; None when the records carry none.
    by : str or None
        The field the labels are read from.

    Examples
    --------
    >>> cover = coverage_of([100, 250, float("nan")], ["b", "a", "a"], "task")  # NaN: length unknown
    >>> cover.strata, cover.context_tokens, cover.stratum_required
    (['a', 'b'], (100, 250), False)
    """
    strata = None
    if labels is not None:
        seen = sorted({str(label) for label in labels if label is not None})
        strata = seen or None
    span = None
    if context_tokens is not None:
        known = np.asarray(context_tokens, dtype=float)
        known = known[~np.isnan(known)]
        if known.size:
            span = (int(math.floor(known.min())), int(math.ceil(known.max())))
    return Coverage(
        by=by if strata is not None else None,
        strata=strata,
        stratum_required=stratum_required,
        context_tokens=span,
        context_margin=context_margin,
        max_new_tokens=max_new_tokens,
    )


def merge_coverage(parts: dict[str, Coverage], by: str, *, context_margin: float, max_new_tokens: int | None) -> Coverage:
    """The envelope of a stratified operating point: its strata, and the union of their ranges.

    Examples
    --------
    >>> parts = {"a": coverage_of([100, 200], ["a", "a"], "task"), "b": coverage_of([150, 400], ["b", "b"], "task")}
    >>> merged = merge_coverage(parts, "task", context_margin=0.0, max_new_tokens=None)
    >>> merged.strata, merged.context_tokens, merged.stratum_required
    (['a', 'b'], (100, 400), True)
    """
    spans = [c.context_tokens for c in parts.values() if c.context_tokens is not None]
    span = (min(s[0] for s in spans), max(s[1] for s in spans)) if spans else None
    return Coverage(
        by=by,
        strata=sorted(parts),
        stratum_required=True,
        context_tokens=span,
        context_margin=context_margin,
        max_new_tokens=max_new_tokens,
    )


def _listed(values, limit: int = 8) -> str:
    if not values:
        return "(none)"
    shown = ", ".join(values[:limit])
    return shown + (f" and {len(values) - limit} more" if len(values) > limit else "")


__all__ = ["Coverage", "coverage_of", "merge_coverage"]
