"""Long generations: what each policy breaks, what its KV costs in tokens and bytes, the certified
point and a held-out check of it, the recompute gate, calibration cost.

Run after calibrating and certifying the contract (default ``contracts/embedded_long.yaml``)::

    certkv calibrate contracts/embedded_long.yaml
    certkv certify contracts/embedded_long.yaml
    python benchmarks/long_generation.py            # writes benchmarks/results/long_generation.json

From the store (every request): per policy, violations under the contract's label-free utility and
under the task's own utility against the references (exact match of the recited list), with the
mean peak and KV-time KV relative to the full cache, in tokens and in bytes over a 16-bit full
cache. From the operating point: per task, every ungated candidate's violations on the
certification split, its bound, whether it certified, its token peak share and its bytes (the
tokens × precision table, and ``docs/img/bytes_vs_tokens.png``); the certified point with its
bytes, KV format and engine setting. A held-out check: the certified policy alone (its one rung),
calibrated on requests of a seed the contract never drew (4343, as many as the contract's limit)
in a copy of the contract under ``--heldout-work`` (resumable), scored with the operating point's
own gate threshold. The recompute gate, per base policy, on the pilot and on the certification
split: the AUC of its signal (the lowest token probability, low = suspect) for the requests the
base breaks, the share each placed threshold restarts, and the share it restarts too late (counted
as violated). Calibration cost: on ``--timing-requests`` requests, certkv's engine for every
candidate against kvpress's own pipeline once per candidate and for the full cache, side by side,
alternating, in one process; a KV format's pipeline run is given the format's cache.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "long_generation.json"
FIGURE = ROOT / "docs" / "img" / "bytes_vs_tokens.png"


def _rows(contract):
    from certkv.calibration.store import CalibrationStore

    with CalibrationStore.read(contract.resolved_store_path()) as store:
        return store.records()


def policy_table(contract, rows, references) -> list[dict]:
    """Per policy: violations under the contract's utility and the task utility, mean KV costs."""
    from certkv.calibration.utility import score
    from certkv.core.binomial import violation_mask

    full = {r["request_id"]: r["answer"] for r in rows if r["policy"] == "full"}
    out = []
    for policy in dict.fromkeys(r["policy"] for r in rows if r["policy"] != "full"):
        mine = [r for r in rows if r["policy"] == policy]
        task_loss = [
            score("exact_match", full[r["request_id"]], references[r["request_id"]])
            - score("exact_match", r["answer"], references[r["request_id"]])
            for r in mine
        ]
        out.append({
            "policy": policy,
            "n": len(mine),
            "violations": int(violation_mask([r["loss"] for r in mine], contract.tolerance).sum()),
            "task_violations": int(violation_mask(task_loss, contract.tolerance).sum()),
            "kv_peak": float(np.mean([r["kv_peak"] for r in mine])),
            "kv_time": float(np.mean([r["kv_time"] for r in mine])),
            # bytes over a 16-bit full cache (a 16-bit candidate's equal its token shares)
            "kv_peak_bytes": float(np.mean([r.get("kv_peak_bytes", r["kv_peak"]) for r in mine])),
            "kv_time_bytes": float(np.mean([r.get("kv_time_bytes", r["kv_time"]) for r in mine])),
        })
    return out


def _format_name(info) -> str | None:
    """A candidate's KV format by its name (``kint8-vint4``), None for 16 bits."""
    from certkv.kv_formats.spec import parse_format

    return None if info is None or info.kv_format is None else parse_format(dict(info.kv_format)).name


