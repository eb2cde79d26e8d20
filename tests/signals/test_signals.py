"""The gate signals' one home (certkv.core.signals): everything that names a signal derives from it.

The first tests check the derivations on the package as it is, and that the runtime's Decision,
written out field by field, has one field per declared signal; the last adds a dummy signal to a
copy of the package — one declaration, its recorder and its Decision field, nothing else — and
shows that it flows from calibration into the store, through the loss table and a learned gate's
certification, to the runtime's Decision and gate.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import textwrap
import typing
from pathlib import Path

import numpy as np
from conftest import REPO

from certkv.calibration import store
from certkv.core import gate_features, loss_table, signals


def test_names_are_unique_and_every_derivation_lists_every_signal():
    names = [s.name for s in signals.SIGNALS]
    assert len(names) == len(set(names))
    recorded = [s.name for s in signals.RECORDED]
    assert [c for c in loss_table.OPTIONAL_COLUMNS if c in signals.BY_NAME] == recorded
    assert [c for c in store.COLUMNS if c in signals.BY_NAME] == list(signals.STORE_COLUMNS)
    assert all(f"{name} REAL" in store._SCHEMA for name in signals.STORE_COLUMNS)
    assert set(signals.empty_signals()) == set(names)
    for group in signals.FEATURE_GROUPS:
        assert signals.group_signals(group), group
        for name in gate_features.expand_features([group], n_heads=3):
            assert signals.feature_signal(name).feature_group == group


def test_the_decision_has_one_field_per_signal_and_reads_them_back():
    from certkv.runtime.certified_runtime import Decision

    fields = [f.name for f in dataclasses.fields(Decision)]
    assert all(s.name in fields for s in signals.SIGNALS)
    d = Decision(mode="full", reason=None, policy="p", agreement_drop=0.25)
    measured = {s.name: getattr(d, s.name) for s in signals.SIGNALS}
    assert measured["agreement_drop"] == 0.25 and measured["lookahead_heads"] is None
    assert d.to_dict()["agreement_drop"] == 0.25


def test_the_decision_declares_each_signal_as_a_field_of_its_kind_in_declaration_order():
    """Decision is a plain dataclass: a signal declared without its field (or a field left after
    its signal is gone, or one out of order) fails here, before the runtime's first answer."""
    from certkv.runtime.decision import Decision

    names = [f.name for f in dataclasses.fields(Decision)]
    declared = [s.name for s in signals.SIGNALS]
    head = ["mode", "reason", "policy", "stratum", "gate_kind", "gate_threshold", "certificate_bound"]
    tail = ["escalated", "recomputed_at", "kv_retained", "kv_retained_actual", "detail"]
    assert names == head + declared + tail  # the order of to_dict(), hence of the JSON served and stored
    hints = typing.get_type_hints(Decision)
    defaults = {f.name: f.default for f in dataclasses.fields(Decision)}
    for s in signals.SIGNALS:
        assert hints[s.name] == (list[float] if s.kind == "heads" else float) | None, s.name
        assert defaults[s.name] is None, s.name  # None: not measured
    assert list(Decision(mode="full", reason=None, policy="p").to_dict()) == names


def test_a_loss_table_reads_each_signal_by_its_declaration():
    rows = []
    for i, rid in enumerate(("a", "b")):
        rows.append({"request_id": rid, "policy": "full", "kv_retained": 1.0, "loss": 0.0, "context_tokens": 10 + i,
                     "agreement_drop": 0.1 * i})
        rows.append({"request_id": rid, "policy": "x@0.50", "kv_retained": 0.5, "loss": 0.0, "agreement_drop": 0.1 * i,
                     "confidence_min": 0.5 + i / 10, "lookahead_heads": [0.1, 0.2 + i / 10]})
    t = loss_table.LossTable.from_records(rows)
    np.testing.assert_array_equal(t.context_tokens, [10, 11])  # a request signal: (R,)
    np.testing.assert_array_equal(t.confidence_min, [[0.5, 0.6]])  # a candidate signal: (P, R)
    assert t.lookahead_heads.shape == (1, 2, 2) and t.logprob_mean is None  # absent: None
    assert np.isnan(t.certificate_max).all()  # the first two signals are always there
    assert set(t.signals_of(0)) == {s.name for s in signals.RECORDED}
    cut = t.take_requests([1])
    assert cut.context_tokens.tolist() == [11] and cut.lookahead_heads.shape == (1, 1, 2)


