"""From a contract to the core's inputs: its candidates, their test order and the CertificationSpec.

The core knows nothing about contracts, so that it can certify any loss table; this module is the
one place a validated contract (:class:`certkv.contract.schema.Contract`) becomes what the core
reads: the candidates calibration runs (:func:`candidates`), the gated ones derived from them
(:func:`gated_candidates`), the pre-registered sequences (:func:`sequences`) and the
:class:`~certkv.core.spec.CertificationSpec` that :func:`certkv.core.certify.certify` takes
(:func:`certification_spec`). Naming and ordering are :mod:`certkv.core.policy_names`'. Torch-free.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from certkv.contract.schema import Contract
from certkv.core import policy_names
from certkv.core.policy_names import Candidate, entry_sequences
from certkv.core.spec import CertificationSpec, PilotConfig
from certkv.kv_formats.spec import needs_pilot_scales, parse_format, with_pilot_scales


def candidates(contract: Contract) -> list[Candidate]:
    """Every ungated candidate (what calibration runs), entry by entry, each in its test order.

    Examples
    --------
    >>> from certkv.contract.loading import parse_contract
    >>> contract = parse_contract({
    ...     "name": "mini", "requests": {"source": "requests.jsonl"}, "utility": "exact_match",
    ...     "tolerance": 0.0, "risk": 0.1, "confidence": 0.9,
    ...     "policies": [{"press": "snapkv", "kv_retained": [0.8, 0.5]}], "gate": {"agreement_drop": [0.1]}})
    >>> [(c.policy, c.sequence, c.position) for c in candidates(contract)]  # the gated ones are not calibrated
    [('snapkv@0.80', 0, 0), ('snapkv@0.50', 0, 1)]
    """
    return policy_names.candidates(contract.policy_entries())


def gated_candidates(contract: Contract) -> list[Candidate]:
    """Every gated candidate, sequence by sequence in the per-entry layout of :func:`sequences`
    (as without `order`); each is derived from its base's records, never calibrated.

    Examples
    --------
    >>> from certkv.contract.loading import parse_contract
    >>> contract = parse_contract({
    ...     "name": "mini", "requests": {"source": "requests.jsonl"}, "utility": "exact_match",
    ...     "tolerance": 0.0, "risk": 0.1, "confidence": 0.9,
    ...     "policies": [{"press": "snapkv", "kv_retained": [0.8, 0.5]}], "gate": {"agreement_drop": [0.1]}})
    >>> [(c.policy, c.base_policy) for c in gated_candidates(contract)]
    [('snapkv@0.80+drop0.1', 'snapkv@0.80'), ('snapkv@0.50+drop0.1', 'snapkv@0.50')]
    """
    return policy_names.gated_candidates(contract.policy_entries())


def sequences(contract: Contract) -> list[list[str]]:
    """Policy names per sequence, in test order: the interleaved `order` as one sequence when the
    contract gives one, else, for each policy entry, its ungated sequence followed by one sequence
    per gate setting (:func:`certkv.core.policy_names.gate_choices`). Under procedure pilot_ordered
    these are the candidates; the pilot orders them into one sequence at certification time
    (:mod:`certkv.core.pilot`).

    Examples
    --------
    >>> from certkv.contract.loading import parse_contract
    >>> terms = {
    ...     "name": "mini", "requests": {"source": "requests.jsonl"}, "utility": "exact_match",
    ...     "tolerance": 0.0, "risk": 0.1, "confidence": 0.9,
    ...     "policies": [{"press": "snapkv", "kv_retained": [0.8, 0.5]}], "gate": {"agreement_drop": [0.1]}}
    >>> sequences(parse_contract(terms))  # one per entry, then one per gate setting
    [['snapkv@0.80', 'snapkv@0.50'], ['snapkv@0.80+drop0.1', 'snapkv@0.50+drop0.1']]
    >>> order = ["snapkv@0.80", "snapkv@0.80+drop0.1", "snapkv@0.50", "snapkv@0.50+drop0.1"]
    >>> sequences(parse_contract({**terms, "order": order}))  # an interleaved order is one sequence
    [['snapkv@0.80', 'snapkv@0.80+drop0.1', 'snapkv@0.50', 'snapkv@0.50+drop0.1']]
    """
    if contract.order is not None:
        return [list(contract.order)]
    return entry_sequences(contract.policy_entries())


def certification_spec(contract: Contract, kv_amax: list[list[float]] | None = None) -> CertificationSpec:
    """The contract's τ, ε, confidence, procedure and sequences as a CertificationSpec.

    The sequences are the contract's policy entries in the order written, each followed by its
    gated sequences (:func:`sequences`); that order is the pre-registration and is never
    re-derived from data. ``candidate_info`` carries what deploying each candidate needs (base
    policy, press_kwargs, gate settings). A pilot gate (confidence, lookahead, learned) carries its
    quantile and ``pilot_gate``; its threshold is placed on the pilot split (``gate.pilot``, drawn
    by ``requests.seed``) when the records are certified; an fp8 format's pilot scales are placed
    from `kv_amax`, the pilot's key and value magnitudes per layer that calibration bound to the store
    (:mod:`certkv.calibration.kv_scales`). ``requests.group_by: context`` becomes
    the spec's ``grouping`` (its measure), ``request`` its ``independent_requests``.

    Examples
    --------
    >>> from certkv.contract.loading import parse_contract
    >>> contract = parse_contract({
    ...     "name": "mini", "requests": {"source": "requests.jsonl"}, "utility": "exact_match",
    ...     "tolerance": 0.0, "risk": 0.1, "confidence": 0.9,
    ...     "policies": [{"press": "snapkv", "kv_retained": [0.8, 0.5]}],
    ...     "gate": {"agreement_drop": [0.1]}})
    >>> spec = certification_spec(contract)
    >>> spec.sequences
    [['snapkv@0.80', 'snapkv@0.50'], ['snapkv@0.80+drop0.1', 'snapkv@0.50+drop0.1']]
    >>> spec.candidate_info["snapkv@0.50+drop0.1"].gate.agreement_drop
    0.1
    """
    gate = contract.gate
    pilot = None
    if gate is not None and gate.pilot is not None:
        pilot = PilotConfig(share=gate.pilot, seed=contract.requests.seed)
    return CertificationSpec.parse(
        {
            "tolerance": contract.tolerance,
            "risk": contract.risk,
            "confidence": contract.confidence,
            "procedure": contract.procedure,
            "sequences": sequences(contract),
            "candidate_info": _candidate_info(contract, kv_amax),
            "max_new_tokens": contract.protocol.max_new_tokens,
            "query_aware": contract.protocol.query_aware,
            "pilot": pilot,
            "strata": None if contract.strata is None else contract.strata.model_dump(),
            "utility": contract.utility,
            "kv_cost": contract.cost_measure,
            "context_margin": 0.0 if contract.coverage is None else contract.coverage.context_margin,
            **_grouping(contract),
        },
        source=f"contract {contract.name}",
    )


def _grouping(contract: Contract) -> dict[str, Any]:
    """The spec's grouping from ``requests.group_by``: the measure of a per-context certificate, or
    the user's statement that questions sharing a context are independent; nothing when unset (the
    spec keys are left out, so a contract without grouping gives the spec it always gave)."""
    if contract.requests.group_by == "context":
        bound = {} if contract.requests.group_bound is None else {"bound": contract.requests.group_bound}
        return {"grouping": {"measure": contract.requests.measure, **bound}}
    if contract.requests.group_by == "request":
        return {"independent_requests": True}
    return {}


def _format_info(kv_format: Mapping[str, Any] | None, kv_amax: list[list[float]] | None) -> dict[str, Any]:
    """A candidate's KV format, its fp8 pilot scales placed from `kv_amax` (the store's), and its
    engine counterpart (nothing for a 16-bit candidate, so the spec of a contract without formats
    is what it always was)."""
    if kv_format is None:
        return {}
    fmt = parse_format(dict(kv_format))
    if kv_amax is not None and needs_pilot_scales(fmt):
        fmt = with_pilot_scales(fmt, kv_amax)
    return {"kv_format": fmt.model_dump(), "engine_setting": fmt.engine_counterpart()}


def _candidate_info(contract: Contract, kv_amax: list[list[float]] | None = None) -> dict[str, dict[str, Any]]:
    """policy → what deploying it needs: base policy and press_kwargs, and for a gated candidate
    its gate settings (the contract's agreement parameters beside the candidate's thresholds; a
    pilot gate's quantile, lookahead length and ``pilot_gate`` choice)."""
    info: dict[str, dict[str, Any]] = {
        c.policy: {"base_policy": c.policy, "press_kwargs": dict(c.press_kwargs), **_format_info(c.kv_format, kv_amax)}
        for c in candidates(contract)
    }
    gate = contract.gate
    if gate is None:  # no gate block: no gated candidates
        return info
    for g in gated_candidates(contract):
        choice = g.gate
        if choice is None:  # gated_candidates yields gated ones only; narrows the type
            continue
        settings: dict[str, Any] = {
            "agreement_drop": choice.agreement_drop,
            "certificate": choice.certificate,
            "agreement_window": gate.agreement_window,
            "agreement_top_k": gate.agreement_top_k,
            "agreement_split": gate.agreement_split,
        }
        entry: dict[str, Any] = {"base_policy": g.base_policy, "press_kwargs": dict(g.press_kwargs), "gate": settings,
                                 **_format_info(g.kv_format, kv_amax)}
        if choice.pilot_kind is not None:
            settings["quantile"] = choice.quantile
            settings["lookahead_tokens"] = gate.lookahead_tokens
            entry["pilot_gate"] = choice
        info[g.policy] = entry
    return info


__all__ = ["candidates", "certification_spec", "gated_candidates", "sequences"]
