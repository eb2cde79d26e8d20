"""The demo, measured: ``certkv demo`` run as a user runs it, its wall clock and the figures it certifies.

Runs ``certkv demo --dir <temp dir> --quiet`` (``python -m certkv.cli.app``, a fresh store in a
temporary folder, so nothing is resumed) and times it from start to exit. Then reads what it wrote
in ``<dir>/runs/demo/``: ``operating_point.json`` (per task stratum: the certified policy, its
violations in n, the Clopper–Pearson upper bound, its mean KV retained; the deployed point's mean
KV retained), ``validation.json`` (per task: the share of the 1000 random splits whose test half is
over ε for certkv and for empirical thresholding), and the pooled comparison the demo prints beside
the deployed point (the contract certified with its strata removed: never written by the demo, so
certified again here from the demo's store, torch-free, and checked against the demo's printed line).

These are the README's demo figures. Writes ``benchmarks/results/demo.json``, prints a summary and
regenerates docs/benchmarks.md and README.md's generated blocks (``tools/benchmarks_doc.py``)::

    python benchmarks/demo.py            # ~3.5 minutes on 2 idle CPU cores
    python benchmarks/demo.py --no-docs  # the results file only

The load average is recorded before and after, and OMP_NUM_THREADS when set: the wall clock is the
demo's time on an idle machine only when the load before was low (the README says "idle" at a 1-minute
load average of 0.5 or less). On cores shared with other work, torch's default threads wait on each
other at every operation and the demo runs many times slower; ``OMP_NUM_THREADS=1 python
benchmarks/demo.py`` measures it with one thread there, and says so.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULT = REPO / "benchmarks" / "results" / "demo.json"
DEMO_COMMAND = "certkv demo --dir <temp dir> --quiet"


def stratum_figures(entry: dict) -> dict:
    """One task stratum's certificate: what it deploys and the test that certified it."""
    return {
        "policy": entry["policy"],
        "press": entry["press"],
        "kv_retained": entry["kv_retained"],
        "gate": entry["gate"],
        "fallback": entry["fallback"],
        "n": entry["n"],
        "violations": entry["violations"],
        "empirical_risk": entry["empirical_risk"],
        "risk_upper_bound": entry["risk_upper_bound"],
        "mean_kv_retained": entry["mean_kv_retained"],
        "peak_kv_bytes": entry.get("peak_kv_bytes"),
        "mean_kv_bytes": entry.get("mean_kv_bytes"),
        "kv_format": entry.get("kv_format"),
    }


def validation_figures(block: dict) -> dict:
    """The splits of one validation block: per method, the share of splits over ε and its mean KV."""
    return {
        "n_requests": block["n_requests"],
        "n_splits": block["n_splits"],
        **{
            method: {
                "exceed_fraction": m["exceed_fraction"],
                "exceed_count": m["exceed_count"],
                "mean_kv_retained": m["mean_kv_retained"],
                "fallback_share": m["fallback_share"],
            }
            for method, m in block["methods"].items()
        },
    }


def run_demo(folder: Path) -> tuple[float, str]:
    """Run the demo into `folder`; returns its wall seconds and its standard output."""
    command = [sys.executable, "-m", "certkv.cli.app", "demo", "--dir", str(folder), "--quiet"]
    start = time.perf_counter()
    proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
        sys.exit(f"certkv demo exited {proc.returncode}")
    return wall, proc.stdout