def tokens_precision(contract, rows, point_path: Path) -> dict[str, list[dict]]:
    """Per task, every ungated candidate of the operating point: which tokens it keeps (its mean token
    peak share ``kv_peak`` on the certification split) and at what precision (its format), its bytes
    (the point's ``peak_kv_bytes`` / ``mean_kv_bytes``: means over the certification split), its
    violations k/n there (the task's own when the contract has several), the certificate's bound and
    whether it certified ("not tested": fixed-sequence testing stopped before it)."""
    from certkv.contract.spec import certification_spec
    from certkv.core.operating_point import load_operating_point
    from certkv.report.text import candidate_status

    op = load_operating_point(point_path)
    info = certification_spec(contract).candidate_info
    pilot_ids = set(op.pilot.request_ids) if op.pilot else set()
    cert: dict[str, list[dict]] = {}
    for r in rows:
        if r["request_id"] not in pilot_ids:
            cert.setdefault(r["policy"], []).append(r)
    out: dict[str, list[dict]] = {}
    for c in op.candidates:
        if c.gate is not None:
            continue
        mine = cert[c.policy]
        tasks = c.per_task or {None: None}
        for task, breakdown in tasks.items():
            here = [r for r in mine if task is None or r["task"] == task]
            out.setdefault(task or "all", []).append({
                "policy": c.policy, "press": c.press, "format": _format_name(info.get(c.policy)),
                "engine_setting": getattr(info.get(c.policy), "engine_setting", None),
                "kv_peak": float(np.mean([r["kv_peak"] for r in here])),
                "kv_time": float(np.mean([r["kv_time"] for r in here])),
                "peak_kv_bytes": c.peak_kv_bytes, "mean_kv_bytes": c.mean_kv_bytes,
                "n": breakdown.n if breakdown else c.n,
                "violations": breakdown.violations if breakdown else c.violations,
                "pooled_n": c.n, "pooled_violations": c.violations,
                "risk_upper_bound": c.risk_upper_bound, "certified": c.certified,
                "status": candidate_status(op, c),
            })
    return out


def point_tokens(rows, point: dict) -> float:
    """The certified point's mean token peak share on the certification split, a request its gate
    restarts counted as a full cache (1.0), as its bytes are."""
    from certkv.core.gated import gated_mask
    from certkv.core.loss_table import LossTable
    from certkv.core.spec import GateSettings

    if point["fallback"]:
        return 1.0
    pilot_ids = set(point["pilot"]["request_ids"]) if point.get("pilot") else set()
    base = point["base_policy"]
    mine = [r for r in rows if r["request_id"] not in pilot_ids and r["policy"] in ("full", base)]
    table = LossTable.from_records(mine, source="store")
    peak = {r["request_id"]: r["kv_peak"] for r in mine if r["policy"] == base}
    values = np.array([peak[i] for i in table.request_ids])
    if point.get("gate"):
        values = np.where(gated_mask(table, table.index_of(base), GateSettings(**point["gate"])), 1.0, values)
    return float(values.mean())


def chosen_point(point: dict, rows) -> dict:
    """The certified point: its policy, k/n, bound, memory, bytes and token peak share, KV format (by
    name and as stored), engine setting and gate."""
    from certkv.kv_formats.spec import parse_format

    fmt = point.get("kv_format")
    gate = point.get("gate") or {}
    return {
        "kv_peak": point_tokens(rows, point),
        **{k: point[k] for k in ("policy", "base_policy", "press", "mean_kv_retained", "fallback", "n", "violations",
                                 "risk_upper_bound")},
        "peak_kv_bytes": point.get("peak_kv_bytes"), "mean_kv_bytes": point.get("mean_kv_bytes"),
        "kv_format": fmt, "format": None if fmt is None else parse_format(fmt).name,
        "engine_setting": point.get("engine_setting"),
        "recompute": gate.get("recompute"), "quantile": gate.get("quantile"), "gated_share": point.get("gated_share"),
    }


#: The held-out check's seed: one the contract never draws (the contract's comment reserves it).
HELDOUT_SEED = 4343


