"""Candidates and their names: the one naming rule, written by :func:`policy_name` and friends and
read by :func:`parse_policy_name`, and how a contract's entries expand into named candidates.

A candidate's name is ``<display>@<kv>`` with the retention at two decimals (``snapkv@0.50``);
a gated candidate appends its gate, each value written by ``format(x, "g")``:
``<base>+drop<t>``, ``<base>+cert<b>`` or ``<base>+drop<t>+cert<b>``
(``probabilistic@0.30+drop-0.05+cert0.02``); a gate whose threshold the pilot places at a
pre-registered quantile q names the quantile: ``<base>+confq<q>`` (confidence),
``<base>+lookq<q>`` (lookahead mass), ``<base>+learnq<q>`` (learned score), ``<base>+recq<q>``
(recompute mid-generation) or ``<base>+recc<q>`` (recompute on the step certificate), e.g.
``snapkv@0.70+confq0.1``. ``full`` names the full cache, the reference every
candidate is compared with; it is never a candidate.

Loss tables written by other systems may use any names; the parser never fails on them, it
reads the part before the first ``@`` as the display name and everything else as unknown.

Expansion: a contract pre-registers policy entries (a press at decreasing retentions) and,
optionally, a gate grid; each entry is tested under every gate setting of the grid
(:class:`GateChoice`): first ungated, then each agreement-drop threshold t, then, for a press that
produces certificates, each certificate bound b and each pair (t, b) (thresholds outer), then
each pilot gate (confidence, lookahead and learned quantiles, never combined with each other or
with t and b). Each (entry, setting) pair is one sequence, run over the entry's retentions in the
order written (:func:`entry_sequences`). The contract (:mod:`certkv.contract`) validates the YAML
and hands its entries here as plain :class:`PolicyEntry` values, so the core never imports it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

#: The full cache: the reference policy of every request, never a candidate.
REFERENCE_POLICY = "full"
#: The press column of a candidate that keeps every token and only stores them at a lower precision.
NO_PRESS = "none"
#: The press column of a candidate served by an OpenAI-compatible endpoint: what it keeps is the
#: server's own (its declared memory is the candidate's kv_retained).
ENDPOINT_PRESS = "endpoint"
#: The top-level policy of a stratified operating point: each stratum deploys its own.
STRATIFIED_POLICY = "stratified"

_GATE_MARKERS = ("+drop", "+cert", "+confq", "+lookq", "+learnq", "+recq", "+recc")
#: Name suffix of each pilot gate kind (followed by the quantile).
PILOT_GATE_MARKERS = {"confidence": "+confq", "lookahead": "+lookq", "learned": "+learnq", "recompute": "+recq",
                      "certificate_recompute": "+recc"}
_RETENTION = re.compile(r"[0-9]+(?:\.[0-9]+)?")
_AT_RETENTION = re.compile(r"@[0-9]+(?:\.[0-9]+)?")


def policy_name(display: str, kv_retained: float) -> str:
    """The policy name of a candidate, e.g. ``snapkv@0.50``.

    Examples
    --------
    >>> policy_name("snapkv", 0.5)
    'snapkv@0.50'
    """
    return f"{display}@{kv_retained:.2f}"


def gate_label(value: float) -> str:
    """A gate value as it appears in names: ``format(x, "g")`` (0.1 → ``0.1``, -0.05 → ``-0.05``).

    Examples
    --------
    >>> gate_label(0.1), gate_label(-0.05), gate_label(2.0)
    ('0.1', '-0.05', '2')
    """
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

    With `pilot_kind` (confidence, lookahead, learned, recompute or certificate_recompute) and its
    `quantile`: ``<base>+confq<q>``, ``<base>+lookq<q>``, ``<base>+learnq<q>``, ``<base>+recq<q>``
    or ``<base>+recc<q>`` (never combined with the others).

    Examples
    --------
    >>> gated_policy_name("snapkv@0.50", 0.1), gated_policy_name("snapkv@0.50", 0.1, 2.0)
    ('snapkv@0.50+drop0.1', 'snapkv@0.50+drop0.1+cert2')
    >>> gated_policy_name("snapkv@0.50", pilot_kind="confidence", quantile=0.9), gated_policy_name("snapkv@0.50")
    ('snapkv@0.50+confq0.9', 'snapkv@0.50')
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

    Examples
    --------
    >>> name = parse_policy_name("snapkv@0.50+drop0.1")
    >>> name.display, name.kv_retained, name.gate, name.stem
    ('snapkv', 0.5, '+drop0.1', 'snapkv+drop0.1')
    """

    display: str
    kv_retained: float | None
    gate: str
    stem: str

    @property
    def is_gated(self) -> bool:
        return bool(self.gate)


