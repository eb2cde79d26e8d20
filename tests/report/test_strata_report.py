"""A stratified certificate on the console, in validation and in the report, beside its pooled comparison.

The records are test_strata's: an "easy" task that certifies compression, a "hard" one where
nothing certifies and a "tiny" one too small to certify anything, so the output must show one
stratum chosen and two fallbacks with their reasons. The pooled comparison (the same contract with
its strata removed) must equal what the certifier says of that spec, be labelled as not deployed,
and never reach the operating point file. Console output must fit 80 columns uncut, as everywhere.
"""

from __future__ import annotations

import csv
import html
import io
import json
import re
from pathlib import Path

import pytest
import yaml
from conftest import run_cli, run_main
from test_console_output import assert_fits, joined
from test_strata import CONTRACT, strata_rows

from certkv.calibration.certification import certify_contract_with_comparison, load_records, pooled_comparison
from certkv.contract.loading import load_contract
from certkv.contract.spec import certification_spec
from certkv.core.certify import certify

COLUMNS = ("request_id", "task", "policy", "kv_retained", "loss", "context_tokens")


def write_case(folder: Path, **changes) -> tuple[Path, Path]:
    """The stratified contract (changed by `changes`) and its loss table, in `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    contract = folder / "contract.yaml"
    contract.write_text(yaml.safe_dump({**CONTRACT, **changes}, sort_keys=False), encoding="utf-8")
    table = folder / "losses.csv"
    with table.open("w", encoding="utf-8", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=COLUMNS, extrasaction="ignore")
        writer.writeheader()
        for row in strata_rows():
            writer.writerow({k: row.get(k, "") for k in COLUMNS})
    return contract, table


@pytest.fixture(scope="module")
def case(tmp_path_factory) -> tuple[Path, Path]:
    return write_case(tmp_path_factory.mktemp("strata_report"))


@pytest.fixture(autouse=True)
def narrow_console(monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    monkeypatch.delenv("FORCE_COLOR", raising=False)
    monkeypatch.delenv("TTY_COMPATIBLE", raising=False)


def run_certify(contract: Path, table: Path, *args: str) -> tuple[str, dict]:
    target = contract.parent / f"op{'_'.join(args)}.json"
    res = run_cli("certify", str(contract), "--records", str(table), "-o", str(target), *args)
    assert res.returncode == 0, res.stderr
    return res.stdout, json.loads(target.read_text())


def expected_pooled(contract: Path, table: Path):
    """`certify` of the contract's spec without strata, straight from the core."""
    loaded = load_contract(contract)
    spec = certification_spec(loaded).model_copy(update={"strata": None})
    return certify(load_records(loaded, table).table, spec)


def row_of(out: str, first: str) -> list[str]:
    return next(line.split() for line in out.splitlines() if line.split()[:1] == [first])


# ----------------------------------------------------------------------------- the pooled comparison


def test_the_pooled_comparison_is_certify_without_strata(case):
    contract, table = case
    loaded = load_contract(contract)
    evidence, op, pooled = certify_contract_with_comparison(loaded, table)
    want = expected_pooled(contract, table)
    assert op.is_stratified and not pooled.is_stratified
    assert (pooled.policy, pooled.n, pooled.violations, pooled.mean_kv_retained) == (
        want.policy, want.n, want.violations, want.mean_kv_retained)
    assert [c.model_dump() for c in pooled.candidates] == [c.model_dump() for c in want.candidates]
    assert "comparison only, not deployed" in pooled.notes[0]
    plain, _ = write_case(contract.parent / "plain", strata=None)
    assert pooled_comparison(load_contract(plain), evidence) is None  # nothing to compare a pooled contract with


# ----------------------------------------------------------------------------- certify


def test_stratified_certify_prints_a_row_per_stratum_within_80_columns(case):
    contract, table = case
    out, op = run_certify(*case)
    assert_fits(out.replace(str(contract.parent), "<dir>"))  # a path is never broken
    assert "strata" in op and "pooled" not in json.dumps(op["notes"])  # the file holds the contract's point only
    entries = op["strata"]["entries"]
    assert sorted(entries) == ["easy", "hard", "tiny"]
    for name, e in entries.items():
        tokens = row_of(out, name)
        assert tokens[1] == str(e["n"])
        assert tokens[2] == ("full" if e["fallback"] else e["policy"])
        assert tokens[4:7] == [str(e["violations"]), f"{e['risk_upper_bound']:.4g}", f"{e['mean_kv_retained']:.3f}"]
    assert not entries["easy"]["fallback"] and row_of(out, "easy")[-1] == "—"
    assert " ".join(row_of(out, "hard")[7:]) == "none certified"
    assert " ".join(row_of(out, "tiny")[7:]) == "too small"
    text = joined(out)
    for name in ("hard", "tiny"):  # the whole reason, in the notes
        assert " ".join(entries[name]["reason"].split()) in text
    assert f"pooled mean KV retained {op['mean_kv_retained']:.3f} over the {op['n']} certification requests" in text
    assert " ".join(op["guarantee"].split()) in text and "each on its own at confidence 0.95" in text
    assert "Coverage: task easy, hard, tiny (a request must name one); contexts of 200-599 tokens widened by 0.25" \
        in text