def heldout_contract(contract_path: Path, point: dict, work: Path) -> Path:
    """A copy of the contract in `work` for the held-out check: requests of :data:`HELDOUT_SEED`
    (as many as the contract's limit), only the certified policy's entry narrowed to its one rung
    (its ``kv_retained`` or ``cache.nbits``), the gate block only when the point is gated (its one
    quantile), its store in `work`. Checked: the copy calibrates exactly the certified base policy."""
    import yaml

    from certkv.contract.loading import load_contract
    from certkv.contract.spec import candidates

    raw = yaml.safe_load(Path(contract_path).read_text(encoding="utf-8"))
    base, gate = point["base_policy"], point.get("gate")
    work.mkdir(parents=True, exist_ok=True)
    path = work / f"{raw['name']}_heldout.yaml"
    header = (f"# Held-out check of {_shown(Path(contract_path))}'s certified point {point['policy']} "
              f"(written by benchmarks/long_generation.py): requests of seed {HELDOUT_SEED}, its one policy.\n")
    copy = {**raw, "name": f"{raw['name']}_heldout", "store": "store",
            "requests": {**raw["requests"], "seed": HELDOUT_SEED}}
    copy.pop("order", None)
    if gate is None:
        copy.pop("gate", None)
    else:
        copy["gate"] = {**raw["gate"], "recompute": {**raw["gate"]["recompute"], "quantiles": [gate["quantile"]]}}
    ungated = {k: v for k, v in copy.items() if k != "gate"}  # an entry's names do not depend on the gate
    for entry in raw["policies"]:
        path.write_text(header + yaml.safe_dump({**ungated, "policies": [entry]}, sort_keys=False), encoding="utf-8")
        names = [c.policy for c in candidates(load_contract(path))]
        if base not in names:
            continue
        rung = names.index(base)
        one = dict(entry)
        if isinstance(one.get("kv_retained"), list):
            one["kv_retained"] = [one["kv_retained"][rung]]
        if isinstance((one.get("cache") or {}).get("nbits"), list):
            one["cache"] = {**one["cache"], "nbits": one["cache"]["nbits"][rung]}
        path.write_text(header + yaml.safe_dump({**copy, "policies": [one]}, sort_keys=False), encoding="utf-8")
        names = [c.policy for c in candidates(load_contract(path))]
        if names != [base]:
            raise RuntimeError(f"the held-out copy calibrates {names}, not [{base!r}]")
        return path
    raise RuntimeError(f"no policy entry of {contract_path} names {base!r}")


def heldout_check(path: Path, point: dict) -> dict:
    """The certified policy on the held-out requests of the copy at `path` (calibrated): its
    violations k/n over every request (a gated point's restarts read with the operating point's own
    threshold, as the runtime deploys it, none placed again), whether k/n ≤ ε, the ungated base's
    violations beside it, the share restarted and the mean peak bytes."""
    from certkv.calibration.store import CalibrationStore
    from certkv.contract.loading import load_contract
    from certkv.core.binomial import violation_mask
    from certkv.core.gated import derive_gated
    from certkv.core.loss_table import LossTable
    from certkv.core.spec import CandidateInfo, CertificationSpec, GateSettings

    contract = load_contract(path)
    with CalibrationStore.read(contract.resolved_store_path()) as store:
        records, skipped = store.records(), store.skipped()
    table = LossTable.from_records(records, source=f"store {contract.resolved_store_path()}")
    name, base = point["policy"], point["base_policy"]
    gated_share = 0.0
    if point.get("gate"):
        info = CandidateInfo(base_policy=base, gate=GateSettings(**point["gate"]))
        spec = CertificationSpec(tolerance=contract.tolerance, risk=contract.risk, confidence=contract.confidence,
                                 sequences=[[name]], candidate_info={name: info})
        table = derive_gated(table, spec)
        gated_share = table.gated[name].gated_share
    row, base_row = table.index_of(name), table.index_of(base)
    broken = violation_mask(table.loss[row], contract.tolerance)
    peak = table.byte_costs.get("kv_peak_bytes")
    return {
        "contract": str(path), "seed": contract.requests.seed, "planned": contract.requests.limit,
        "skipped_requests": len(skipped), "policy": name, "n": int(table.n_requests), "violations": int(broken.sum()),
        "rate": float(broken.mean()), "risk": contract.risk, "within_risk": bool(broken.mean() <= contract.risk),
        "base_violations": int(violation_mask(table.loss[base_row], contract.tolerance).sum()),
        "gated_share": float(gated_share),
        "peak_kv_bytes": None if peak is None else float(np.mean(peak[row])),
    }