def parse_policy_name(name: str) -> PolicyName:
    """Split `name` into display name, retention, gate suffix and stem; never fails (module doc).

    Examples
    --------
    >>> parse_policy_name("snapkv@0.50")
    PolicyName(display='snapkv', kv_retained=0.5, gate='', stem='snapkv')
    >>> parse_policy_name("full").kv_retained is None  # a name without a retention still parses
    True
    """
    display, at, rest = name.partition("@")
    match = _RETENTION.match(rest) if at else None
    kv = float(match.group()) if match is not None else None
    stem = _AT_RETENTION.sub("", name, count=1)
    cuts = [name.index(m) for m in _GATE_MARKERS if m in name]
    gate = name[min(cuts) :] if cuts else ""
    return PolicyName(display, kv, gate, stem)


def is_gated_policy(name: str) -> bool:
    """Whether `name` is a gated candidate's (derived from its base's records, never calibrated).

    Examples
    --------
    >>> is_gated_policy("snapkv@0.50+drop0.1"), is_gated_policy("snapkv@0.50")
    (True, False)
    """
    return parse_policy_name(name).is_gated


#: Gate kinds whose thresholds are placed on a pilot split, at pre-registered quantiles.
PilotGateKind = Literal["confidence", "lookahead", "learned", "recompute", "certificate_recompute"]
#: The pilot gate kinds in sequence order.
PILOT_GATE_KINDS: tuple[PilotGateKind, ...] = ("confidence", "lookahead", "learned", "recompute", "certificate_recompute")


@dataclass(frozen=True)
class GateChoice:
    """One gate setting of the contract's grid, as the contract says it: fixed thresholds
    (``agreement_drop`` t, ``certificate`` b; None: that part off), or a pilot gate ``pilot_kind``
    at the pre-registered ``quantile`` whose threshold the pilot split places (``features``: the
    learned gate's feature groups). All None: ungated.

    Examples
    --------
    >>> GateChoice(agreement_drop=0.1).name("snapkv@0.50")
    'snapkv@0.50+drop0.1'
    >>> GateChoice(pilot_kind="confidence", quantile=0.2).name("snapkv@0.50")
    'snapkv@0.50+confq0.2'
    >>> GateChoice().is_gated
    False
    """

    agreement_drop: float | None = None
    certificate: float | None = None
    pilot_kind: PilotGateKind | None = None
    quantile: float | None = None
    features: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        # A spec read from JSON builds these too (CandidateInfo.pilot_gate): refuse what the
        # contract's grid can never produce, in one line, before the pilot reads it.
        if (self.pilot_kind is None) != (self.quantile is None):
            raise ValueError("a pilot gate needs both pilot_kind (confidence, lookahead, learned, recompute or "
                             "certificate_recompute) and its quantile")
        if self.quantile is not None and not 0.0 < self.quantile < 1.0:
            raise ValueError(f"a pilot gate's quantile must lie strictly between 0 and 1, got {self.quantile}")

    @property
    def is_gated(self) -> bool:
        return self.agreement_drop is not None or self.certificate is not None or self.pilot_kind is not None

    def name(self, base: str) -> str:
        """The gated candidate's name over `base` (`base` itself when ungated)."""
        return gated_policy_name(base, self.agreement_drop, self.certificate, pilot_kind=self.pilot_kind, quantile=self.quantile)