def test_stratified_certify_shows_the_pooled_comparison_side_by_side(case):
    out, op = run_certify(*case)
    want = expected_pooled(*case)
    block = out.split("stratified vs pooled:\n", 1)[1].splitlines()
    stratified, pooled = row_of("\n".join(block), "stratified"), row_of("\n".join(block), "pooled")
    assert " ".join(stratified[1:]) == (f"per task (3 strata) {op['mean_kv_retained']:.3f} "
                                        f"{op['violations']}/{op['n']} yes (the contract's)")
    policy = "full cache (fallback)" if want.fallback else want.policy
    assert " ".join(pooled[1:]) == (f"{policy} {want.mean_kv_retained:.3f} {want.violations}/{want.n} "
                                    "no: comparison only")
    assert "never deployed" in joined(out)


def test_stratified_certify_wide_prints_each_strata_candidates(case):
    out, op = run_certify(*case, "--wide")
    assert "…" not in out
    for name, e in op["strata"]["entries"].items():
        assert re.search(rf"task {name}: {e['n']} certification requests", out), name
        for c in e["candidates"]:
            assert re.search(rf"^\s*0\s+{re.escape(c['policy'])}( ★)?\s+{c['n']}\s+{c['violations']}\s", out, re.M)
    assert f"Chosen: {op['strata']['entries']['easy']['policy']}" in joined(out)


def test_a_pooled_certificate_gains_one_coverage_line(tmp_path):
    contract, table = write_case(tmp_path, strata=None)
    out, op = run_certify(contract, table)
    assert_fits(out.replace(str(contract.parent), "<dir>"))
    assert [line for line in out.splitlines() if line.startswith("Coverage:")] == [
        next(line for line in out.splitlines() if line.startswith("Coverage:"))]
    assert "stratified vs pooled" not in out and "Coverage: task easy, hard, tiny; contexts" in joined(out)


# ----------------------------------------------------------------------------- validate


def test_a_stratified_validation_prints_each_stratum(case):
    from rich.console import Console

    from certkv.core.validation import validate
    from certkv.report.console import print_validation

    contract, table = case
    loaded = load_contract(contract)
    result = validate(load_records(loaded, table).table, certification_spec(loaded), n_splits=20, seed=1)
    assert result.strata is not None
    buffer = io.StringIO()
    print_validation(result, Console(file=buffer, width=80))
    out = buffer.getvalue()
    assert_fits(out)
    assert out.startswith(f"all 3 task strata together, 20 splits of {result.n_requests} requests")
    for name, sub in result.strata.items():
        assert f"task {name}: {sub.n_requests} requests, {sub.n_calibration} calibrate" in out
        m = sub.methods["certkv"]
        assert f"{100 * m.exceed_fraction:.1f}% ({m.exceed_count})" in out
    assert "for each task stratum" in joined(out)


# ----------------------------------------------------------------------------- report


def test_the_report_has_a_panel_per_stratum_and_the_comparison(case, tmp_path):
    contract, table = case
    out = tmp_path / "rep"
    assert run_main("report", str(contract), "--records", str(table), "-o", str(out), "--splits", "20") == 0
    page = (out / "report.html").read_text(encoding="utf-8")
    text = html.unescape(" ".join(re.sub(r"<[^>]+>", " ", page).split()))
    _, op, _ = certify_contract_with_comparison(load_contract(contract), table)
    want = expected_pooled(contract, table)
    for name, e in op.strata.entries.items():
        assert f"task {name}: {e.n} certification requests" in text
    assert (out / "risk_vs_kv_easy.png").is_file() and (out / "per_task_hard.png").is_file()
    assert not (out / "risk_vs_kv_tiny.png").exists()  # too small: nothing tested, nothing drawn
    assert "No candidate was tested: task 'tiny' is too small to certify" in text
    policy = "full cache (fallback)" if want.fallback else want.policy
    assert f"pooled {policy} {want.mean_kv_retained:.3f} {want.violations}/{want.n} no: comparison only" in text
    assert f"stratified per task (3 strata) {op.mean_kv_retained:.3f}" in text
    assert "Coverage: task easy, hard, tiny" in text and "too small" in text and "none certified" in text
    assert "Each stratum on its own splits" in text


def test_a_pooled_report_is_as_before_plus_coverage(tmp_path):
    from test_report import FIGURES

    contract, table = write_case(tmp_path, strata=None)
    out = tmp_path / "rep"
    assert run_main("report", str(contract), "--records", str(table), "-o", str(out), "--splits", "20") == 0
    assert sorted(p.name for p in out.glob("*.png")) == sorted(FIGURES)
    text = " ".join(re.sub(r"<[^>]+>", " ", (out / "report.html").read_text(encoding="utf-8")).split())
    assert text.count("Coverage:") == 1 and "Stratified vs pooled" not in text


# ----------------------------------------------------------------------------- demo


def test_the_demo_says_which_certificate_is_deployed(case):
    from certkv.report.text import deployed_text

    _, op, pooled = certify_contract_with_comparison(load_contract(case[0]), case[1])
    line = deployed_text(op, pooled)
    assert line.startswith(f"deployed: the contract's operating point, stratified per task (3 strata), mean KV "
                           f"retained {op.mean_kv_retained:.3f}; pooled comparison (strata removed, not deployed)")
    assert line.endswith(f"mean KV retained {pooled.mean_kv_retained:.3f}")
