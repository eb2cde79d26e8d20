"""Certifying over context groups: the certificate recomputed independently, the refusals, the pilot and the records.

The grouped candidate results are recomputed from the loss rows with plain Python loops and
MAPIE's Hoeffding–Bentkus p-value (or scipy's binomial for any_question), never through
certkv.core.grouped, so a slip in the grouping, the measure or the bound shows up as a mismatch.
"""

from __future__ import annotations

import hashlib
import json
from collections import defaultdict

import numpy as np
import pytest
from mapie.risk_control.methods import compute_hoeffding_bentkus_p_value
from scipy.stats import binom

from certkv.core.binomial import clopper_pearson_upper
from certkv.core.certify import certify, guarantee_sentence
from certkv.core.loss_table import LossTable, read_csv, read_jsonl, records_sha256
from certkv.core.pilot import draw_pilot_groups
from certkv.core.spec import CertificationSpec
from certkv.errors import CertkvError

POLICIES = (("p@0.70", 0.7), ("p@0.30", 0.3))


def clustered_rows(contexts: int = 150, seed: int = 0, task=None) -> list[dict]:
    """Contexts of 1–8 questions; p@0.70 fails rarely and alone, p@0.30 fails whole contexts."""
    rng = np.random.default_rng(seed)
    rows = []
    for c in range(contexts):
        size = int(rng.integers(1, 9))
        whole = rng.random() < 0.04
        for q in range(size):
            rid = f"c{c:03d}q{q}"
            losses = {"p@0.70": float(rng.random() < 0.005), "p@0.30": float(whole)}
            for policy, kv in POLICIES:
                row = {"request_id": rid, "policy": policy, "kv_retained": kv, "loss": losses[policy], "group": f"doc{c:03d}"}
                if task is not None:
                    row["task"] = task(c)
                rows.append(row)
    return rows


def spec_of(**extra) -> CertificationSpec:
    return CertificationSpec(tolerance=0.0, risk=0.1, confidence=0.9, sequences=[["p@0.70", "p@0.30"]], **extra)


def by_context(rows: list[dict], policy: str) -> list[tuple[int, int]]:
    """(violated questions, questions) per context, from the rows themselves."""
    k: dict[str, int] = defaultdict(int)
    n: dict[str, int] = defaultdict(int)
    for row in rows:
        if row["policy"] == policy:
            n[row["group"]] += 1
            k[row["group"]] += row["loss"] > 0
    return [(k[g], n[g]) for g in sorted(n, key=_betting_order)]


def _betting_order(name: str) -> str:
    """The order certify bets in, written out: the salted sha256 of each context's name."""
    return hashlib.sha256(f"certkv-context-order:{name}".encode()).hexdigest()


@pytest.mark.parametrize("measure", ["per_context", "per_question"])
def test_grouped_certificate_recomputed_independently(measure):
    rows = clustered_rows()
    op = certify(LossTable.from_records(rows), spec_of(grouping={"measure": measure, "bound": "hoeffding_bentkus"}))
    for candidate in op.candidates:
        pairs = by_context(rows, candidate.policy)
        big = max(n for _, n in pairs)
        if measure == "per_context":
            values = [k / n for k, n in pairs]
            estimate = sum(values) / len(values)
        else:
            values = [(k + 0.1 * (big - n)) / big for k, n in pairs]
            estimate = sum(k for k, _ in pairs) / sum(n for _, n in pairs)
        expected = compute_hoeffding_bentkus_p_value(np.array([np.mean(values)]), len(pairs), 0.1)[0, 0]
        assert candidate.p_value == pytest.approx(float(expected), rel=1e-9)
        assert candidate.n_contexts == len(pairs) == 150
        assert candidate.grouped_risk == pytest.approx(estimate)
        # Counts stay integers over questions.
        assert candidate.n == sum(n for _, n in pairs) and candidate.violations == sum(k for k, _ in pairs)
        assert (candidate.risk_upper_bound <= 0.1) == candidate.certified  # the bound reports the decision
    assert op.contract.grouping.measure == measure and op.n_contexts == 150
    assert f"certified over 150 contexts of {op.candidates[0].n} requests ({measure}, Hoeffding–Bentkus)" in " ".join(op.notes)