@dataclass(frozen=True)
class PolicyEntry:
    """One policy entry of a contract, as candidates are built from it: its names' prefix
    (``display``: the label or the press), the press, its retentions in test order, the press's
    kwargs, the label, and the gate settings it is tested under (``choices``, ungated first:
    :func:`gate_choices`).

    Examples
    --------
    >>> entry = PolicyEntry("fast", "snapkv", (0.8, 0.5), label="fast", choices=gate_choices([0.1]))
    >>> [c.policy for c in candidates([entry])]  # the label names the candidates
    ['fast@0.80', 'fast@0.50']
    >>> entry_sequences([entry])  # the gated setting makes a sequence of its own
    [['fast@0.80', 'fast@0.50'], ['fast@0.80+drop0.1', 'fast@0.50+drop0.1']]
    """

    display: str
    press: str
    kv_retained: tuple[float, ...]
    press_kwargs: Mapping[str, Any] = field(default_factory=dict)
    label: str | None = None
    choices: tuple[GateChoice, ...] = (GateChoice(),)
    #: Per rung (aligned with `kv_retained`), its KV format's mapping and display name; empty:
    #: no format (16-bit), every rung named by `display`.
    kv_formats: tuple[Mapping[str, Any], ...] = ()
    displays: tuple[str, ...] = ()

    def rungs(self) -> list[tuple[int, float, str, Mapping[str, Any] | None]]:
        """(position, kv_retained, policy name, KV format or None) of each rung, in test order.

        Examples
        --------
        >>> entry = PolicyEntry("hqq", "none", (1.0, 1.0), kv_formats=({"nbits": 8}, {"nbits": 4}), displays=("hqq8", "hqq4"))
        >>> [name for _, _, name, _ in entry.rungs()]
        ['hqq8@1.00', 'hqq4@1.00']
        """
        displays = self.displays or (self.display,) * len(self.kv_retained)
        formats: tuple[Mapping[str, Any] | None, ...] = self.kv_formats or (None,) * len(self.kv_retained)
        return [(k, kv, policy_name(displays[k], kv), formats[k]) for k, kv in enumerate(self.kv_retained)]


@dataclass(frozen=True)
class Candidate:
    """One candidate: `policy` is its name, `base_policy` the ungated candidate it runs (itself
    when ungated), `gate` its gate setting (None: ungated; a gated candidate is derived from its
    base's records, never calibrated itself). `position` is its place within its sequence (0 =
    most conservative); `sequence` is its policy entry's index for an ungated candidate (what
    calibration runs) and its sequence's index among :func:`entry_sequences` for a gated one.

    Examples
    --------
    >>> entry = PolicyEntry("snapkv", "snapkv", (0.8, 0.5), choices=gate_choices([0.1]))
    >>> gated = gated_candidates([entry])[-1]
    >>> gated.policy, gated.base_policy, gated.position, gated.gate.agreement_drop
    ('snapkv@0.50+drop0.1', 'snapkv@0.50', 1, 0.1)
    """

    policy: str
    base_policy: str
    press: str
    kv_retained: float
    press_kwargs: dict[str, Any] = field(default_factory=dict)
    sequence: int = 0
    position: int = 0
    label: str | None = None
    gate: GateChoice | None = None
    kv_format: Mapping[str, Any] | None = None

    @property
    def is_gated(self) -> bool:
        return self.gate is not None


