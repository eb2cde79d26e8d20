"""Built-in task generators: deterministic, answers present, lengths respected, vocabulary closed."""

from __future__ import annotations

import random
import re

import pytest
from conftest import REPO

from certkv.demo import DEMO_CONTRACT, DEMO_REQUESTS
from certkv.errors import CertkvError
from certkv.requests.builtin_tasks import TASKS
from certkv.requests.request_set import generate_requests, parse_context_length, parse_mix, read_jsonl, write_jsonl
from certkv.requests.vocabulary import count_tokens


def test_same_seed_same_requests_and_prefix_property():
    a = generate_requests("all", 40, seed=7, context_length="64-1024")
    b = generate_requests("all", 60, seed=7, context_length="64-1024")
    assert [r.model_dump() for r in a] == [r.model_dump() for r in b[:40]]
    c = generate_requests("all", 40, seed=8, context_length="64-1024")
    assert [r.context for r in a] != [r.context for r in c]


@pytest.mark.parametrize("task", sorted(TASKS))
@pytest.mark.parametrize("length", [64, 256, 512, 2048])
def test_answers_appear_in_context_and_length_fits(task, length):
    rng = random.Random(f"test/{task}/{length}")
    for _ in range(5):
        sample = TASKS[task](rng, length)
        assert count_tokens(sample.context) <= length
        assert count_tokens(sample.context) >= length - 8, "filler should bring the context close to its length"
        for question, answer in sample.qa:
            for part in answer.split():
                if task == "dilution":
                    assert part[:2] in sample.context and part[2:] in sample.context
                else:
                    assert part in sample.context
            assert "Answer: The " in question and question.endswith((" is", " are"))


def test_variable_tracking_answer_is_chain_root_value():
    rng = random.Random(3)
    sample = TASKS["variable_tracking"](rng, 512)
    assignments = dict(u.removeprefix("VAR ").rstrip(".").split(" = ") for u in sample.units if u.startswith("VAR"))
    for question, answer in sample.qa:
        name = question.split("value of ")[1].split("?")[0]
        while not assignments[name].isdigit():
            name = assignments[name]
        assert assignments[name] == answer


@pytest.mark.parametrize("seed", range(9))
def test_lookalike_multi_key_values_share_prefixes_or_digits(seed):
    """Training's hard contexts: values with one of two 2-digit prefixes, anagrams of four digits, or
    one first and third digit; still one record per key, every answer in the context, within the length."""
    from certkv.requests.builtin_tasks import multi_key

    sample = multi_key(random.Random(seed), 256, lookalike=True)
    values = [answer for _, answer in sample.qa]
    assert len(values) > 5 and all(len(v) == 4 and v.isdigit() for v in values)
    prefixes = {v[:2] for v in values}
    digit_sets = {frozenset(v) for v in values}
    odd_places = {v[0] + v[2] for v in values}
    assert len(prefixes) <= 2 or (len(digit_sets) == 1 and len(next(iter(digit_sets))) == 4) or len(odd_places) == 1
    for _, answer in sample.qa:
        assert f" is {answer}." in sample.context
    assert count_tokens(sample.context) <= 256


def test_request_sets_stay_what_they_were():
    """A request set is reproducible from its command: the same (mix, n, seed, lengths) must keep
    giving the same requests as the code changes (digest of the set as generated at 3398f30)."""
    import hashlib
    import json

    reqs = generate_requests("all", 50, seed=7, context_length="64-2048")
    digest = hashlib.sha256(json.dumps([r.as_record() for r in reqs], sort_keys=True).encode()).hexdigest()
    assert digest == "87627820dba0a14f654e867dcab23915e168a0f9b393aa2b70792fc3355cc52b"


