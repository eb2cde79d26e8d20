"""fp8 scales placed on the pilot split: ``cache: {backend: fp8, scale: pilot}``.

An engine's fp8 KV cache divides each layer's keys and values by a scale before the cast; without
calibration the scale is 1.0 (vLLM, SGLang), with it the tensor's largest magnitude over the
format's largest value (vLLM's ``k_scale`` / ``v_scale`` per attention layer). certkv places such
scales on the contract's pilot requests, the split that places the gates' thresholds and never
certifies: before calibration, each pilot request's context is prefilled with the full cache (as
the protocol prefills it) and, per layer, the largest magnitude of its keys and of its values is
kept. The result is bound to the store (meta ``kv_pilot_amax``, with the pilot's request ids in
``kv_pilot_ids``), so a resumed run and the certifier read the same scales; certification checks
that every request they were placed on is in its pilot.
"""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING

import torch
from transformers import DynamicCache

from certkv.contract.spec import candidates
from certkv.core.sampling_unit import draw_pilot
from certkv.errors import CertkvError
from certkv.kv_formats.spec import needs_pilot_scales, parse_format
from certkv.model.generation import encode_request, for_protocol
from certkv.model.loading import load_model

if TYPE_CHECKING:
    from certkv.calibration.store import CalibrationStore
    from certkv.contract.schema import Contract
    from certkv.requests.request_set import Request


def needs_scales(contract: Contract) -> bool:
    """Whether a candidate of `contract` has fp8 scales to place on the pilot."""
    return any(c.kv_format is not None and needs_pilot_scales(parse_format(dict(c.kv_format))) for c in candidates(contract))


#: The share of the pilot's ranks the scales are placed on: certification draws its pilot from the
#: requests calibration did not skip, a little smaller when some were, and the pilot's first ranks are
#: in it unless more than a tenth of it is skipped (certification checks, :mod:`certkv.calibration.certification`).
PLACEMENT_SHARE = 0.9


def pilot_ids(contract: Contract, requests: list[Request]) -> list[str]:
    """The requests the scales are placed on: the first :data:`PLACEMENT_SHARE` of the pilot as
    certification draws it (``gate.pilot`` of the ids ranked by the contract's seed), from every
    request the contract plans."""
    gate = contract.gate
    if gate is None or gate.pilot is None:
        raise CertkvError("cache.scale: pilot places fp8 scales on the pilot split; set gate.pilot (e.g. 0.25)")
    seed = contract.requests.seed
    pilot = draw_pilot([r.id for r in requests], gate.pilot, seed, min_certification=1).pilot_ids
    ranked = sorted(pilot, key=lambda rid: (hashlib.sha256(f"{seed}:{rid}".encode()).hexdigest(), rid))  # draw_pilot's rank
    return ranked[: max(1, int(PLACEMENT_SHARE * len(ranked)))]


def pilot_amax(model, tokenizer, contract: Contract, requests: list[Request]) -> list[list[float]]:
    """Per layer, [largest |key|, largest |value|] over the pilot requests' full prefills."""
    chosen = set(pilot_ids(contract, requests))
    longest = getattr(model.config, "max_position_embeddings", None)
    amax: list[list[float]] | None = None
    with torch.no_grad():
        for request in requests:
            if request.id not in chosen or not request.context.strip():
                continue
            enc = for_protocol(encode_request(tokenizer, request.context, request.question, request.answer_prefix),
                               contract.protocol.query_aware)
            if longest is not None and len(enc.context_ids) + len(enc.question_ids) + contract.protocol.max_new_tokens > longest:
                continue  # calibration skips it too (longer than the model's positions)
            cache = DynamicCache()
            model.model(input_ids=torch.as_tensor(enc.context_ids, device=model.device).view(1, -1), past_key_values=cache)
            seen = [[float(layer.keys.abs().max()), float(layer.values.abs().max())] for layer in cache.layers]
            amax = seen if amax is None else [[max(a, b) for a, b in zip(old, new)] for old, new in zip(amax, seen)]
    if amax is None:
        raise CertkvError("the pilot holds no request to place the fp8 scales on; raise gate.pilot or the request count")
    return amax


def placed_amax(contract: Contract, store: CalibrationStore, requests: list[Request], device: str | None,
                dtype: str | None, executor: str) -> list[list[float]] | None:
    """The pilot's per-layer amax the contract's fp8 pilot scales divide (None: it has none), placed
    now and bound to `store`, or read back from it on a resumed run; the local `executor` only."""
    if not needs_scales(contract):
        return None
    if executor != "local" or device is None:
        raise CertkvError("fp8 scales placed on the pilot are computed and used by the local executor; "
                          "calibrate this contract without --executor ray")
    meta = store.meta()
    if "kv_pilot_amax" in meta:
        return json.loads(meta["kv_pilot_amax"])
    model, tokenizer = load_model(contract.local_model, device=device, dtype=dtype or contract.protocol.dtype)
    amax = pilot_amax(model, tokenizer, contract, requests)
    store.bind({"kv_pilot_amax": json.dumps(amax), "kv_pilot_ids": json.dumps(sorted(pilot_ids(contract, requests)))})
    return amax


__all__ = ["needs_scales", "pilot_amax", "pilot_ids", "placed_amax"]
