"""Contract validation, derived views, and the press registry.

Every malformed contract must fail with one line that names the field and the fix, because a
contract typo silently changes what is certified. The press-registry tests import kvpress once (the
drift check needs it); everything else stays torch-free.
"""

from __future__ import annotations

import inspect
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import REPO

from certkv.contract.loading import load_contract, parse_contract
from certkv.contract.schema import Contract
from certkv.contract.spec import candidates, sequences
from certkv.demo import DEMO_CONTRACT, DEMO_DIR, DEMO_REQUESTS
from certkv.errors import CertkvError
from certkv.presses import registry as press_registry

VALID = """\
name: t
requests:
  source: requests.jsonl
utility: exact_match
tolerance: 0.0
risk: 0.05
confidence: 0.95
policies:
  - press: snapkv
    kv_retained: [0.9, 0.5, 0.1]
  - press: streaming_llm
    kv_retained: [0.8, 0.4]
"""


def write(tmp_path: Path, text: str, name: str = "c.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def error_of(tmp_path: Path, text: str) -> str:
    with pytest.raises(CertkvError) as info:
        load_contract(write(tmp_path, text))
    message = str(info.value)
    assert "\n" not in message
    return message


def replace(old: str, new: str) -> str:
    assert old in VALID
    return VALID.replace(old, new)


# -- valid contracts -------------------------------------------------------------------------------


def test_valid_contract_defaults_and_views(tmp_path):
    c = load_contract(write(tmp_path, VALID))
    assert c.model == "embedded"
    assert c.procedure == "fixed_sequence"
    assert c.protocol.query_aware is False and c.protocol.max_new_tokens == 8
    assert c.protocol.device == "auto" and c.protocol.dtype == "auto"
    assert c.gate is None
    assert sequences(c) == [["snapkv@0.90", "snapkv@0.50", "snapkv@0.10"], ["streaming_llm@0.80", "streaming_llm@0.40"]]
    cands = candidates(c)
    assert [(x.policy, x.press, x.kv_retained, x.sequence, x.position) for x in cands] == [
        ("snapkv@0.90", "snapkv", 0.9, 0, 0),
        ("snapkv@0.50", "snapkv", 0.5, 0, 1),
        ("snapkv@0.10", "snapkv", 0.1, 0, 2),
        ("streaming_llm@0.80", "streaming_llm", 0.8, 1, 0),
        ("streaming_llm@0.40", "streaming_llm", 0.4, 1, 1),
    ]
    # Relative paths resolve against the contract's folder, not the working directory.
    assert c.resolved_store_path() == tmp_path / "runs" / "t"
    assert c.resolved_requests_path() == tmp_path / "requests.jsonl"


def test_hash_ignores_formatting_comments_and_key_order(tmp_path):
    a = load_contract(write(tmp_path, VALID, "a.yaml"))
    reordered = """\
    # a comment
    policies: [{kv_retained: [0.9, 0.5, 0.1], press: snapkv}, {press: streaming_llm, kv_retained: [0.8, 0.4]}]
    confidence: 0.95     # 1 - delta
    risk: 5e-2
    tolerance: 0
    utility: exact_match
    requests: {source: requests.jsonl, seed: 0}
    name: t
    model: embedded
    """
    b = load_contract(write(tmp_path, reordered, "b.yaml"))
    assert a.sha256() == b.sha256()
    assert len(a.sha256()) == 64
    c = load_contract(write(tmp_path, replace("risk: 0.05", "risk: 0.06"), "c.yaml"))
    assert c.sha256() != a.sha256()


def test_store_path_relative_to_contract_folder(tmp_path):
    sub = tmp_path / "contracts"
    sub.mkdir()
    c = load_contract(write(sub, VALID + "store: ../runs/x\n"))
    assert c.resolved_store_path() == tmp_path / "runs" / "x"


def test_labels_disambiguate_press_kwargs(tmp_path):
    text = VALID + "  - press: snapkv\n    label: snapkv_w16\n    kv_retained: [0.7]\n    press_kwargs: {window_size: 16}\n"
    c = load_contract(write(tmp_path, text))
    assert sequences(c)[-1] == ["snapkv_w16@0.70"]
    assert candidates(c)[-1].press_kwargs == {"window_size": 16}
    unlabelled = VALID + "  - press: snapkv\n    kv_retained: [0.7]\n    press_kwargs: {window_size: 16}\n"
    assert "give them distinct `label`s" in error_of(tmp_path, unlabelled)


def test_same_press_twice_without_kwargs_is_fine_but_names_must_differ(tmp_path):
    ok = VALID + "  - press: snapkv\n    kv_retained: [0.7, 0.3]\n"
    assert len(sequences(load_contract(write(tmp_path, ok)))) == 3
    clash = VALID + "  - press: snapkv\n    kv_retained: [0.5]\n"
    assert "policy 'snapkv@0.50' appears twice" in error_of(tmp_path, clash)
    rounding = replace("[0.9, 0.5, 0.1]", "[0.9, 0.501, 0.5]")
    assert "appears twice" in error_of(tmp_path, rounding)


def test_gate_and_import_path_and_nested_press(tmp_path):
    text = VALID + textwrap.dedent(
        """\
          - press: adakv
            label: ada
            kv_retained: [0.5]
            press_kwargs: {press: {press: snapkv, press_kwargs: {window_size: 8}}}
          - press: mypkg.presses:MyPress
            kv_retained: [0.5]
        store: s
        """
    )
    c = load_contract(write(tmp_path, text))
    assert c.gate is None
    assert sequences(c)[2:] == [["ada@0.50"], ["mypkg.presses:MyPress@0.50"]]


def test_builtin_source_and_context_length(tmp_path):
    text = replace("source: requests.jsonl", "source: builtin:demo\n  context_length: 256-512\n  limit: 10")
    c = load_contract(write(tmp_path, text))
    c.check_requests_source()  # builtin: nothing to check
    assert c.resolved_requests_path() is None
    reqs = c.load_requests()
    assert len(reqs) == 10
    assert "unknown task or mix" in error_of(tmp_path, replace("source: requests.jsonl", "source: builtin:nope"))
    jsonl_with_length = replace("source: requests.jsonl", "source: requests.jsonl\n  context_length: 512")
    assert "context_length applies only to builtin" in error_of(tmp_path, jsonl_with_length)
    # a mix's lengths must be ones its tasks allow, at load (not at generation); without one, the
    # ruler tasks take their own default span
    ruler_short = replace("source: requests.jsonl", "source: builtin:ruler\n  context_length: 256-512")
    assert "must lie within 512-8192 tokens for this mix" in error_of(tmp_path, ruler_short)
    ruler_default = load_contract(write(tmp_path, replace("source: requests.jsonl", "source: builtin:ruler\n  limit: 3")))
    assert ruler_default.requests.context_length is None
    from certkv.requests.natural_tasks import RESERVED_TOKENS, count_model_tokens

    for r in ruler_default.load_requests():
        assert r.task.startswith(("ruler_", "reading_")), r.id
        assert 0.5 * 512 < count_model_tokens(f"{r.context}{r.question} {r.answer_prefix}") <= 1024 - RESERVED_TOKENS, r.id
    mixed = replace("source: requests.jsonl", "source: builtin:single_needle=1,ruler_multi_key=1")
    assert "(the default 256-512; set requests.context_length)" in error_of(tmp_path, mixed)


# -- malformed contracts: one line each, naming the field ---------------------------------------


@pytest.mark.parametrize(
    "old,new,expected",
    [
        ("risk: 0.05", "risk: 0.05\nrisc: 0.1", "risc: unknown key; remove it or check its spelling"),
        ("  source: requests.jsonl", "  source: requests.jsonl\n  limt: 3", "requests.limt: unknown key"),
        ("tolerance: 0.0", "tolerance: zero", "tolerance: Input should be a valid number"),
        ("risk: 0.05", "risk: '0.05'", "risk: Input should be a valid number"),
        ("kv_retained: [0.8, 0.4]", "kv_retained: 0.8", "policies.1.kv_retained: Input should be a valid list"),
        ("kv_retained: [0.8, 0.4]", "kv_retained: []", "policies.1.kv_retained: List should have at least 1 item"),
        ("kv_retained: [0.8, 0.4]", "kv_retained: [0.4, 0.8]", "policies.1.kv_retained: kv_retained must be strictly decreasing"),
        ("kv_retained: [0.8, 0.4]", "kv_retained: [0.4, 0.8]", "tested in the order written, conservative (most KV) first"),
        ("kv_retained: [0.8, 0.4]", "kv_retained: [0.8, 0.8]", "kv_retained lists 0.8 twice"),
        ("kv_retained: [0.8, 0.4]", "kv_retained: [0.8, 0.0]", "policies.1.kv_retained.1: Input should be greater than 0"),
        ("kv_retained: [0.8, 0.4]", "kv_retained: [1.2, 0.4]",
         "policies.1.kv_retained.0: Input should be less than or equal to 1"),
        ("risk: 0.05", "risk: 0", "risk: Input should be greater than 0"),
        ("risk: 0.05", "risk: 1", "risk: Input should be less than 1"),
        ("confidence: 0.95", "confidence: 1.5", "confidence: Input should be less than 1"),
        ("tolerance: 0.0", "tolerance: -0.1", "tolerance: Input should be greater than or equal to 0"),
        ("utility: exact_match", "utility: accuracy", "utility: Input should be 'exact_match', 'contains'"),
        ("policies:", "procedure: sequential\npolicies:", "procedure: Input should be 'fixed_sequence'"),
        ("press: snapkv", "press: snapvk", "policies.0.press: unknown press 'snapvk'; did you mean snapkv?"),
        ("press: snapkv", "press: snapvk", "An import path like package.module:Class is accepted too"),
        ("press: snapkv", "press: think", "press 'think' has no setting that kv_retained maps to"),
        ("name: t\n", "", "name: Field required"),
        ("name: t\n", "name: a/b\n", "name: name 'a/b' may use letters"),
        ("  - press: snapkv\n", "  - press: snapkv\n    press_kwargs: {compression_ratio: 0.5}\n",
         "must not set compression_ratio"),
        ("  - press: snapkv\n", "  - press: adakv\n    press_kwargs: {press: snapvk}\n",
         "press_kwargs.press: unknown press 'snapvk'"),
        ("policies:", "protocol: {device: gpu}\npolicies:", "protocol.device: device must be auto, cpu"),
        ("policies:", "gate: {certificate: [0.0]}\npolicies:", "gate.certificate.0: Input should be greater than 0"),
    ],
)
def test_malformed_contract_one_line(tmp_path, old, new, expected):
    message = error_of(tmp_path, replace(old, new))
    assert expected in message
    assert message.startswith(str(tmp_path / "c.yaml"))


def test_missing_requests_file_is_checked_at_calibration_time(tmp_path):
    c = load_contract(write(tmp_path, VALID))  # validates without the file
    with pytest.raises(CertkvError) as info:
        c.check_requests_source()
    assert "request file" in str(info.value) and str(tmp_path / "requests.jsonl") in str(info.value)
    assert "\n" not in str(info.value)
    (tmp_path / "requests.jsonl").write_text('{"id": "a", "context": "c", "question": "q", "answers": ["x"]}\n')
    c.check_requests_source()
    assert [r.id for r in c.load_requests()] == ["a"]


@pytest.mark.parametrize(
    "text,expected",
    [
        ("name: [unclosed\n", "invalid YAML at line"),
        ("name: t\n  bad: indent\n", "invalid YAML at line"),
        ("- a\n- b\n", "top level must be a mapping"),
        ("", "got an empty file"),
        ("name: t\nname: u\n", "duplicate key 'name'"),
    ],
)
def test_bad_yaml_one_line(tmp_path, text, expected):
    message = error_of(tmp_path, text)
    assert expected in message
    assert str(tmp_path / "c.yaml") in message


def test_missing_contract_file(tmp_path):
    with pytest.raises(CertkvError, match="contract file .* does not exist"):
        load_contract(tmp_path / "nope.yaml")


def test_parse_contract_accepts_mappings():
    data = {
        "name": "m",
        "requests": {"source": "builtin:demo"},
        "utility": "agreement",
        "tolerance": 0,
        "risk": 0.1,
        "confidence": 0.9,
        "policies": [{"press": "knorm", "kv_retained": [0.5]}],
    }
    c = parse_contract(data, base_dir="/tmp/x")
    assert isinstance(c, Contract)
    assert c.resolved_store_path() == Path("/tmp/x/runs/m")


@pytest.mark.parametrize(
    "utility", ["prefix_agreement", "token_agreement", "rouge_l_full", "final_answer", "final_agreement"]
)
def test_long_output_utilities_load(tmp_path, utility):
    path = tmp_path / "c.yaml"
    path.write_text(VALID.replace("utility: exact_match", f"utility: {utility}"), encoding="utf-8")
    assert load_contract(path).utility == utility


def test_the_contract_accepts_exactly_the_registered_utilities():
    from typing import get_args

    from certkv.calibration.utility import UTILITIES

    assert set(get_args(Contract.model_fields["utility"].annotation)) == set(UTILITIES)


# -- shipped contracts ------------------------------------------------------------------------------


def test_demo_contract_validates():
    c = load_contract(DEMO_CONTRACT)
    assert c.name == "demo" and c.model == "embedded" and c.utility == "exact_match"
    assert (c.tolerance, c.risk, c.confidence, c.procedure) == (0.0, 0.05, 0.95, "fixed_sequence")
    fine = [round(0.9 - 0.05 * i, 2) for i in range(17)]  # 0.9, 0.85, ..., 0.1
    grid = fine[::2]
    assert [(p.press, p.kv_retained) for p in c.policies] == [("criticalkv", fine), ("probabilistic", grid),
                                                              ("criticalkv", fine)]
    assert [p.formats[0].name if p.cache else None for p in c.policies] == [None, None, "kint8-vint4"]
    assert c.policies[0].press_kwargs == {"press": "snapkv"}
    assert c.protocol.query_aware  # the presses see the question (chosen on the certified press league)
    gate = c.gate
    assert gate is not None and gate.pilot == 0.25 and not gate.agreement_drop and not gate.certificate
    assert [g.quantiles for g in (gate.confidence, gate.lookahead, gate.learned)] == [
        [0.1, 0.2, 0.3], [0.3, 0.4, 0.5], [0.3, 0.4, 0.5]]
    assert gate.needs_lookahead and not gate.needs_agreement  # calibration records the probe, not the drop
    # per 16-bit entry: ungated, then one per pilot-gate quantile; the format entry: ungated and its confidence ones
    assert len(sequences(c)) == 2 * (1 + 3 + 3 + 3) + (1 + 3)
    # relative to the contract's folder: `certkv demo` copies both files and the store follows the copy
    assert c.resolved_store_path() == DEMO_DIR / "runs" / "demo"
    assert c.resolved_requests_path() == DEMO_REQUESTS
    c.check_requests_source()  # the request file ships with the contract


def test_llama3_contract_validates_without_its_data():
    c = load_contract(REPO / "contracts" / "llama3_longbench.yaml")
    assert c.model == "meta-llama/Llama-3.1-8B-Instruct"
    assert "adakv_snapkv@0.50" in sequences(c)[-1]
    if not c.resolved_requests_path().exists():
        with pytest.raises(CertkvError, match="does not exist"):
            c.check_requests_source()


# -- torch-free imports -----------------------------------------------------------------------------


def test_data_layer_imports_no_torch():
    code = (
        "import sys\n"
        "import certkv.contract.schema, certkv.calibration.store, certkv.calibration.utility\n"
        "import certkv.presses.registry, certkv.cli.export\n"
        "from certkv.contract.loading import load_contract\n"
        f"load_contract({str(DEMO_CONTRACT)!r})\n"
        "heavy = sorted(m for m in ('torch', 'transformers', 'kvpress') if m in sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


# -- press registry (static parts) --------------------------------------------------------------------


def test_registry_names_and_import_paths():
    assert press_registry.is_known_press("snapkv")
    assert press_registry.is_known_press("certkv.presses.probabilistic:ProbabilisticPress")
    assert not press_registry.is_known_press("snapvk")
    assert not press_registry.is_known_press("certkv.presses.probabilistic.ProbabilisticPress")
    assert press_registry.press_info("streaming_llm").target == "kvpress:StreamingLLMPress"
    assert press_registry.compression_ratio_for(0.7) == 0.3
    assert press_registry.compression_ratio_for(1.0) == 0.0


def test_register_press(monkeypatch):
    monkeypatch.setattr(press_registry, "_REGISTRY", dict(press_registry._REGISTRY))
    press_registry.register_press("my_press", "certkv.presses.value_norm:AttentionTimesValueNormPress")
    assert press_registry.is_known_press("my_press")
    with pytest.raises(CertkvError, match="already registered"):
        press_registry.register_press("probabilistic", "x.y:Z")  # certkv's own presses are in the static table
    with pytest.raises(CertkvError, match="already registered"):
        press_registry.register_press("snapkv", "x.y:Z")
    with pytest.raises(CertkvError, match="snake_case"):
        press_registry.register_press("Bad-Name", "x.y:Z")

    class Toy:
        def __init__(self, compression_ratio: float = 0.0, width: int = 1):
            self.compression_ratio, self.width = compression_ratio, width

    press_registry.register_press("toy", Toy)
    press = press_registry.build_press("toy", 0.25, {"width": 3})
    assert isinstance(press, Toy) and press.compression_ratio == 0.75 and press.width == 3
    with pytest.raises(CertkvError, match="rejected press_kwargs"):
        press_registry.build_press("toy", 0.25, {"height": 3})
    with pytest.raises(CertkvError, match="cannot import module"):
        press_registry.resolve_press_class("no_such_pkg_xyz.mod:Press")


# -- press registry against the installed kvpress (imports torch once) -----------------------------


@pytest.fixture(scope="module")
def kvpress():
    return pytest.importorskip("kvpress")


def test_registry_matches_kvpress(kvpress):
    """The static table must name every press kvpress exports, and only real classes."""
    table = {name: target.removeprefix("kvpress:") for name in press_registry.known_presses()
             if isinstance(target := press_registry.press_info(name).target, str) and target.startswith("kvpress:")}
    exported = {
        name
        for name in kvpress.__all__
        if inspect.isclass(getattr(kvpress, name)) and issubclass(getattr(kvpress, name), kvpress.BasePress)
    } - press_registry.KVPRESS_NOT_PRESSES
    assert set(table.values()) == exported
    assert len(set(table.values())) == len(table)
    for name, cls_name in table.items():
        cls = press_registry.resolve_press_class(name)
        assert cls is getattr(kvpress, cls_name)


def _inner_kwargs(cls) -> dict:
    params = inspect.signature(cls).parameters
    kwargs = {}
    for key in ("press", "base_press", "prefilling_press"):
        if key in params:
            kwargs[key] = "snapkv"
    if "presses" in params:
        kwargs["presses"] = ["snapkv"]
    if "compression_ratios" in params:
        kwargs["compression_ratios"] = [0.5]
    if "decoding_press" in params:
        kwargs["decoding_press"] = {"press": "compression_ratio_decoding", "press_kwargs": {"base_press": "knorm"}}
    return kwargs


def test_retention_knobs_match_kvpress(kvpress):
    """Every knob receives 1 − kv_retained; presses without one really cannot take a ratio."""
    for name in press_registry.known_presses():
        info = press_registry.press_info(name)
        cls = press_registry.resolve_press_class(name)
        kwargs = _inner_kwargs(cls)
        if info.knob is None:
            press = press_registry.instantiate(name, kwargs)
            assert "compression_ratio" not in inspect.signature(cls).parameters, name
            prop = inspect.getattr_static(cls, "compression_ratio", None)
            if isinstance(prop, property):
                with pytest.raises(AttributeError):  # a read-only property: no setter to take a ratio
                    press.compression_ratio = 0.5
            continue
        press = press_registry.build_press(name, 0.6, kwargs)
        target = press
        *owners, attr = info.knob.split(".")
        for owner in owners:
            target = getattr(target, owner)
        assert getattr(target, attr) == pytest.approx(0.4), name


def test_build_press_nesting(kvpress):
    snap = press_registry.build_press("snapkv", 0.25, {"window_size": 16})
    assert isinstance(snap, kvpress.SnapKVPress) and snap.compression_ratio == 0.75 and snap.window_size == 16
    ada = press_registry.build_press("adakv", 0.5, {"press": {"press": "snapkv", "press_kwargs": {"window_size": 8}}})
    assert isinstance(ada, kvpress.AdaKVPress) and isinstance(ada.press, kvpress.SnapKVPress)
    assert ada.press.compression_ratio == 0.5 and ada.press.window_size == 8
    crit = press_registry.build_press("criticalkv", 0.3, {"press": "knorm"})
    assert isinstance(crit.press, kvpress.KnormPress) and crit.press.compression_ratio == pytest.approx(0.7)
    by_path = press_registry.build_press("kvpress:TOVAPress", 0.9)
    assert isinstance(by_path, kvpress.TOVAPress) and by_path.compression_ratio == pytest.approx(0.1)
    with pytest.raises(CertkvError, match="no setting that kv_retained maps to"):
        press_registry.build_press("think", 0.5)
    with pytest.raises(CertkvError, match="kv_retained must lie in"):
        press_registry.build_press("snapkv", 0.0)


def _is_score_based(cls) -> bool:
    """A press class that ranks KV entries by a score and keeps the top-k with ScorerPress.compress:
    the class-level form of the engine's fast-path rule (certkv.engine.scoring.is_fast_path_press)."""
    from kvpress import ScorerPress

    return issubclass(cls, ScorerPress) and cls.compress is ScorerPress.compress


def test_score_based_classification(kvpress):
    from certkv.engine.scoring import is_fast_path_press

    for name in ("snapkv", "streaming_llm", "knorm", "tova", "observed_attention", "random", "expected_attention",
                 "keydiff", "qfilter", "leverage"):
        assert _is_score_based(press_registry.resolve_press_class(name)), name
    for name in ("pyramidkv", "adakv", "chunkkv", "think", "finch", "kvzip"):
        assert not _is_score_based(press_registry.resolve_press_class(name)), name
    assert is_fast_path_press(kvpress.SnapKVPress(compression_ratio=0.5))
    assert not is_fast_path_press(press_registry.build_press("pyramidkv", 0.5))


def test_query_aware_is_a_protocol_and_must_be_a_boolean(tmp_path):
    from certkv.contract.loading import parse_contract

    data = {
        "name": "q", "requests": {"source": "builtin:demo"}, "utility": "exact_match", "tolerance": 0.0,
        "risk": 0.1, "confidence": 0.9, "policies": [{"press": "snapkv", "kv_retained": [0.5]}],
        "protocol": {"query_aware": True},
    }
    assert parse_contract(data).protocol.query_aware is True
    data["protocol"] = {"query_aware": "sometimes"}
    with pytest.raises(CertkvError, match="query_aware") as info:
        parse_contract(data)
    assert "\n" not in str(info.value)


def _order_contract(order):
    return {
        "name": "o", "requests": {"source": "builtin:demo"}, "utility": "exact_match", "tolerance": 0.0,
        "risk": 0.1, "confidence": 0.9, "order": order,
        "policies": [{"press": "snapkv", "kv_retained": [0.8, 0.5]}, {"press": "knorm", "kv_retained": [0.7]}],
    }


def test_interleaved_order_is_one_sequence_at_full_delta():
    from certkv.contract.spec import certification_spec

    contract = parse_contract(_order_contract(["snapkv@0.80", "knorm@0.70", "snapkv@0.50"]))
    assert sequences(contract) == [["snapkv@0.80", "knorm@0.70", "snapkv@0.50"]]
    assert certification_spec(contract).lengths == [3]
    plain = parse_contract(dict(_order_contract(None)))
    assert sequences(plain) == [["snapkv@0.80", "snapkv@0.50"], ["knorm@0.70"]]


@pytest.mark.parametrize(
    "order, message",
    [
        (["snapkv@0.80", "knorm@0.70"], "order leaves out 'snapkv@0.50'"),
        (["snapkv@0.80", "knorm@0.70", "snapkv@0.50", "knorm@0.70"], "order lists 'knorm@0.70' more than once"),
        (["snapkv@0.80", "knorm@0.70", "snapkv@0.40"], "order names 'snapkv@0.40', which no policy entry defines"),
    ],
)
def test_bad_interleaved_order_is_one_line(order, message):
    with pytest.raises(CertkvError, match=message):
        parse_contract(_order_contract(order))


def test_unset_later_keys_leave_the_hash_alone(tmp_path):
    """`order` was added after stores were calibrated: a contract without it must hash as before,
    so those stores still match (runs/demo was calibrated before `order` existed)."""
    plain = load_contract(write(tmp_path, VALID))
    assert '"order"' not in plain.canonical_json()
    ordered = load_contract(write(tmp_path, VALID + "order: [snapkv@0.90, streaming_llm@0.80, snapkv@0.50, "
                                  "streaming_llm@0.40, snapkv@0.10]\n", "o.yaml"))
    assert '"order"' in ordered.canonical_json() and ordered.sha256() != plain.sha256()
    # (runs/demo itself was recalibrated when demo.yaml gained its gate grid and probabilistic press)
    assert '"gate"' in plain.canonical_json()  # `gate` predates stores: present, null when unset


def test_decoding_time_presses_and_the_recompute_gate(tmp_path):
    """kv_retained reaches a decoding press's target share (through the wrapper too); the recompute
    gate grows candidates for decoding-time entries only, and is refused without one; kv_cost
    defaults to peak with a decoding-time entry and is left out of the hash while unset."""
    from certkv.contract.spec import sequences
    from certkv.errors import CertkvError

    decoding = {"press": "compression_ratio_decoding", "kv_retained": [0.6],
                "press_kwargs": {"base_press": "knorm", "compression_interval": 8}}
    base = {"name": "long", "requests": {"source": "builtin:demo"}, "utility": "prefix_agreement", "tolerance": 0.0,
            "risk": 0.1, "confidence": 0.9, "gate": {"pilot": 0.25, "recompute": {"quantiles": [0.1]}}}
    contract = parse_contract({**base, "policies": [decoding, {"press": "snapkv", "kv_retained": [0.5]}]}, "test")
    assert [s for seq in sequences(contract) for s in seq] == [
        "compression_ratio_decoding@0.60", "compression_ratio_decoding@0.60+recq0.1", "snapkv@0.50"]
    assert contract.cost_measure == "peak" and "kv_cost" not in json.loads(contract.canonical_json())
    assert parse_contract({**base, "policies": [decoding], "kv_cost": "time"}, "t").cost_measure == "time"
    with pytest.raises(CertkvError, match="no policy entry does either"):
        parse_contract({**base, "policies": [{"press": "snapkv", "kv_retained": [0.5]}]}, "test")
    with pytest.raises(CertkvError, match="has no setting that kv_retained maps to"):
        parse_contract({**base, "policies": [{"press": "decoding", "kv_retained": [0.5]}]}, "test")