def gate_choices(
    agreement_drop: Sequence[float] = (),
    certificate: Sequence[float] = (),
    pilot: Iterable[GateChoice] = (),
    *,
    certificates: bool = False,
    decoding: bool = False,
    formatted: bool = False,
) -> tuple[GateChoice, ...]:
    """Every gate setting an entry is tested under, in sequence order: ungated, each threshold t,
    then (`certificates`: its press produces certificates) each bound b and each pair (t, b),
    thresholds outer, then the `pilot` settings as given, the recompute ones only for an entry
    that compresses while `decoding` (only a decoding-time press's generation can be restarted),
    the certificate recompute ones only for an entry that does both. An entry whose KV is stored in
    a format (`formatted`) generates alone from its own prefill: only its confidence and recompute
    settings, which read its own answer.

    Examples
    --------
    >>> [c.name("p@0.50") for c in gate_choices([0.2], [0.02], certificates=True)]
    ['p@0.50', 'p@0.50+drop0.2', 'p@0.50+cert0.02', 'p@0.50+drop0.2+cert0.02']
    >>> len(gate_choices([0.2], [0.02], certificates=False))  # no certificate: no +cert settings
    2
    >>> recompute = [GateChoice(pilot_kind="recompute", quantile=0.1)]
    >>> len(gate_choices(pilot=recompute)), len(gate_choices(pilot=recompute, decoding=True))
    (1, 2)
    >>> by_certificate = [GateChoice(pilot_kind="certificate_recompute", quantile=0.1)]
    >>> [c.name("p@0.50") for c in gate_choices(pilot=by_certificate, certificates=True, decoding=True)]
    ['p@0.50', 'p@0.50+recc0.1']
    >>> len(gate_choices(pilot=by_certificate, decoding=True))  # a decoding press without certificates
    1
    >>> looks = [GateChoice(pilot_kind="lookahead", quantile=0.3)]
    >>> [c.name("q@1.00") for c in gate_choices([0.2], pilot=recompute + looks, decoding=True, formatted=True)]
    ['q@1.00', 'q@1.00+recq0.1']
    """
    choices = [GateChoice()] + [GateChoice(agreement_drop=t) for t in agreement_drop]
    if certificates:
        choices += [GateChoice(certificate=b) for b in certificate]
        choices += [GateChoice(agreement_drop=t, certificate=b) for t in agreement_drop for b in certificate]
    restartable = {"recompute": decoding, "certificate_recompute": decoding and certificates}
    pilot = [c for c in pilot if restartable.get(str(c.pilot_kind), True)]
    if formatted:
        return (GateChoice(), *(c for c in pilot if c.pilot_kind in ("confidence", "recompute")))
    return (*choices, *pilot)


def candidates(entries: Iterable[PolicyEntry]) -> list[Candidate]:
    """The ungated candidates (those calibration runs), entry by entry, in test order.

    Examples
    --------
    >>> entry = PolicyEntry("snapkv", "snapkv", (0.8, 0.5), choices=gate_choices([0.1]))
    >>> [c.policy for c in candidates([entry])]
    ['snapkv@0.80', 'snapkv@0.50']
    """
    return [
        Candidate(name, name, e.press, kv, dict(e.press_kwargs), s, k, e.label, kv_format=fmt)
        for s, e in enumerate(entries)
        for k, kv, name, fmt in e.rungs()
    ]


def gated_candidates(entries: Iterable[PolicyEntry]) -> list[Candidate]:
    """The gated candidates (derived from their bases' records), sequence by sequence.

    Examples
    --------
    >>> entry = PolicyEntry("snapkv", "snapkv", (0.8, 0.5), choices=gate_choices([0.1]))
    >>> [(c.policy, c.base_policy) for c in gated_candidates([entry])]
    [('snapkv@0.80+drop0.1', 'snapkv@0.80'), ('snapkv@0.50+drop0.1', 'snapkv@0.50')]
    """
    pairs = [(e, choice) for e in entries for choice in e.choices]  # one sequence per pair
    return [
        Candidate(choice.name(base), base, e.press, kv, dict(e.press_kwargs), s, k, e.label, choice, fmt)
        for s, (e, choice) in enumerate(pairs)
        if choice.is_gated
        for k, kv, base, fmt in e.rungs()
    ]


def entry_sequences(entries: Iterable[PolicyEntry]) -> list[list[str]]:
    """Policy names per sequence, in test order: for each entry, one sequence per gate setting.

    Examples
    --------
    >>> entry = PolicyEntry("snapkv", "snapkv", (0.8, 0.5), choices=gate_choices([0.1]))
    >>> entry_sequences([entry])
    [['snapkv@0.80', 'snapkv@0.50'], ['snapkv@0.80+drop0.1', 'snapkv@0.50+drop0.1']]
    """
    return [[choice.name(name) for _, _, name, _ in e.rungs()] for e in entries for choice in e.choices]