def test_any_question_certificate_is_the_binomial_over_contexts():
    rows = clustered_rows()
    op = certify(LossTable.from_records(rows), spec_of(grouping={"measure": "any_question"}))
    for candidate in op.candidates:
        pairs = by_context(rows, candidate.policy)
        hits = sum(k > 0 for k, _ in pairs)
        assert candidate.p_value == pytest.approx(float(binom.cdf(hits, len(pairs), 0.1)), rel=1e-12)
        assert candidate.risk_upper_bound == pytest.approx(clopper_pearson_upper(hits, len(pairs), 1 - candidate.level))
        assert candidate.grouped_risk == pytest.approx(hits / len(pairs))


def test_whole_context_failures_certify_naively_but_not_grouped():
    # 30 of 150 contexts of 8 questions fail on 7 of them: 210 of 1200 questions (17.5%)
    # but the naive test sees a 17.5% rate on 1200 "independent" requests; at ε = 0.2 it certifies.
    rows = []
    for c in range(150):
        for q in range(8):
            loss = float(c < 30 and q < 7)
            rows.append({"request_id": f"c{c:03d}q{q}", "policy": "p@0.50", "kv_retained": 0.5, "loss": loss, "group": f"d{c}"})
    table = LossTable.from_records(rows)
    base = CertificationSpec(tolerance=0.0, risk=0.2, confidence=0.95, sequences=[["p@0.50"]])
    assert not certify(table, base.model_copy(update={"independent_requests": True})).fallback
    grouped = certify(table, CertificationSpec.parse({**base.model_dump(), "grouping": {"measure": "per_question"}}))
    assert grouped.fallback and "over 150 contexts" in grouped.reason and grouped.n_contexts == 150


def test_shared_contexts_without_grouping_are_refused_in_one_line():
    table = LossTable.from_records(clustered_rows(contexts=20))
    with pytest.raises(CertkvError) as caught:
        certify(table, spec_of())
    message = str(caught.value)
    assert "\n" not in message
    assert "requests share contexts (group 'doc000' has 7 requests: 'c000q0', 'c000q1', 'c000q2' and 4 more)" in message
    assert "set requests.group_by: context in the contract (or request to treat them as independent)" in message
    op = certify(table, spec_of(independent_requests=True))  # the user chose independence
    assert op.n_contexts is None and op.candidates[0].n_contexts is None


def test_grouping_without_groups_is_refused_and_excludes_independence():
    rows = [{"request_id": f"r{i}", "policy": p, "kv_retained": kv, "loss": 0.0} for i in range(10) for p, kv in POLICIES]
    with pytest.raises(CertkvError, match="the records have no group column; recalibrate"):
        certify(LossTable.from_records(rows), spec_of(grouping={}))
    with pytest.raises(CertkvError, match="grouping and independent_requests exclude each other"):
        CertificationSpec.parse(spec_of().model_dump() | {"grouping": {}, "independent_requests": True})


def test_a_context_spanning_two_strata_is_refused():
    rows = clustered_rows(contexts=40, task=lambda c: "qa" if c % 2 else "code")
    for row in rows:
        if row["request_id"] == "c000q0":
            row["task"] = "qa"  # one question of doc000 moves to qa while the rest stay in code
    with pytest.raises(CertkvError, match="group 'doc000' spans task strata 'code' and 'qa'"):
        certify(LossTable.from_records(rows), spec_of(grouping={}, strata={"by": "task"}))


def test_grouped_strata_certify_each_strata_contexts():
    rows = clustered_rows(contexts=300, task=lambda c: "qa" if c % 2 else "code")
    op = certify(LossTable.from_records(rows), spec_of(grouping={}, strata={"by": "task"}))
    entries = op.strata.entries
    assert sorted(entries) == ["code", "qa"] and all(e.n_contexts == 150 for e in entries.values())
    assert op.n_contexts == 300 and "contexts drawn as in calibration" in op.guarantee


