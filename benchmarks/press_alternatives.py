"""The choices the response-aware presses make where their papers leave one open, each measured once against an alternative.

certkv's response-aware presses name in their docstrings the choices their methods leave open
("Choices the method leaves open, made here: …"). This benchmark measures one alternative per
press, through the press's own knob, on the embedded model and fresh demo-mix requests
(``generate_requests("demo", N, seed=SEED)``, 256–512 tokens; no shipped file or other benchmark
uses that seed):

* LORE-KV: the futures' costs aggregated by their mean (chosen) or their max (the worst future);
  at the default temperature the embedded model draws one future m times (its answers are
  near-certain), where the two coincide, so the pair is measured again at temperature 2.0, where
  the futures differ;
* DeferKV: ``decode_queries: 1, weight: 0.5`` (chosen) against 4 decode queries, and against the
  decode queries alone (``weight: 1.0``);
* ValueDiff: the attention of the last 64 queries (chosen, SnapKV's window) against 16;
* Behavior-Preserving KV: the last position's distribution (``window: 1``, chosen) against the
  mean over the last 4 (question-agnostic protocol only: the query-aware protocol feeds one
  question token after the prefill, so a window above 1 is refused at contract load).

Each (press, setting) is a labelled press entry of one contract per protocol (query-aware for
LORE-KV, DeferKV and ValueDiff, question-agnostic for BP-KV), calibrated at kv_retained 0.9 … 0.1
with the league's gates, and certified **on its own** exactly as ``benchmarks/press_league.py``
certifies a press (its functions are reused): ε = δ = 0.05 on exact match, per task and pooled,
ungated and with the gates; plus the raw violation rate per retention, the share of requests on
which an alternative's answer is right where the setting it is read against is wrong or the
reverse (``answers_differ_by_kv``), and the runtime at kv_retained 0.5 over the full cache's.
Each row is its own certificate: the rows of one press are not a family-wise controlled choice
between its settings.

    python benchmarks/press_alternatives.py --log alt.log      # writes benchmarks/results/press_alternatives.json
    python benchmarks/press_alternatives.py --n 140 --quick    # a smoke run (not a result; the gates' pilot needs n >= 133)

It resumes where it stopped when run again with the same ``--work`` folder.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple

sys.path.insert(0, str(Path(__file__).parent))

import press_league as league  # noqa: E402

RESULTS = Path(__file__).parent / "results"
SEED = 2714
COST_SEED = 2715


class Variant(NamedTuple):
    """One (press, setting) entry: `label` names its policies; `versus` the variant it is read
    against (default: the press's chosen one)."""

    press: str
    setting: str
    chosen: bool
    label: str
    name: str
    kwargs: dict[str, Any]
    protocol: str
    versus: str | None = None


QA, QG = "query_aware", "question_agnostic"
#: The chosen settings are the presses' defaults (checked at start), spelled out so the results file
#: records them. LORE-KV's default temperature draws one future m times on the embedded model (its
#: answers are near-certain), where the mean and the max coincide; the pair at temperature 2.0
#: measures the aggregate where the futures differ.
VARIANTS: tuple[Variant, ...] = (
    Variant("lorekv", "aggregate: mean", True, "lorekv", "lorekv", {"aggregate": "mean"}, QA),
    Variant("lorekv", "aggregate: max", False, "lorekv_max", "lorekv", {"aggregate": "max"}, QA),
    Variant("lorekv", "aggregate: mean, temperature: 2.0", False, "lorekv_t2", "lorekv", {"temperature": 2.0}, QA),
    Variant(
        "lorekv",
        "aggregate: max, temperature: 2.0",
        False,
        "lorekv_t2_max",
        "lorekv",
        {"aggregate": "max", "temperature": 2.0},
        QA,
        versus="lorekv_t2",
    ),
    Variant("deferkv", "decode_queries: 1, weight: 0.5", True, "deferkv", "deferkv", {"decode_queries": 1, "weight": 0.5}, QA),
    Variant("deferkv", "decode_queries: 4", False, "deferkv_q4", "deferkv", {"decode_queries": 4}, QA),
    Variant("deferkv", "weight: 1.0", False, "deferkv_w1", "deferkv", {"weight": 1.0}, QA),
    Variant("value_diff", "window_size: 64", True, "value_diff", "value_diff", {"window_size": 64}, QA),
    Variant("value_diff", "window_size: 16", False, "value_diff_w16", "value_diff", {"window_size": 16}, QA),
    Variant("behavior_preserving", "window: 1", True, "behavior_preserving", "behavior_preserving", {"window": 1}, QG),
    Variant("behavior_preserving", "window: 4", False, "behavior_preserving_w4", "behavior_preserving", {"window": 4}, QG),
)


def check_chosen_are_defaults() -> None:
    """Every chosen setting is what the press does when the setting is not given."""
    from certkv.presses.registry import build_press

    for v in VARIANTS:
        if v.chosen:
            built = build_press(v.name, 0.5, {})
            for key, value in v.kwargs.items():
                default = getattr(built, key)
                if default != value:
                    raise SystemExit(f"{v.press}: the chosen {v.setting!r} is not the press's default ({key}={default!r})")


def versus(v: Variant) -> str | None:
    """The label of the variant `v` is read against (None for a chosen one)."""
    if v.chosen:
        return None
    return v.versus or next(w.label for w in VARIANTS if w.press == v.press and w.chosen)


def answers_differ(table, label: str, other: str) -> dict[str, float]:
    """Per retention, the share of requests whose exact-match violation differs between the two
    variants (0: they answered alike on every request, whatever they kept)."""
    out = {}
    for kv in league.KV:
        a, b = f"{label}@{kv:.2f}", f"{other}@{kv:.2f}"
        if a in table and b in table:
            out[f"{kv:.1f}"] = float(((table.loss[table.index_of(a)] > 0) != (table.loss[table.index_of(b)] > 0)).mean())
    return out


def write_requests(work: Path, protocol: str, n: int) -> None:
    """Write this benchmark's requests where :func:`press_league.calibrate_protocol` reads them (it
    generates the league's own only when the file is missing); a work folder holding other requests
    is refused, so a resumed run never mixes two request sets."""
    from certkv.requests.request_set import generate_requests, write_jsonl

    folder = work / protocol
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "requests.jsonl"
    fresh = folder / "requests.jsonl.new"
    write_jsonl(generate_requests("demo", n, seed=SEED, context_length=league.CONTEXT), fresh)
    if path.exists() and path.read_bytes() != fresh.read_bytes():
        fresh.unlink()
        raise SystemExit(f"{path} holds other requests (another --n or seed): use another --work folder")
    fresh.replace(path)


def settings_of(name: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The press's full settings as built (its defaults included), for the results file."""
    from certkv.presses.registry import build_press

    press = build_press(name, 0.5, kwargs)
    out = {}
    for f in dataclasses.fields(press):
        if f.init and f.name != "compression_ratio":
            value = getattr(press, f.name)
            out[f.name] = value if isinstance(value, (int, float, str, bool)) else repr(value)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=3000, help="fresh demo-mix requests per protocol (the league's: 600)")
    parser.add_argument("--work", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "certkv-press-alternatives")
    parser.add_argument("--cost-requests", type=int, default=30)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--quick", action="store_true", help="a smoke run: writes nothing to benchmarks/results")
    parser.add_argument("--log", type=Path, help="append progress lines here too")
    args = parser.parse_args()

    import torch

    torch.set_num_threads(args.threads)

    def log(line: str) -> None:
        stamped = f"[{time.strftime('%H:%M:%S')}] {line}"
        print(stamped, flush=True)
        if args.log:
            with args.log.open("a") as fh:
                fh.write(stamped + "\n")

    from certkv.calibration.certification import load_records
    from certkv.contract.loading import load_contract
    from certkv.contract.spec import certification_spec

    check_chosen_are_defaults()
    start = time.perf_counter()
    league_results = RESULTS / "press_league.json"
    league_n = json.loads(league_results.read_text())["config"]["n"] if league_results.is_file() else None
    out: dict[str, Any] = {
        "config": {
            "n": args.n,
            "league_n": league_n,
            "seed": SEED,
            "context_length": league.CONTEXT,
            "kv_retained": list(league.KV),
            "risk": league.EPS,
            "delta": league.DELTA,
            "utility": "exact_match",
            "gate": league.GATE,
            "cost_requests": args.cost_requests,
            "cost_seed": COST_SEED,
            "reps": args.reps,
            "torch": torch.__version__,
            "cpu_threads": torch.get_num_threads(),
            "protocols": {v.label: v.protocol for v in VARIANTS},
        },
        "protocols": {},
        "variants": {},
    }
    if league_n is not None and args.n != league_n:
        log(f"n = {args.n} requests per protocol, {'fewer' if args.n < league_n else 'more'} than the league's {league_n}")
    for protocol in dict.fromkeys(v.protocol for v in VARIANTS):
        variants = [v for v in VARIANTS if v.protocol == protocol]
        presses = [(v.label, v.name, v.kwargs) for v in variants]
        query_aware = league.PROTOCOLS[protocol]
        refused = {label: reason for label, name, kwargs in presses if (reason := league.refusal(name, kwargs, query_aware))}
        if refused:
            raise SystemExit(f"{protocol}: refused at contract load: {refused}")
        write_requests(args.work, protocol, args.n)
        path = league.calibrate_protocol(args.work, protocol, presses, args.n, log)
        contract = load_contract(path)
        evidence = load_records(contract)
        spec = certification_spec(contract)
        log(f"{protocol}: measuring the runtime of {len(presses)} variants on {args.cost_requests} requests")
        costs = runtime_costs(presses, query_aware, args.cost_requests, args.reps, log)
        for v in variants:
            result = league.certify_press(evidence, spec, v.label, league.keeps_full_cache(v.name, v.kwargs))
            other = versus(v)
            out["variants"][v.label] = {
                "press": v.press,
                "setting": v.setting,
                "role": "chosen" if v.chosen else "alternative",
                "registry": v.name,
                "press_kwargs": v.kwargs,
                "settings": settings_of(v.name, v.kwargs),
                "protocol": protocol,
                **result,
                "cost_vs_full": costs[v.label],
                "versus": other,
                "answers_differ_by_kv": None if other is None else answers_differ(evidence.table, v.label, other),
            }
            pooled = result["certified"]["pooled"]["kv_retained"]
            rates = result["violation_rate_by_kv"]
            log(
                f"{protocol}: {v.label} ({v.setting}): certified kv {pooled:.1f} pooled, "
                f"violations {rates.get('0.5', float('nan')):.3f} at 0.5, {rates.get('0.3', float('nan')):.3f} at 0.3"
            )
        out["protocols"][protocol] = {"records_sha256": evidence.records_sha256, "n": evidence.table.n_requests}
    out["wall_seconds"] = time.perf_counter() - start
    target = args.work / "press_alternatives.json" if args.quick else RESULTS / "press_alternatives.json"
    target.write_text(json.dumps(out, indent=2) + "\n")
    log(f"wrote {target} ({out['wall_seconds']:.0f} s)")


def runtime_costs(presses, query_aware: bool, n: int, reps: int, log) -> dict[str, float]:
    """:func:`press_league.runtime_costs` on this benchmark's own cost requests (seed COST_SEED)."""
    saved = league.COST_SEED
    league.COST_SEED = COST_SEED
    try:
        return league.runtime_costs(presses, query_aware, n, reps, log)
    finally:
        league.COST_SEED = saved


if __name__ == "__main__":
    main()
