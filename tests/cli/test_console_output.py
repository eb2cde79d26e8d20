"""Console output in 80 columns without a TTY: `certkv certify`, `certkv validate`, `certkv calibrate`.

Run as a user would in CI (a fresh interpreter, stdout captured, so no TTY, and COLUMNS=80): no
line may exceed 80 characters, nothing may be ellipsised (a bound cut to ``0.0…`` is worse than
none), and the numbers printed must be the operating point's (or the validation's, or the
store's). The certify store has the demo contract's shape: 4 presses × 9 retentions with a gate
grid, i.e. 24 sequences and 216 candidates with names up to 32 characters.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import yaml
from conftest import run_cli

from certkv.calibration.store import CalibrationStore
from certkv.contract.loading import load_contract
from certkv.contract.spec import candidates

WIDTH = 80
RETENTIONS = [0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1]
CONTRACT = {
    "name": "consoledemo",
    "requests": {"source": "builtin:demo", "limit": 400},
    "utility": "exact_match",
    "tolerance": 0.0,
    "risk": 0.1,
    "confidence": 0.95,
    "policies": [{"press": p, "kv_retained": RETENTIONS} for p in ("snapkv", "streaming_llm", "knorm", "probabilistic")],
    "gate": {"agreement_drop": [-0.043, -0.033, -0.019], "certificate": [1.7, 1.9]},
    "store": "store",
}
#: Violation rate at retention kv of each press on requests whose agreement drop is negative (the
#: others never break): snapkv certifies a few candidates, knorm none, the rest in between.
SLOPE = {"snapkv": 0.35, "streaming_llm": 0.6, "knorm": 3.0, "probabilistic": 0.5}


def build_gated_store(folder: Path, n: int = 400, seed: int = 5) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "contract.yaml"
    path.write_text(yaml.safe_dump(CONTRACT, sort_keys=False), encoding="utf-8")
    contract = load_contract(path)
    rng = np.random.default_rng(seed)
    with CalibrationStore.open(contract.resolved_store_path(), contract) as store:
        for i in range(n):
            drop = float(rng.uniform(-0.1, 0.1))
            task = ("needle", "counting", "multi_hop")[i % 3]
            records = [dict(policy="full", task=task, press=None, kv_retained=1.0, kv_retained_actual=1.0, utility=1.0,
                            utility_full=1.0, loss=0.0, answer="a", agreement_drop=drop, certificate_max=None)]
            for c in candidates(contract):
                rate = min(1.0, SLOPE[c.press] * (1.0 - c.kv_retained)) if drop < 0 else 0.0
                bad = rng.random() < 2 * rate
                cert = float(rng.uniform(1.5, 2.1)) if c.press == "probabilistic" else None
                records.append(dict(policy=c.policy, task=task, press=c.press, kv_retained=c.kv_retained,
                                    kv_retained_actual=round(c.kv_retained - 0.003, 6), utility=0.0 if bad else 1.0,
                                    utility_full=1.0, loss=1.0 if bad else 0.0, answer="b" if bad else "a",
                                    agreement_drop=drop, certificate_max=cert))
            store.write_request(f"r{i:04d}", records)
    return path


@pytest.fixture(scope="module")
def gated_contract(tmp_path_factory) -> Path:
    return build_gated_store(tmp_path_factory.mktemp("console"))


@pytest.fixture(autouse=True)
def narrow_console(monkeypatch):
    monkeypatch.setenv("COLUMNS", str(WIDTH))
    monkeypatch.delenv("FORCE_COLOR", raising=False)
    monkeypatch.delenv("TTY_COMPATIBLE", raising=False)


def assert_fits(out: str, width: int = WIDTH) -> list[str]:
    """Every line within `width`, no ellipsis; returns the lines."""
    lines = out.splitlines()
    assert lines, "nothing printed"
    too_long = [line for line in lines if len(line) > width]
    assert not too_long, f"{len(too_long)} lines over {width} columns, e.g. {too_long[0]!r}"
    assert "…" not in out, out
    return lines


def joined(out: str) -> str:
    return " ".join(out.split())


def certify(contract: Path, *args: str) -> tuple[str, dict]:
    target = contract.parent / f"op{'_'.join(args)}.json"
    res = run_cli("certify", str(contract), "-o", str(target), *args)
    assert res.returncode == 0, res.stderr
    return res.stdout, json.loads(target.read_text())


def by_sequence(op: dict) -> list[list[dict]]:
    seqs: list[list[dict]] = [[] for _ in op["sequences"]]
    for c in op["candidates"]:
        seqs[c["sequence"]].append(c)
    return [sorted(s, key=lambda c: c["position"]) for s in seqs]


def retention_label(policy: str) -> str:
    """``@0.50`` of ``snapkv@0.50+drop-0.043``: how a sequence row names its candidates."""
    return "@" + re.match(r"[^@]+@([0-9.]+)", policy).group(1)


# ----------------------------------------------------------------------------- certify


def test_certify_prints_one_row_per_sequence_within_80_columns(gated_contract):
    out, op = certify(gated_contract)
    lines = assert_fits(out)
    assert len(op["candidates"]) == 216 and len(op["sequences"]) == 24
    assert max(len(c["policy"]) for c in op["candidates"]) == 37  # probabilistic@0.90+drop-0.043+cert1.7
    rows = {}
    for line in lines:
        tokens = line.split()
        if len(tokens) >= 7 and tokens[0].isdigit() and re.fullmatch(r"\d+/\d+", tokens[2]):
            rows[int(tokens[0])] = tokens
    assert sorted(rows) == list(range(24)), "one row per sequence"
    eps = op["contract"]["risk"]
    for seq, cands in zip(op["sequences"], by_sequence(op)):
        tokens = rows[seq["index"]]
        stem = re.sub(r"@[0-9.]+", "", cands[0]["policy"])
        assert tokens[1] == stem
        assert tokens[2] == f"{seq['certified']}/{len(seq['policies'])}"
        certified = [c for c in cands if c["certified"]]
        best = tokens[3:-3]
        if certified:
            want = min(certified, key=lambda c: (round(c["mean_kv_retained"], 12), c["violations"], c["position"]))
            assert best[0] == retention_label(want["policy"])
            assert (best[1:] == ["★"]) == (want["policy"] == op["policy"] and not op["fallback"])
        else:
            assert best == ["—"]
        if seq["stopped_at"] is None:
            assert tokens[-3:] == ["—", "—", "—"]
            continue
        stop = cands[seq["stopped_at"]]
        assert tokens[-3] == retention_label(stop["policy"]) and stop["policy"] == seq["stopped_policy"]
        assert tokens[-2] == f"{stop['violations']}/{stop['n']}"
        assert float(tokens[-1].rstrip("*")) == pytest.approx(stop["risk_upper_bound"], rel=5e-4)
        assert stop["risk_upper_bound"] > eps
    # some sequences certify, some stop at once, and the choice is marked
    assert any(s["certified"] for s in op["sequences"]) and any(s["certified"] == 0 for s in op["sequences"])
    text = joined(out)
    assert not op["fallback"] and "★" in out
    assert f"Chosen: {op['policy']} (press {op['press']}" in text
    assert f"{op['violations']}/{op['n']} violations, risk upper bound {op['risk_upper_bound']:.4g}" in text
    assert f"mean memory {op['mean_kv_retained']:.3f}" in text
    assert "All 216 candidates: `certkv certify --wide`" in text
    # nothing cut: the guarantee and every note are there in full
    assert " ".join(op["guarantee"].split()) in text
    for note in op["notes"]:
        assert " ".join(note.split()) in text


def test_certify_per_task_rows_are_the_operating_points(gated_contract):
    out, op = certify(gated_contract)
    printed = {}
    for line in out.splitlines():
        tokens = line.split()
        if tokens and tokens[0] in op["per_task"]:
            printed[tokens[0]] = tokens
    assert set(printed) == set(op["per_task"]) == {"needle", "counting", "multi_hop"}
    for task, b in op["per_task"].items():
        tokens = printed[task]
        assert tokens[1:4] == [str(b["n"]), str(b["violations"]), f"{b['rate']:.4f}"]
        assert " ".join(tokens[4:]) == ("above ε" if b["exceeds_risk"] else "≤ ε")


def test_certify_wide_prints_every_candidate_uncut(gated_contract):
    out, op = certify(gated_contract, "--wide")
    assert "…" not in out
    rows = {}
    for line in out.splitlines():
        tokens = line.split()
        if len(tokens) >= 11 and tokens[0].isdigit() and "@" in tokens[1]:
            rows[tokens[1]] = tokens
    assert set(rows) == {c["policy"] for c in op["candidates"]}
    for c in op["candidates"]:
        tokens = [t for t in rows[c["policy"]] if t != "★"]
        assert int(tokens[0]) == c["sequence"]
        assert tokens[2:6] == [str(c["n"]), str(c["violations"]), f"{c['empirical_risk']:.4f}",
                               f"{c['risk_upper_bound']:.4f}"]
        assert float(tokens[6]) == pytest.approx(c["p_value"], rel=5e-3)
        assert float(tokens[7]) == pytest.approx(c["level"], rel=5e-3)
        assert float(tokens[8]) == pytest.approx(c["mean_kv_retained"], abs=5e-4)
        status = " ".join(tokens[10:])
        assert (status == "certified") == c["certified"]
    text = joined(out)
    assert f"Chosen: {op['policy']}" in text and " ".join(op["guarantee"].split()) in text
    assert "stopped at snapkv@" in text  # the per-sequence sentences


@pytest.mark.parametrize("width", [60, 40])
def test_certify_on_narrower_consoles_folds_and_never_cuts(gated_contract, monkeypatch, width):
    monkeypatch.setenv("COLUMNS", str(width))
    out, op = certify(gated_contract)
    text = joined(out)
    assert_fits(out.replace(str(gated_contract.parent), "<dir>"), width)  # a path is never broken
    assert " ".join(op["guarantee"].split()) in text
    assert f"{op['violations']}/{op['n']} violations, risk upper bound {op['risk_upper_bound']:.4g}" in text


def test_certify_fallback_within_80_columns(gated_contract, tmp_path):
    table = tmp_path / "bad.csv"
    contract = load_contract(gated_contract)
    with table.open("w", encoding="utf-8") as fh:
        fh.write("request_id,policy,kv_retained,loss,agreement_drop,certificate_max\n")
        for i in range(40):
            for c in candidates(contract):
                cert = "2.0" if c.press == "probabilistic" else ""
                fh.write(f"q{i},{c.policy},{c.kv_retained},{float(i % 2)},0.05,{cert}\n")
    target = tmp_path / "fallback.json"
    # relative paths, as a user types them: a path is printed whole, never broken, however long
    res = run_cli("certify", str(gated_contract), "--records", table.name, "-o", target.name, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert_fits(res.stdout)
    op = json.loads(target.read_text())
    assert op["fallback"] and "Fallback: full cache (fallback)" in joined(res.stdout)
    assert " ".join(op["reason"].split()) in joined(res.stdout)


# ----------------------------------------------------------------------------- validate


def test_validate_within_80_columns_shows_the_results_numbers(gated_contract, tmp_path):
    target = tmp_path / "validation.json"
    res = run_cli("validate", str(gated_contract), "--splits", "60", "--seed", "4", "-o", target.name, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert_fits(res.stdout)
    data = json.loads(target.read_text())
    labels = {"certkv": "certkv (certified)", "empirical_thresholding": "empirical thresholding"}
    for method, m in data["methods"].items():
        line = next(line for line in res.stdout.splitlines() if line.startswith(labels[method] + " "))
        tokens = line[len(labels[method]):].split()
        assert tokens == [f"{100 * m['exceed_fraction']:.1f}%", f"({m['exceed_count']})",
                          f"{100 * m['exceed_ci_low']:.1f}–{100 * m['exceed_ci_high']:.1f}%",
                          f"{m['mean_kv_retained']:.3f}", f"{100 * m['fallback_share']:.1f}%"]
        top = max(m["chosen"].items(), key=lambda kv: kv[1])
        assert f"most chosen by {labels[method]}: {top[0]} ({100 * top[1] / 60:.0f}%)" in joined(res.stdout)
    assert f"60 splits of {data['n_requests']} requests" in res.stdout


# ----------------------------------------------------------------------------- calibrate


def test_calibration_summary_within_80_columns(tmp_path):
    """A real (tiny) calibration on the embedded model, with policy names long enough that the
    old table cut them (and its numbers) at 80 columns."""
    label = "knorm_scored_adaptive_heads"  # 32 characters with its retention: the old table cut it
    contract = {
        "name": "consolecal", "model": "embedded", "requests": {"source": "builtin:demo", "limit": 3},
        "protocol": {"max_new_tokens": 8, "device": "cpu"}, "utility": "exact_match", "tolerance": 0.0,
        "risk": 0.2, "confidence": 0.9, "store": "store",
        "policies": [{"press": "streaming_llm", "kv_retained": [0.5]},
                     {"press": "adakv", "press_kwargs": {"press": "knorm"}, "label": label, "kv_retained": [0.5, 0.25]}],
    }
    (tmp_path / "contract.yaml").write_text(yaml.safe_dump(contract, sort_keys=False), encoding="utf-8")
    res = run_cli("calibrate", "contract.yaml", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert "…" not in res.stderr
    # The summary: from its title line to the line that says what this run did. (Warnings about
    # tasks, printed after it by the calibration itself, are sentences, not tables.)
    lines = res.stderr.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("per policy: mean utility"))
    last = next(i for i, line in enumerate(lines) if "skipped in the store)." in line)
    summary = assert_fits("\n".join(lines[first:last + 1]))
    with CalibrationStore.read(tmp_path / "store") as store:
        records = store.records()
    for policy in ["full", "streaming_llm@0.50", f"{label}@0.50", f"{label}@0.25"]:
        mine = [r for r in records if r["policy"] == policy]
        k = sum(r["loss"] > 0.0 for r in mine)
        line = next(line for line in summary if line.split()[:1] == [policy])
        assert line.split()[1:6] == [str(len(mine)), f"{np.mean([r['utility'] for r in mine]):.3f}", str(k),
                                     f"{k / len(mine):.3f}", f"{np.mean([r['kv_retained_actual'] for r in mine]):.3f}"]
    assert "3 requests calibrated now" in joined(res.stderr)