def test_the_guarantee_says_what_a_grouped_certificate_covers():
    sentence = guarantee_sentence(spec_of(grouping={"measure": "per_context"}))
    assert "of questions lose more than 0.0 utility, each context weighted equally, contexts drawn as in calibration" in sentence
    assert "of contexts have a question that loses" in guarantee_sentence(spec_of(grouping={"measure": "any_question"}))


def test_the_pilot_takes_whole_contexts_deterministically():
    rows = clustered_rows(contexts=200)
    table = LossTable.from_records(rows)
    spec = spec_of(grouping={}, pilot={"share": 0.25, "seed": 3})
    op = certify(table, spec)
    group_of = dict(zip(table.request_ids, table.groups))
    pilot_groups = {group_of[r] for r in op.pilot.request_ids}
    assert len(pilot_groups) == 50  # round(0.25 · 200) contexts
    assert sum(g in pilot_groups for g in table.groups) == op.pilot.n_pilot  # every question of them
    assert op.n_contexts == 150 and op.n == op.pilot.n_certification
    again = draw_pilot_groups(table.request_ids[::-1], table.groups[::-1], 0.25, 3)
    assert set(again.pilot_ids) == set(op.pilot.request_ids)
    other = draw_pilot_groups(table.request_ids, table.groups, 0.25, 4)
    assert set(other.pilot_ids) != set(op.pilot.request_ids)


def test_group_column_reads_from_every_format_and_follows_the_requests(tmp_path):
    rows = clustered_rows(contexts=5)
    table = LossTable.from_records(rows)
    csv_path, jsonl_path = tmp_path / "t.csv", tmp_path / "t.jsonl"
    header = list(rows[0])
    csv_path.write_text(",".join(header) + "\n" + "".join(",".join(str(r[h]) for h in header) + "\n" for r in rows))
    jsonl_path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert read_csv(csv_path).groups == read_jsonl(jsonl_path).groups == table.groups
    assert table.groups[0] == "doc000"
    kept = table.take_requests([0, 2, 3])
    assert kept.groups == tuple(table.groups[i] for i in (0, 2, 3))


def test_group_column_errors_name_the_request():
    rows = clustered_rows(contexts=3)
    rows[1] = {**rows[1], "group": "other"}  # c000q0's second row disagrees
    with pytest.raises(CertkvError, match="request 'c000q0' has rows with different group values"):
        LossTable.from_records(rows)
    rows = clustered_rows(contexts=3)
    for row in rows:
        if row["request_id"] == "c000q0":
            del row["group"]
    with pytest.raises(CertkvError, match="request 'c000q0' has no group while other requests have one"):
        LossTable.from_records(rows)


def test_groups_are_hashed_only_when_present():
    rows = [{"request_id": f"r{i}", "policy": "p@0.50", "kv_retained": 0.5, "loss": float(i % 3 == 0), "task": "qa"}
            for i in range(6)]
    # The hash certkv gave this table before the group column existed.
    assert records_sha256(LossTable.from_records(rows)) == "219230c610c335fc6711e7365055647bef7f3ff709a076e61c222211df5a431b"
    grouped = [{**r, "group": f"d{i // 2}"} for i, r in enumerate(rows)]
    regrouped = [{**r, "group": f"d{i // 3}"} for i, r in enumerate(rows)]
    hashes = {records_sha256(LossTable.from_records(x)) for x in (rows, grouped, regrouped)}
    assert len(hashes) == 3


def test_a_point_without_grouping_writes_no_grouped_fields():
    rows = [{"request_id": f"r{i}", "policy": p, "kv_retained": kv, "loss": 0.0} for i in range(100) for p, kv in POLICIES]
    plain = certify(LossTable.from_records(rows), spec_of()).to_dict()
    assert "n_contexts" not in plain and "grouping" not in plain["contract"] and "n_contexts" not in plain["candidates"][0]
    grouped = certify(LossTable.from_records(clustered_rows()), spec_of(grouping={})).to_dict()
    assert grouped["n_contexts"] == 150
    assert grouped["contract"]["grouping"] == {"measure": "per_context", "bound": "betting"}  # the default test
    assert grouped["candidates"][0]["grouped_risk"] is not None


