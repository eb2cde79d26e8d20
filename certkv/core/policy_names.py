"""The one naming rule for candidates: written by :func:`policy_name` and friends, read by
:func:`parse_policy_name`.

A candidate's name is ``<display>@<kv>`` with the retention at two decimals (``snapkv@0.50``);
a gated candidate appends its gate, each value written by ``format(x, "g")``:
``<base>+drop<t>``, ``<base>+cert<b>`` or ``<base>+drop<t>+cert<b>``
(``probabilistic@0.30+drop-0.05+cert0.02``); a gate whose threshold the pilot places at a
pre-registered quantile q names the quantile: ``<base>+confq<q>`` (confidence),
``<base>+lookq<q>`` (lookahead mass) or ``<base>+learnq<q>`` (learned score), e.g.
``snapkv@0.70+confq0.1``. ``full`` names the full cache, the reference every
candidate is compared with; it is never a candidate.

Loss tables written by other systems may use any names; the parser never fails on them, it
reads the part before the first ``@`` as the display name and everything else as unknown.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

#: The full cache: the reference policy of every request, never a candidate.
REFERENCE_POLICY = "full"
#: The top-level policy of a stratified operating point: each stratum deploys its own.
STRATIFIED_POLICY = "stratified"

_GATE_MARKERS = ("+drop", "+cert", "+confq", "+lookq", "+learnq")
#: Name suffix of each pilot gate kind (followed by the quantile).
PILOT_GATE_MARKERS = {"confidence": "+confq", "lookahead": "+lookq", "learned": "+learnq"}
_RETENTION = re.compile(r"[0-9]+(?:\.[0-9]+)?")
_AT_RETENTION = re.compile(r"@[0-9]+(?:\.[0-9]+)?")


def policy_name(display: str, kv_retained: float) -> str:
    """The policy name of a candidate, e.g. ``snapkv@0.50``."""
    return f"{display}@{kv_retained:.2f}"


def gate_label(value: float) -> str:
    """A gate value as it appears in names: ``format(x, "g")`` (0.1 → ``0.1``, -0.05 → ``-0.05``)."""
    return format(float(value) + 0.0, "g")


def gated_policy_name(
    base: str,
    agreement_drop: float | None = None,
    certificate: float | None = None,
    *,
    pilot_kind: str | None = None,
    quantile: float | None = None,
) -> str:
    """``<base>+drop<t>``, ``<base>+cert<b>`` or ``<base>+drop<t>+cert<b>``; `base` when ungated.

    With `pilot_kind` (confidence, lookahead or learned) and its `quantile`:
    ``<base>+confq<q>``, ``<base>+lookq<q>`` or ``<base>+learnq<q>`` (never combined with the others).
    """
    name = base
    if agreement_drop is not None:
        name += f"+drop{gate_label(agreement_drop)}"
    if certificate is not None:
        name += f"+cert{gate_label(certificate)}"
    if pilot_kind is not None:
        if quantile is None:
            raise ValueError(f"a {pilot_kind} gate's name needs its quantile")
        name += f"{PILOT_GATE_MARKERS[pilot_kind]}{gate_label(quantile)}"
    return name


@dataclass(frozen=True)
class PolicyName:
    """A policy name read back into its parts.

    ``display`` is the press or the entry's label (everything before the first ``@``);
    ``kv_retained`` the retention written after ``@`` (None when the name has none); ``gate`` the
    gate suffix from the first ``+drop`` or ``+cert`` on, exactly as written (empty when ungated);
    ``stem`` the name without its ``@<retention>``: the name of its sequence.
    """

    display: str
    kv_retained: float | None
    gate: str
    stem: str

    @property
    def is_gated(self) -> bool:
        return bool(self.gate)


def parse_policy_name(name: str) -> PolicyName:
    """Split `name` into display name, retention, gate suffix and stem; never fails (module doc)."""
    display, at, rest = name.partition("@")
    match = _RETENTION.match(rest) if at else None
    kv = float(match.group()) if match is not None else None
    stem = _AT_RETENTION.sub("", name, count=1)
    cuts = [name.index(m) for m in _GATE_MARKERS if m in name]
    gate = name[min(cuts) :] if cuts else ""
    return PolicyName(display, kv, gate, stem)


def is_gated_policy(name: str) -> bool:
    """Whether `name` is a gated candidate's (derived from its base's records, never calibrated)."""
    return parse_policy_name(name).is_gated