def pooled_comparison(folder: Path):
    """The demo's pooled comparison, certified again from its store (the demo prints it, never writes it)."""
    from certkv.calibration.certification import certify_contract_with_comparison
    from certkv.contract.loading import load_contract

    contract_path = folder / "demo.yaml"
    _, op, pooled = certify_contract_with_comparison(load_contract(contract_path), contract_label=str(contract_path))
    return op, pooled


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--no-docs", action="store_true",
                   help="do not regenerate docs/benchmarks.md and README.md's blocks from the new results")
    p.add_argument("--keep", type=Path, default=None,
                   help="run the demo in this new folder and keep it (its store, operating point and report), "
                        "instead of a temporary one")
    args = p.parse_args()
    if args.keep is not None and args.keep.exists():
        sys.exit(f"--keep {args.keep} exists; name a new folder (the demo would resume its store, not time a run)")
    load_before = os.getloadavg()
    with contextlib.ExitStack() as stack:
        tmp = args.keep or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="certkv-demo-bench-")))
        folder = Path(tmp) / "certkv-demo"
        wall, stdout = run_demo(folder)
        load_after = os.getloadavg()
        store = folder / "runs" / "demo"
        point = json.loads((store / "operating_point.json").read_text())
        validation = json.loads((store / "validation.json").read_text())
        op, pooled = pooled_comparison(folder)

    # the demo's last paragraph (wrapped to the console's width): the deployed point and the pooled comparison
    deployed = re.search(r"^deployed: (.*?)\nthe demo contract is", stdout, re.DOTALL | re.MULTILINE)
    deployed_line = " ".join(("deployed: " + deployed.group(1)).split()) if deployed else None
    from certkv.report.text import memory_words

    checks = []
    if abs(op.mean_kv_retained - point["mean_kv_retained"]) > 1e-9:
        checks.append("certifying the demo's store again gave another operating point than the demo wrote")
    if pooled is not None and (deployed_line is None
                               or f"{memory_words(pooled)} {pooled.mean_kv_retained:.3f}" not in deployed_line):
        checks.append(f"the pooled comparison certified here is not the one the demo printed: {deployed_line}")

    strata = point["strata"]["entries"] if point.get("strata") else {}
    result = {
        "benchmark": "demo",
        "command": "python benchmarks/demo.py",
        "demo_command": DEMO_COMMAND,
        "machine": {
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "load_average_1m_before": round(load_before[0], 2),
            "load_average_1m_after": round(load_after[0], 2),
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        },
        "contract": {
            "risk": point["contract"]["risk"],
            "tolerance": point["contract"]["tolerance"],
            "confidence": point["contract"]["confidence"],
            "utility": point["contract"]["utility"],
            "procedure": point["contract"]["procedure"],
            "strata_by": point["strata"]["by"] if point.get("strata") else None,
            "kv_cost": point["contract"].get("kv_cost", "kv_retained"),
        },
        "deployed": {
            "policy": point["policy"],
            "fallback": point["fallback"],
            "n": point["n"],
            "mean_kv_retained": point["mean_kv_retained"],
            "kv_saved": 1.0 - point["mean_kv_retained"],
            "peak_kv_bytes": point.get("peak_kv_bytes"),
            "line": deployed_line,
        },
        "strata": {task: stratum_figures(entry) for task, entry in strata.items()},
        "pooled": None if pooled is None else {
            "policy": pooled.policy,
            "fallback": pooled.fallback,
            "mean_kv_retained": pooled.mean_kv_retained,
            "peak_kv_bytes": pooled.peak_kv_bytes,
            "violations": pooled.violations,
            "n": pooled.n,
            "risk_upper_bound": pooled.risk_upper_bound,
        },
        "validation": {
            "pooled": validation_figures(validation),
            "strata": {task: validation_figures(block) for task, block in (validation.get("strata") or {}).items()},
        },
        "wall_s": wall,
        "problems": checks,
    }
    RESULT.write_text(json.dumps(result, indent=2) + "\n")

    print(f"certkv demo: {wall:.0f} s wall on {os.cpu_count()} CPUs "
          f"(load average {load_before[0]:.1f} before, {load_after[0]:.1f} after)")
    print(f"deployed: mean KV retained {point['mean_kv_retained']:.3f} "
          f"({100 * (1 - point['mean_kv_retained']):.1f}% of the KV cache saved)")
    for task, s in result["strata"].items():
        v = result["validation"]["strata"].get(task, {})
        print(f"  {task}: {s['policy']}, {s['violations']} in {s['n']}, bound {s['risk_upper_bound']:.3f}; "
              f"splits over ε: certkv {v.get('certkv', {}).get('exceed_fraction', float('nan')):.1%}, "
              f"empirical thresholding {v.get('empirical_thresholding', {}).get('exceed_fraction', float('nan')):.1%}")
    if pooled is not None:
        print(f"pooled comparison: {pooled.policy}, mean KV retained {pooled.mean_kv_retained:.3f}")
    print(f"wrote {RESULT.relative_to(REPO)}")
    if not args.no_docs:
        subprocess.run([sys.executable, str(REPO / "tools" / "benchmarks_doc.py")], cwd=REPO, check=True)
    if checks:
        sys.exit("; ".join(checks))


if __name__ == "__main__":
    main()