def test_grouped_validation_splits_contexts_and_decides_as_certify_does():
    from certkv.core.grouped import Groups, grouped_estimate
    from certkv.core.validation import calibration_masks, run_splits, validate

    table = LossTable.from_records(clustered_rows(contexts=240, seed=1))
    spec = spec_of(grouping={"measure": "per_context"})
    run = run_splits(table, spec, n_splits=6, calibration_fraction=0.5, seed=12)
    assert (run.n_requests, run.n_cal, run.n_test) == (240, 120, 120)  # contexts
    groups = Groups.of(table.groups)
    masks = calibration_masks(np.random.default_rng(12), 6, groups.n_groups, 120)
    outcome = run.outcomes["certkv"]
    for s, mask in enumerate(masks):
        cal = np.flatnonzero(mask[groups.codes] > 0)
        test = np.flatnonzero(mask[groups.codes] == 0)
        op = certify(table.take_requests(cal), spec)
        expected = -1 if op.fallback else run.names.index(op.policy)
        assert outcome.index[s] == expected
        if expected >= 0:
            sub = table.take_requests(test)
            sub_groups = Groups.of(sub.groups)
            flags = sub.loss[sub.index_of(op.policy)] > 0
            measured = grouped_estimate(sub_groups.counts(flags), sub_groups.sizes, "per_context")
            assert outcome.test_risk[s] == pytest.approx(float(measured))
    result = validate(table, spec, n_splits=6, seed=12)
    assert set(outcome.index.tolist()) == {0, 1}  # both candidates chosen on some split: the comparison bites
    assert result.n_calibration == 120 and "n_calibration and n_test count contexts" in result.note


def test_grouped_validation_pools_strata():
    from certkv.core.validation import validate

    rows = clustered_rows(contexts=400, task=lambda c: "qa" if c % 2 else "code")
    result = validate(LossTable.from_records(rows), spec_of(grouping={"measure": "per_question"}, strata={"by": "task"}),
                      n_splits=20, seed=0)
    assert sorted(result.strata) == ["code", "qa"] and result.n_test == 200
    assert len(result.methods["certkv"].test_risks) == 20


def test_gated_candidates_are_derived_per_request_then_grouped():
    from certkv.core.spec import CandidateInfo, GateSettings

    rows = clustered_rows(contexts=150)
    for row in rows:
        row["agreement_drop"] = 0.0 if row["request_id"].startswith("c00") else 0.5  # c000–c009 gated
    gated = "p@0.30+drop0.1"
    info = {gated: CandidateInfo(base_policy="p@0.30", gate=GateSettings(agreement_drop=0.1))}
    spec = CertificationSpec(tolerance=0.0, risk=0.1, confidence=0.9, sequences=[["p@0.70", gated]], candidate_info=info,
                             grouping={"measure": "per_context", "bound": "hoeffding_bentkus"})
    op = certify(LossTable.from_records(rows), spec)
    candidate = op.candidates[1]
    pairs = by_context([r for r in rows if not r["request_id"].startswith("c00")], "p@0.30")
    pairs += [(0, n) for _, n in by_context([r for r in rows if r["request_id"].startswith("c00")], "p@0.30")]
    expected = compute_hoeffding_bentkus_p_value(np.array([np.mean([k / n for k, n in pairs])]), 150, 0.1)[0, 0]
    assert candidate.policy == gated and candidate.n_contexts == 150
    assert candidate.p_value == pytest.approx(float(expected), rel=1e-9)