def heldout(contract_path: Path, point: dict, work: Path) -> dict:
    """The held-out check (:func:`heldout_contract`, ``certkv calibrate`` on it, resumable, then
    :func:`heldout_check`); skipped when the point is the full cache."""
    if point["fallback"]:
        return {"skipped": True, "policy": point["policy"], "seed": HELDOUT_SEED}
    path = heldout_contract(contract_path, point, work)
    subprocess.run([str(Path(sys.executable).parent / "certkv"), "calibrate", str(path), "-q"], check=True)
    return {"skipped": False, **heldout_check(path, point)}


def recompute_gate(contract, rows, point: dict) -> list[dict]:
    """Per recompute-gated candidate of the operating point: its signal's AUC for the base's broken
    requests and the shares it restarts (in time and too late), on the pilot and certification split."""
    from sklearn.metrics import roc_auc_score

    from certkv.core.binomial import violation_mask

    pilot_ids = set(point["pilot"]["request_ids"]) if point.get("pilot") else set()
    by_policy: dict[str, list[dict]] = {}
    for r in rows:
        by_policy.setdefault(r["policy"], []).append(r)
    out = []
    for cand in point["candidates"]:
        gate = cand.get("gate") or {}
        if gate.get("recompute") is None:
            continue
        threshold = gate["recompute"]
        base = cand["policy"].rsplit("+", 1)[0]  # the gate's suffix (a press × format's name has a "+" too)
        entry = {"policy": cand["policy"], "threshold": threshold, "certified": cand["certified"],
                 "mean_memory": cand["mean_kv_retained"]}
        for split, keep in (("pilot", True), ("certification", False)):
            mine = [r for r in by_policy[base] if (r["request_id"] in pilot_ids) == keep]
            broken = violation_mask([r["loss"] for r in mine], contract.tolerance)
            low = np.array([r["confidence_min"] for r in mine])
            agreeing = np.array([r["confidence_min_agreeing"] for r in mine])
            restarted = low < threshold
            auc = float(roc_auc_score(broken, -low)) if 0 < broken.sum() < len(mine) else None
            entry[split] = {"n": len(mine), "broken": int(broken.sum()), "auc": auc,
                            "restarted": float(restarted.mean()) if mine else None,
                            "restarted_late": float((restarted & ~(agreeing < threshold)).mean()) if mine else None}
        out.append(entry)
    return out