def test_token_count_matches_embedded_tokenizer():
    from transformers import AutoTokenizer

    from certkv.model.loading import EMBEDDED_DIR

    tok = AutoTokenizer.from_pretrained(EMBEDDED_DIR)
    for r in generate_requests("all", 25, seed=1, context_length="64-2048"):
        ids = tok.encode(r.context, add_special_tokens=False)
        assert len(ids) == count_tokens(r.context)
        assert tok.unk_token_id not in ids
        assert tok.unk_token_id not in tok.encode(r.question + " " + r.answers[0], add_special_tokens=False)


def test_mix_and_length_parsing_errors():
    assert parse_mix("multi_key=2,single_needle") == {"multi_key": 2.0, "single_needle": 1.0}
    assert set(parse_mix("demo")) <= set(TASKS)
    with pytest.raises(CertkvError, match="unknown task or mix 'nope'"):
        parse_mix("nope")
    with pytest.raises(CertkvError, match="must be positive"):
        parse_mix("multi_key=0")
    assert parse_context_length("256-512") == (256, 512)
    with pytest.raises(CertkvError, match="within 64-2048"):
        parse_context_length("32")
    with pytest.raises(CertkvError, match="integer or a range"):
        parse_context_length("long")


def test_jsonl_round_trip_and_errors(tmp_path):
    reqs = generate_requests("demo", 5, seed=0, context_length=128)
    path = tmp_path / "r.jsonl"
    assert write_jsonl(reqs, path) == 5
    assert read_jsonl(path) == reqs
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a", "context": "x", "question": "q", "answers": ["1"]}\n{"id": "b", "context": 3}\n')
    with pytest.raises(CertkvError, match=r"bad.jsonl:2: .*question: Field required"):
        read_jsonl(bad)
    bad.write_text("not json\n")
    with pytest.raises(CertkvError, match=r"bad.jsonl:1: not valid JSON"):
        read_jsonl(bad)
    with pytest.raises(CertkvError, match="does not exist"):
        read_jsonl(tmp_path / "missing.jsonl")


def test_demo_mix_holds_exactly_the_tasks_the_shipped_model_answers():
    """DEVELOPERS' rule: the demo mix uses only tasks with full-KV exact match >= 0.90. The measured
    table (benchmarks/embedded_accuracy.py) must belong to the weights that ship, and the shipped
    calibration set must hold only demo-mix tasks."""
    import json

    from certkv.model.loading import model_fingerprint
    from certkv.requests.builtin_tasks import MIXES

    table = json.loads((REPO / "benchmarks" / "results" / "embedded_accuracy.json").read_text())
    assert table["model"] == model_fingerprint("embedded"), "re-run benchmarks/embedded_accuracy.py for these weights"
    assert table["n_per_cell"] >= 500
    # the retrieval tasks only: the long-output task recite has a mix of its own (builtin:recite)
    retrieval = {task: by_length for task, by_length in table["exact_match"].items() if task in TASKS}
    good = {task for task, by_length in retrieval.items() if min(by_length.values()) >= 0.90}
    assert set(MIXES["demo"]) == good
    # `certkv generate --help` says the embedded model fails every other task even with the full cache
    failed = {task for task, by_length in retrieval.items() if max(by_length.values()) <= 0.05}
    assert set(TASKS) - good == failed
    shipped = {json.loads(line)["task"] for line in DEMO_REQUESTS.read_text().splitlines()}
    assert shipped == good


def test_packaged_demo_requests_regenerate_byte_for_byte(tmp_path):
    """The demo contract's comment says how its request file was made; that command must still make
    it, byte for byte (generation is deterministic)."""
    comment = re.search(r"certkv generate builtin:demo --n 1200 --seed (\d+) --context-length 256-512 -o demo.jsonl",
                        DEMO_CONTRACT.read_text())
    assert comment, "demo.yaml no longer says how demo.jsonl was made"
    out = tmp_path / "demo.jsonl"
    write_jsonl(generate_requests("demo", 1200, int(comment.group(1)), "256-512"), out)
    assert out.read_bytes() == DEMO_REQUESTS.read_bytes()