def test_a_stratum_with_too_few_contexts_falls_back_with_that_reason():
    rows = clustered_rows(contexts=200, task=lambda c: "qa" if c < 180 else "code")  # code: 20 contexts
    op = certify(LossTable.from_records(rows), spec_of(grouping={"bound": "hoeffding_bentkus"}, strata={"by": "task"}))
    code = op.strata.entries["code"]
    assert code.fallback and "20 certification contexts, fewer than the 22 that certifying anything" in code.reason
    op = certify(LossTable.from_records(rows), spec_of(grouping={}, strata={"by": "task"}))  # betting: 35
    assert "20 certification contexts, fewer than the 35 that certifying anything" in op.strata.entries["code"].reason


def test_betting_certificate_recomputed_independently():
    from test_grouped import _betting_by_hand

    rows = clustered_rows()
    op = certify(LossTable.from_records(rows), spec_of(grouping={"measure": "per_context", "bound": "betting"}))
    for candidate in op.candidates:
        pairs = by_context(rows, candidate.policy)  # in the order certify bets in
        assert candidate.p_value == pytest.approx(_betting_by_hand([k / n for k, n in pairs], 0.1), rel=1e-9)
    assert op.contract.grouping.bound == "betting"


def test_betting_validation_decides_as_certify_does():
    from certkv.core.grouped import Groups
    from certkv.core.validation import calibration_masks, run_splits

    table = LossTable.from_records(clustered_rows(contexts=240, seed=1))
    spec = spec_of(grouping={"measure": "per_question", "bound": "betting"})
    run = run_splits(table, spec, n_splits=5, calibration_fraction=0.5, seed=3)
    groups = Groups.of(table.groups)
    masks = calibration_masks(np.random.default_rng(3), 5, groups.n_groups, 120)
    for s, mask in enumerate(masks):
        op = certify(table.take_requests(np.flatnonzero(mask[groups.codes] > 0)), spec)
        assert run.outcomes["certkv"].index[s] == (-1 if op.fallback else run.names.index(op.policy))


def test_betting_does_not_read_contexts_in_an_order_that_follows_their_names():
    """Names that run from easy to hard (a user's ids, or single questions' ``context-<sha>``
    sorting before multi-question draws) must not order the bets: sorted by name, the wealth would
    peak on the easy contexts and certify a candidate whose risk is above ε."""
    rng = np.random.default_rng(11)
    rows = []
    for c in range(450):
        easy = c < 200  # names "a…" never fail; "b…" fail one question in five
        size = 1 if easy else 8
        for q in range(size):
            loss = 0.0 if easy else float(rng.random() < 0.22)
            rows.append({"request_id": f"c{c}q{q}", "policy": "p@0.30", "kv_retained": 0.3, "loss": loss,
                         "group": f"{'a' if easy else 'b'}{c:04d}"})
    table = LossTable.from_records(rows)
    spec = CertificationSpec(tolerance=0.0, risk=0.1, confidence=0.9, sequences=[["p@0.30"]],
                             grouping={"measure": "per_context"})
    op = certify(table, spec)
    assert op.candidates[0].grouped_risk > 0.1 and op.fallback  # risk above ε: nothing is certified
    by_name = sorted({r["group"]: None for r in rows})
    shares = {g: [] for g in by_name}
    for r in rows:
        shares[r["group"]].append(r["loss"] > 0)
    from test_grouped import _betting_by_hand

    assert _betting_by_hand([sum(v) / len(v) for v in shares.values()], 0.1) < 0.1  # name order would have certified


def test_a_stratum_with_too_few_contexts_for_its_pilot_falls_back_instead_of_failing():
    """Grouping, strata and a pilot: a stratum of 2 contexts of 8 questions draws no pilot context at
    a share of 0.25, so it is answered from the full cache, counted in contexts' questions."""
    rows = clustered_rows(contexts=300, task=lambda c: "big" if c >= 2 else "tiny")
    spec = spec_of(grouping={"measure": "per_context"}, strata={"by": "task"}, pilot={"share": 0.25})
    op = certify(LossTable.from_records(rows), spec)
    tiny = op.strata.entries["tiny"]
    assert tiny.fallback and "too small" in tiny.reason
    assert tiny.n == sum(1 for r in rows if r["task"] == "tiny" and r["policy"] == "p@0.70")