def timing(contract, n: int) -> dict:
    """certkv's engine (every candidate) against kvpress's pipeline once per candidate and for the
    full cache, on the first `n` requests, in one process; and against its exact floor (the
    prefill, plus :func:`floor_decode_seconds`: the full answer's decode, and beside it every
    lane candidate's verifying forwards; the KV formats, which the floor does not model, apart).
    Also the part of each: the candidates certkv decodes as lanes of one drafted batch (the
    batchable decoding-time ones and the prefill-time ones beside them: the engine's
    ``candidates_decoding`` seconds, the full answer's share apart) against kvpress's pipeline for
    those candidates alone; and the KV-format candidates (each answer's own seconds) against the
    pipeline given the format's cache (``build_cache``), per candidate."""
    import kvpress  # noqa: F401  (registers the pipeline)
    import torch
    from kvpress.pipeline import KVPressTextGenerationPipeline
    from transformers import pipeline

    from certkv.calibration.run import load_engine
    from certkv.kv_formats.caches import build_cache

    class AnswerOnly(KVPressTextGenerationPipeline):
        """kvpress's pipeline without ``_remove_answer_from_cache``. kvpress 0.5.5 calls it after
        ``generate_answer`` has returned the answer, only to trim the answer's entries off the cache
        for a next question on the same context (there is none here: every call gets a fresh
        cache), and it fails there for HQQ caches (it slices HQQ's (tensor, metadata) tuple) and
        for quantised caches whose full-precision window the last step emptied (transformers leaves
        an empty 1-D tensor to slice): so it is skipped, for every candidate alike."""

        def _remove_answer_from_cache(self, cache, cache_seq_lengths) -> None:
            return None

    load_before = os.getloadavg()[0]
    torch.set_num_threads(1)
    engine, tok, _ = load_engine(contract, "cpu")
    pipe = pipeline("kv-press-text-generation", model=engine.model, tokenizer=tok, device="cpu",
                    pipeline_class=AnswerOnly)
    requests = contract.load_requests()[:n]
    certkv_s, kvpress_s, lanes_certkv, lanes_kvpress, floor_s = [], [], [], [], []
    fmt_certkv: dict[str, list[float]] = {c.policy: [] for c in engine.formatted}
    fmt_kvpress: dict[str, list[float]] = {c.policy: [] for c in engine.formatted}
    for request in requests:
        t0 = time.perf_counter()
        result = engine.run(request.context, request.question, request.answer_prefix)
        certkv_s.append(time.perf_counter() - t0)
        floor_s.append(result.seconds["prefill"] + floor_decode_seconds(engine, request, result))
        own = {a.policy: a.seconds for a in result.candidates}
        for policy in fmt_certkv:
            fmt_certkv[policy].append(own[policy])
        t1 = time.perf_counter()
        question = request.question + ("\n" + request.answer_prefix if request.answer_prefix else "")
        pipe(request.context, question=question, max_new_tokens=engine.max_new_tokens)
        in_lanes = 0.0
        for c in engine.candidates:
            t = time.perf_counter()
            if c.kv_format is None:
                pipe(request.context, question=question, press=c.press, max_new_tokens=engine.max_new_tokens)
            else:
                pipe(request.context, question=question, press=c.press,
                     cache=build_cache(c.kv_format, engine.model.config), max_new_tokens=engine.max_new_tokens)
                fmt_kvpress[c.policy].append(time.perf_counter() - t)
            in_lanes += time.perf_counter() - t if c in engine.lane_candidates else 0.0
        t2 = time.perf_counter()
        kvpress_s.append(t2 - t1)
        lanes_certkv.append(result.seconds.get("candidates_decoding", 0.0))
        lanes_kvpress.append(in_lanes)
    formats_certkv = [sum(fmt_certkv[p][i] for p in fmt_certkv) for i in range(len(requests))]
    formats_kvpress = [sum(fmt_kvpress[p][i] for p in fmt_kvpress) for i in range(len(requests))]
    lanes = {c.policy for c in engine.format_lanes}
    return {"requests": n, "candidates": len(engine.candidates), "certkv_seconds": float(np.mean(certkv_s)),
            "kvpress_seconds": float(np.mean(kvpress_s)), "speedup": float(np.sum(kvpress_s) / np.sum(certkv_s)),
            # the results file's keys say "rows" for the lanes of the drafted batch (kept: stored results use them)
            "decoding_rows": len(engine.decoding_lanes), "decoding_alone": len(engine.decoding) - len(engine.decoding_lanes),
            "prefill_rows": len(engine.lane_candidates) - len(engine.decoding_lanes),
            "rows_certkv_seconds": float(np.mean(lanes_certkv)), "rows_kvpress_seconds": float(np.mean(lanes_kvpress)),
            "rows_speedup": float(np.sum(lanes_kvpress) / max(np.sum(lanes_certkv), 1e-9)),
            # the floor models the lane candidates only: it is compared with certkv's time less the formats'
            "floor_seconds": float(np.mean(floor_s)),
            "over_floor": float((np.sum(certkv_s) - np.sum(formats_certkv)) / np.sum(floor_s)),
            "floor_without_formats": bool(engine.formatted),
            "full_answer_row": bool(engine.decoding_lanes),
            "formats": len(engine.formatted), "format_lanes": len(engine.format_lanes),
            "formats_certkv_seconds": float(np.mean(formats_certkv)) if engine.formatted else None,
            "formats_kvpress_seconds": float(np.mean(formats_kvpress)) if engine.formatted else None,
            "formats_speedup": (float(np.sum(formats_kvpress) / max(np.sum(formats_certkv), 1e-9))
                                if engine.formatted else None),
            "per_format": [{"policy": c.policy, "lane": c.policy in lanes, "press": c.press is not None,
                            "certkv_seconds": float(np.mean(fmt_certkv[c.policy])),
                            "kvpress_seconds": float(np.mean(fmt_kvpress[c.policy]))} for c in engine.formatted],
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
            "load_average_1m_before": load_before, "load_average_1m_after": os.getloadavg()[0]}


