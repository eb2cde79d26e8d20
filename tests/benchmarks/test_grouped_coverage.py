"""The grouped-coverage benchmark on a small synthetic clustered table: it runs, checks itself against
certkv.certify, shows the naive bound's shortfall, and its docs section renders from what it wrote."""

from __future__ import annotations

import json
import math

import benchmarks_doc
import grouped_coverage


def test_grouped_coverage_on_a_synthetic_clustered_table(tmp_path):
    out = tmp_path / "grouped_coverage.json"
    assert grouped_coverage.main(["--synthetic", "--contexts", "300", "--resamples", "250", "--out", str(out)]) == 0
    data = json.loads(out.read_text(encoding="utf-8"))
    clustered, repaired = data["tables"]["clustered"], data["tables"]["repaired"]
    slack = 3 * math.sqrt(0.05 * 0.95 / 250)
    # Questions of a context fail together: the naive bound covers less than its target; the grouped ones do.
    assert clustered["readings"]["naive"]["worst_coverage"] < 0.95 - slack
    for measure in ("per_question", "per_question+betting", "per_context", "per_context+betting", "any_question"):
        assert clustered["readings"][measure]["worst_coverage"] >= 0.95 - slack
    # Questions re-paired at random are nearly independent: grouping costs little KV there.
    whole = repaired["certified"]
    for reading in ("per_question", "per_question+betting"):
        assert abs(whole[reading]["mean_kv_retained"] - whole["naive"]["mean_kv_retained"]) <= 0.1
    section = benchmarks_doc.grouped_coverage(data)
    assert section.startswith("## Grouped certificates") and "--synthetic" in section
    assert f"{data['resamples']} draws" in section and "`synthetic@0.20`" in section and "per_context (betting)" in section
