"""The one naming rule for candidates: written by :func:`policy_name` and friends, read by
:func:`parse_policy_name`.

A candidate's name is ``<display>@<kv>`` with the retention at two decimals (``snapkv@0.50``);
a gated candidate appends its gate, each value written by ``format(x, "g")``:
``<base>+drop<t>``, ``<base>+cert<b>`` or ``<base>+drop<t>+cert<b>``
(``probabilistic@0.30+drop-0.05+cert0.02``). ``full`` names the full cache, the reference every
candidate is compared with; it is never a candidate.

Loss tables written by other systems may use any names; the parser never fails on them, it
reads the part before the first ``@`` as the display name and everything else as unknown.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

#: The full cache: the reference policy of every request, never a candidate.
REFERENCE_POLICY = "full"

_GATE_MARKERS = ("+drop", "+cert")
_RETENTION = re.compile(r"[0-9]+(?:\.[0-9]+)?")


def policy_name(display: str, kv_retained: float) -> str:
    """The policy name of a candidate, e.g. ``snapkv@0.50``."""
    return f"{display}@{kv_retained:.2f}"


def gate_label(value: float) -> str:
    """A gate value as it appears in names: ``format(x, "g")`` (0.1 → ``0.1``, -0.05 → ``-0.05``)."""
    return format(float(value) + 0.0, "g")


def gated_policy_name(base: str, agreement_drop: float | None = None, certificate: float | None = None) -> str:
    """``<base>+drop<t>``, ``<base>+cert<b>`` or ``<base>+drop<t>+cert<b>``; `base` when ungated."""
    name = base
    if agreement_drop is not None:
        name += f"+drop{gate_label(agreement_drop)}"
    if certificate is not None:
        name += f"+cert{gate_label(certificate)}"
    return name


@dataclass(frozen=True)
class PolicyName:
    """A policy name read back into its parts.

    ``display`` is the press or the entry's label; ``kv_retained`` the retention written after
    ``@`` (None when the name has none); ``gate`` the gate suffix exactly as written
    (``"+drop0.1"``, empty when ungated).
    """

    display: str
    kv_retained: float | None
    gate: str
    unparsed: str = ""  # what follows a non-numeric "@" in a foreign name, kept for the stem

    @property
    def is_gated(self) -> bool:
        return bool(self.gate)

    @property
    def stem(self) -> str:
        """The name without its retention: the name of its sequence (``snapkv+drop0.1``)."""
        return self.display + (f"@{self.unparsed}" if self.unparsed else "") + self.gate


def parse_policy_name(name: str) -> PolicyName:
    """Split `name` into display name, retention and gate suffix; never fails (see module doc)."""
    display, at, rest = name.partition("@")
    kv = None
    if at:
        match = _RETENTION.match(rest)
        if match is not None:
            tail = rest[match.end():]
            if tail and not tail.startswith(_GATE_MARKERS):
                return PolicyName(display, None, "", rest)  # "x@0.5y": not a certkv name
            kv, rest = float(match.group()), tail
    else:
        for marker in _GATE_MARKERS:
            if marker in display:
                cut = display.index(marker)
                display, rest = display[:cut], display[cut:]
                break
    gate = rest if any(rest.startswith(m) for m in _GATE_MARKERS) else ""
    if not at and not gate:
        display = name
    elif at and kv is None:
        return PolicyName(display, None, "", rest)  # "x@y": not a certkv name
    return PolicyName(display, kv, gate)


def is_gated_policy(name: str) -> bool:
    """Whether `name` is a gated candidate's (derived from its base's records, never calibrated)."""
    return parse_policy_name(name).is_gated