def floor_decode_seconds(engine, request, result) -> float:
    """The exact floor of certkv's scheme for one request, but its prefill (``result.seconds``):
    one batch of the full answer's lane, decoded as the engine decodes it (prompt lookup: it is
    not known yet), and every lane candidate fed the answer it gave as its draft, so that each
    forward confirms all the scheme lets it (its question, then its answer up to each compression
    event) from the request's full prefill. This is what drafting could at best leave: a verifier
    free to feed a question and its answer in one forward would save one forward a batch. Uses the
    engine's own lane builders; meant for contracts whose candidates all decode as lanes (both
    long-generation contracts). Raises when any answer differs from the engine's."""
    from certkv.engine.decoding_lanes import decode_lanes
    from certkv.model.generation import encode_request, for_protocol

    enc = for_protocol(encode_request(engine.tokenizer, request.context, request.question, request.answer_prefix),
                       engine.query_aware)
    prefilled, _ = engine._prefill(enc)
    engine._select(prefilled)
    own = {answer.policy: answer.token_ids for answer in result.candidates}
    t0 = time.perf_counter()
    lead = engine._full_lane(prefilled)
    lanes = [engine._lane(c, prefilled, own[c.policy])[0] for c in engine.lane_candidates]
    decode_lanes(engine.model, [lead, *lanes])
    seconds = time.perf_counter() - t0
    if lead.answer != result.full.token_ids:
        raise RuntimeError(f"{request.id}: the full answer's lane answered otherwise than the engine")
    if any(lane.answer != own[c.policy] for lane, c in zip(lanes, engine.lane_candidates)):
        raise RuntimeError(f"{request.id}: a candidate fed its own answer as its draft answered otherwise")
    return seconds


