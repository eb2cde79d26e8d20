"""From a contract to the core's :class:`~certkv.core.spec.CertificationSpec`.

The core knows nothing about contracts, so that it can certify any loss table; this is the one
place where a contract's pre-registered choices become a spec. Torch-free.
"""

from __future__ import annotations

from certkv.core.spec import CertificationSpec, PilotConfig, PilotGate


def certification_spec(contract):
    """The contract's τ, ε, confidence, procedure and sequences as a CertificationSpec.

    The sequences are the contract's policy entries in the order written, each followed by its
    gated sequences (:meth:`certkv.contract.schema.Contract.sequences`); that order is the
    pre-registration and is never re-derived from data. ``candidate_info`` carries what deploying
    each candidate needs (base policy, press_kwargs, gate settings). A pilot gate (confidence,
    lookahead, learned) carries its quantile and ``pilot_gate``; its threshold is placed on the
    pilot split (``gate.pilot``, drawn by ``requests.seed``) when the records are certified.
    """
    info = {c.policy: {"base_policy": c.policy, "press_kwargs": dict(c.press_kwargs)} for c in contract.candidates()}
    gate = contract.gate
    for g in contract.gated_candidates():
        settings = {
            "agreement_drop": g.agreement_drop,
            "certificate": g.certificate,
            "agreement_window": gate.agreement_window,
            "agreement_top_k": gate.agreement_top_k,
            "agreement_split": gate.agreement_split,
        }
        entry = {"base_policy": g.base_policy, "press_kwargs": dict(g.press_kwargs), "gate": settings}
        if g.pilot_kind is not None:
            settings["quantile"] = g.quantile
            settings["lookahead_tokens"] = gate.lookahead_tokens
            features = tuple(gate.learned.features) if g.pilot_kind == "learned" else ()
            entry["pilot_gate"] = PilotGate(kind=g.pilot_kind, quantile=g.quantile, features=features)
        info[g.policy] = entry
    pilot = None
    if gate is not None and gate.pilot is not None:
        pilot = PilotConfig(share=gate.pilot, seed=contract.requests.seed)
    return CertificationSpec.parse(
        {
            "tolerance": contract.tolerance,
            "risk": contract.risk,
            "confidence": contract.confidence,
            "procedure": contract.procedure,
            "sequences": contract.sequences(),
            "candidate_info": info,
            "max_new_tokens": contract.protocol.max_new_tokens,
            "pilot": pilot,
            "strata": None if contract.strata is None else contract.strata.model_dump(),
            "utility": contract.utility,
            "context_margin": 0.0 if contract.coverage is None else contract.coverage.context_margin,
        },
        source=f"contract {contract.name}",
    )
