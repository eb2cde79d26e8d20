"""Many questions on one context: the built-in multi_question task and the grouping rule."""

from __future__ import annotations

import json
from collections import Counter

import pytest
from conftest import run_here

from certkv.errors import CertkvError
from certkv.requests.builtin_tasks import QUESTIONS_PER_CONTEXT
from certkv.requests.context_groups import check_grouping, context_groups, group_of
from certkv.requests.request_set import Request, generate_requests


def test_one_draw_asks_distinct_questions_of_one_context():
    requests = generate_requests("multi_question", 40, seed=7)
    by_group: dict[str, list[Request]] = {}
    for r in requests:
        by_group.setdefault(r.group, []).append(r)
    assert len(requests) == 40 and len(by_group) == 5
    for group, asked in by_group.items():
        assert len(asked) == QUESTIONS_PER_CONTEXT
        assert len({r.context for r in asked}) == 1 and len({r.question for r in asked}) == len(asked)
        assert [r.id for r in asked] == [f"{group}-q{i}" for i in range(len(asked))]
        assert all(r.answers[0] in r.context for r in asked)  # every answer is a record of the context
    # draw j depends on (seed, j) only: a longer set extends a shorter one, a cut keeps the first questions
    longer = generate_requests("multi_question", 45, seed=7)
    assert [r.model_dump() for r in longer[:40]] == [r.model_dump() for r in requests]
    assert len(generate_requests("multi_question", 3, seed=7)) == 3


def test_single_question_tasks_are_drawn_as_before():
    """The draw loop gives one request per draw for every other task, so existing request sets keep
    their ids and contents (their stores' digests depend on them)."""
    demo = generate_requests("demo", 30, seed=1)
    assert [r.id for r in demo] == [f"{r.task}-s1-{i:06d}" for i, r in enumerate(demo)]
    assert not any(r.group for r in demo) and "group" not in demo[0].as_record()


def test_groups_follow_the_group_field_else_identical_context_text():
    a = Request(id="a", context="The sky is blue.", question="q1", answers=["x"])
    b = a.model_copy(update={"id": "b", "question": "q2"})
    c = a.model_copy(update={"id": "c", "context": "The sky is blue!"})
    d = c.model_copy(update={"id": "d", "group": "doc-7"})
    assert group_of(a) == group_of(b) != group_of(c) and group_of(d) == "doc-7"
    assert context_groups([a, b, c, d]) == [group_of(a)] * 2 + [group_of(c), "doc-7"]
    assert check_grouping([a, b], "context") == [group_of(a)] * 2 and check_grouping([a, b], "request") is None
    assert check_grouping([a, c], None) is None  # nothing repeats: nothing to say
    with pytest.raises(CertkvError) as info:
        check_grouping([a, c, b], None)
    message = str(info.value)
    assert "\n" not in message and "'a'" in message and "asked 2 times" in message
    assert "requests.group_by: context" in message and "requests.group_by: request" in message


CONTRACT = """\
name: mq
requests:
  source: {source}
  limit: 24
{grouping}utility: exact_match
tolerance: 0.0
risk: 0.05
confidence: 0.95
policies:
  - press: snapkv
    kv_retained: [0.5]
"""


def _contract(tmp_path, source: str, grouping: str = "") -> str:
    path = tmp_path / "c.yaml"
    path.write_text(CONTRACT.format(source=source, grouping=grouping))
    return str(path)


def test_calibrate_refuses_repeated_contexts_without_group_by(tmp_path, capsys):
    """Refused before the model loads, with one line and exit 2: a builtin multi-question source and
    a request file that asks one context twice."""
    result = run_here(capsys, "calibrate", _contract(tmp_path, "builtin:multi_question"))
    assert result.returncode == 2 and "share contexts" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr
    rows = [{"id": f"r{i}", "context": "The magic number for apple is 1234.", "question": f"q{i}", "answers": ["1234"]}
            for i in range(2)]
    (tmp_path / "r.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = run_here(capsys, "calibrate", _contract(tmp_path, "r.jsonl"))
    assert result.returncode == 2 and "the context of request 'r0' is asked 2 times" in result.stderr


def test_group_measure_needs_grouping_by_context_and_unset_keys_leave_the_hash(tmp_path):
    from certkv.contract.loading import load_contract

    bad = _contract(tmp_path, "builtin:multi_question", "  group_by: request\n  group_measure: per_question\n")
    with pytest.raises(CertkvError, match="group_measure applies only with requests.group_by: context"):
        load_contract(bad)
    grouped = load_contract(_contract(tmp_path, "builtin:multi_question", "  group_by: context\n"))
    assert grouped.requests.measure == "per_context"
    assert Counter(context_groups(grouped.load_requests())).most_common(1)[0][1] == QUESTIONS_PER_CONTEXT
    plain = load_contract(_contract(tmp_path, "builtin:multi_question"))
    assert "group_by" not in json.loads(plain.canonical_json())["requests"] and plain.sha256() != grouped.sha256()


def test_the_natural_english_variant_asks_each_needle_with_its_answer_prefix():
    requests = generate_requests("ruler_multi_question", 8, seed=2)
    assert len({r.context for r in requests}) == 1 and len({r.answers[0] for r in requests}) == 8
    for r in requests:
        assert r.answer_prefix.startswith("The special magic number for") and r.answers[0] in r.context
        assert r.group == "ruler_multi_question-s2-000000" and r.task == "ruler_multi_question"


def test_group_by_becomes_the_certification_specs_grouping(tmp_path):
    from certkv.contract.loading import load_contract
    from certkv.contract.spec import certification_spec

    def spec(grouping: str):
        return certification_spec(load_contract(_contract(tmp_path, "builtin:multi_question", grouping)))

    assert spec("  group_by: context\n").grouping.model_dump() == {"measure": "per_context", "bound": "betting"}
    chosen = spec("  group_by: context\n  group_measure: per_question\n  group_bound: hoeffding_bentkus\n")
    assert chosen.grouping.model_dump() == {"measure": "per_question", "bound": "hoeffding_bentkus"}
    independent = spec("  group_by: request\n")
    assert independent.grouping is None and independent.independent_requests
    with pytest.raises(CertkvError, match="group_bound applies to per_context and per_question"):
        load_contract(_contract(tmp_path, "builtin:multi_question", "  group_by: context\n  group_measure: any_question\n"
                                "  group_bound: betting\n"))


def test_a_group_field_cannot_split_one_context_into_several_groups():
    a = Request(id="a", context="The sky is blue.", question="q1", answers=["x"], group="g0")
    b = a.model_copy(update={"id": "b", "group": "g1"})
    c = a.model_copy(update={"id": "c", "group": ""})
    for pair in ([a, b], [a, c]):
        for group_by in (None, "context", "request"):
            with pytest.raises(CertkvError, match="share a context but not a group"):
                check_grouping(pair, group_by)