DUMMY = '''    Signal("question_tokens", per="request", kind="scalar", phase="pre_decode",
           recorder="the encoded request", doc="tokens of the encoded question",
           feature_group="question_length", transform="log", compute="certkv.core.signals:question_length"),
'''
DECISION_FIELD = "    question_tokens: float | None = None\n"
RECORDER = '''

def question_length(context_ids, question_ids):
    """The dummy signal's recorder: the question's length in tokens."""
    return len(question_ids)
'''

CHILD = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path

    import certkv
    from certkv.calibration.store import CalibrationStore
    from certkv.cli.app import main
    from certkv.core.gate_features import learned_score
    from certkv.core.loss_table import LossTable
    from certkv.core.operating_point import load_operating_point
    from certkv.model.generation import encode_request
    from certkv.requests.request_set import generate_requests
    from certkv.runtime.certified_runtime import CertifiedRuntime

    work = Path(sys.argv[1])
    out = {"package": certkv.__file__}
    for command in ("calibrate", "certify"):
        sys.argv = ["certkv", command, str(work / "contract.yaml")] + (["--quiet"] if command == "calibrate" else [])
        try:
            main()
        except SystemExit as exc:
            assert not exc.code, (command, exc.code)
    with CalibrationStore.read(work / "store") as store:
        records = store.records()
    full = [r for r in records if r["policy"] == "full"]
    out["stored"] = {r["request_id"]: r.get("question_tokens") for r in full}
    table = LossTable.from_records(records)
    out["table"] = None if table.question_tokens is None else dict(zip(table.request_ids, table.question_tokens.tolist()))
    op = load_operating_point(work / "store" / "operating_point.json")
    learned = [c for c in op.candidates if c.gate is not None and c.gate.learned is not None]
    out["features"] = learned[0].gate.learned.features
    point = op.model_copy(update={"policy": learned[0].policy, "base_policy": "snapkv@0.50", "press": "snapkv",
                                  "kv_retained": 0.5, "gate": learned[0].gate, "fallback": False})
    model, tokenizer = certkv.load_model("embedded")
    runtime = CertifiedRuntime(model, tokenizer, point)
    request = generate_requests("demo", 1, seed=99, context_length="120-200")[0]
    answer = runtime.generate(request.context, request.question)
    d = answer.decision
    n_question = len(encode_request(tokenizer, request.context, request.question).question_ids)
    out.update(decision_value=d.question_tokens, n_question=n_question, learned_score=d.learned_score,
               expected_score=learned_score(point.gate.learned, {"question_tokens": n_question}),
               json_value=d.to_dict()["question_tokens"])
    print(json.dumps(out))
    """
)


def test_a_dummy_signal_flows_from_store_to_certify_to_runtime(tmp_path):
    copy = tmp_path / "pkg" / "certkv"
    shutil.copytree(REPO / "certkv", copy, ignore=shutil.ignore_patterns("__pycache__"))
    decl = copy / "core" / "signals.py"
    text = decl.read_text()
    anchor = '    Signal("learned_score"'
    assert anchor in text
    decl.write_text(text.replace(anchor, DUMMY + anchor, 1) + RECORDER)  # one declaration, one recorder
    decision = copy / "runtime" / "decision.py"
    text = decision.read_text()
    field_anchor = "    learned_score: float | None = None\n"
    assert field_anchor in text
    decision.write_text(text.replace(field_anchor, DECISION_FIELD + field_anchor, 1))  # and its Decision field
    contract = {
        "name": "dummy", "model": "embedded",
        "requests": {"source": "builtin:demo", "context_length": "120-160", "limit": 140, "seed": 5},
        "protocol": {"max_new_tokens": 6, "device": "cpu"},
        "utility": "exact_match", "tolerance": 0.0, "risk": 0.3, "confidence": 0.8,
        "policies": [{"press": "snapkv", "kv_retained": [0.5]}],
        "gate": {"pilot": 0.25, "learned": {"quantiles": [0.5], "features": ["question_length"]}},
        "store": "store",
    }
    (tmp_path / "contract.yaml").write_text(json.dumps(contract))
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    env = dict(os.environ, PYTHONPATH=str(tmp_path / "pkg"), HF_HUB_OFFLINE="1", PYTHONWARNINGS="ignore")
    res = subprocess.run([sys.executable, str(script), str(tmp_path)], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert Path(out["package"]).resolve().is_relative_to(copy.resolve()), out["package"]  # the copy ran
    assert len(out["stored"]) == 140 and all(isinstance(v, int) and v > 0 for v in out["stored"].values())  # store
    assert out["table"] == out["stored"]  # the loss table's (R,) column, request by request
    assert out["features"] == ["log_question_tokens"]  # certification fit a learned gate on it
    assert out["decision_value"] == out["json_value"] == out["n_question"]  # the runtime measured it
    assert out["learned_score"] == out["expected_score"]  # and its gate scored it