def bytes_figure(candidates: list[dict], chosen: dict, path: Path, title: str) -> Path:
    """``bytes_vs_tokens.png``: every ungated candidate at its token peak share (x) and its peak bytes
    over a 16-bit full cache (y), certified ones filled, the others hollow, coloured by what it
    compresses (tokens, precision, both); the certified point (gated or not) as a star; the
    diagonal y = x is where a 16-bit candidate sits. Labels: the certified candidates, the press ×
    format ones, and the eviction candidate breaking the fewest requests, each with its k/n."""
    from certkv.report.figures import _pyplot, save_figure

    plt = _pyplot()
    kinds = {"tokens (16-bit)": "#4575b4", "precision": "#d73027", "tokens × precision": "#1a9850"}

    def kind(c: dict) -> str:
        return "tokens (16-bit)" if c["format"] is None else ("precision" if c["press"] == "none" else "tokens × precision")

    fig, ax = plt.subplots(figsize=(8.4, 5.6))
    ax.plot([0, 1], [0, 1], color="#777777", ls=":", lw=1, label="y = x: 16-bit KV")
    for name, color in kinds.items():
        for certified in (True, False):
            mine = [c for c in candidates if kind(c) == name and c["certified"] == certified]
            if mine:
                ax.scatter([c["kv_peak"] for c in mine], [c["peak_kv_bytes"] for c in mine], s=46, lw=1.4,
                           edgecolors=color, facecolors=color if certified else "none", zorder=3,
                           label=f"{name}, {'certified' if certified else 'not certified'}")
    if not chosen["fallback"]:
        ax.scatter([chosen["kv_peak"]], [chosen["peak_kv_bytes"]], marker="*", s=190, color="#fdae61",
                   edgecolors="black", lw=0.8, zorder=4, label=f"certified point: {chosen['policy']}")
    evicted = [c for c in candidates if c["format"] is None]
    labelled = [c for c in candidates if c["certified"] or kind(c) == "tokens × precision"]
    if evicted:
        labelled.append(min(evicted, key=lambda c: (c["violations"] / c["n"], c["peak_kv_bytes"])))
    # every token kept (x = 1): labels in a column to the right; the others to their left; each column
    # spread upwards so that no two labels overlap
    for column in ([c for c in labelled if c["kv_peak"] >= 0.95], [c for c in labelled if c["kv_peak"] < 0.95]):
        last = -1.0
        for c in sorted(column, key=lambda c: c["peak_kv_bytes"]):
            y = last = max(c["peak_kv_bytes"], last + 0.04)
            right = c["kv_peak"] >= 0.95
            ax.annotate(f"{c['policy']} ({c['violations']}/{c['n']})", (c["kv_peak"], c["peak_kv_bytes"]),
                        xytext=(1.04 if right else c["kv_peak"] - 0.05, y), textcoords="data", fontsize=7.5,
                        ha="left" if right else "right", va="center",
                        arrowprops={"arrowstyle": "-", "color": "#555555", "lw": 0.6})
    ax.set_xlim(0, 1.45)
    ax.set_xticks([0, 0.2, 0.4, 0.6, 0.8, 1.0])
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("token peak share (mean kv_peak): the share of a 16-bit budget spent on tokens")
    ax.set_ylabel("peak bytes over a 16-bit full cache (mean kv_peak_bytes)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7.5, loc="upper left", frameon=False)
    fig.tight_layout()
    return save_figure(fig, path)


def _shown(path: Path) -> str:
    """The contract's path relative to the repository when inside it."""
    path = path.resolve()
    return path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)


def main(argv: list[str] | None = None) -> None:
    from certkv.contract.loading import load_contract

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--contract", default=str(ROOT / "contracts" / "embedded_long.yaml"))
    parser.add_argument("--timing-requests", type=int, default=6)
    parser.add_argument("--heldout-work", default="/work/runs/embedded_long_heldout",
                        help="the held-out copy of the contract and its store (outside the contract's store; resumable)")
    parser.add_argument("--figure", default=str(FIGURE))
    parser.add_argument("--out", default=str(OUT))
    args = parser.parse_args(argv)
    contract = load_contract(args.contract)
    rows = _rows(contract)
    references = {r.id: r.answers for r in contract.load_requests()}
    point_path = contract.resolved_store_path() / "operating_point.json"
    point = json.loads(point_path.read_text())
    precision = tokens_precision(contract, rows, point_path)
    chosen = chosen_point(point, rows)
    task, candidates = next(iter(precision.items()))  # one figure: the first task's (this contract has one)
    bytes_figure(candidates, chosen, Path(args.figure), f"{_shown(Path(args.contract))}, task {task}: the "
                 f"certification split (ε = {contract.risk:g}, δ = {1 - contract.confidence:g})")
    result = {
        "contract": _shown(Path(args.contract)),
        "utility": contract.utility, "tolerance": contract.tolerance, "risk": contract.risk,
        "confidence": contract.confidence, "kv_cost": contract.cost_measure,
        "max_new_tokens": contract.protocol.max_new_tokens, "seed": contract.requests.seed,
        "pilot": point["pilot"]["share"] if point.get("pilot") else None,
        "answer_tokens": float(np.mean([len(r["answer"].split()) for r in rows if r["policy"] == "full"])),
        "policies": policy_table(contract, rows, references),
        "tokens_precision": precision,
        "figure": _shown(Path(args.figure)),
        "chosen": chosen,
        "heldout": heldout(Path(args.contract), point, Path(args.heldout_work)),
        "recompute": recompute_gate(contract, rows, point),
        "timing": timing(contract, args.timing_requests),
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
