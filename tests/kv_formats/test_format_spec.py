"""KV formats as a contract writes them (torch-free): the ``cache:`` syntax, the candidates it
expands into, one-line errors, the byte prices and the serving engines' counterparts.

The byte shares are derived by hand below from what each format stores per element of a 16-bit
cache: ``nbits`` per value plus 16 bits per scale (and per zero point for transformers'
asymmetric QuantizedCache) shared by a group of elements.
"""

from __future__ import annotations

import pytest
import yaml

from certkv.contract.loading import parse_contract
from certkv.contract.spec import candidates, certification_spec, sequences
from certkv.errors import CertkvError
from certkv.kv_formats.spec import CacheBlock, format_ladder, parse_format

HEADER = """\
name: formats
requests: {source: requests.jsonl}
utility: exact_match
tolerance: 0.0
risk: 0.1
confidence: 0.9
"""

POLICIES = """\
policies:
  - cache: {backend: quanto, nbits: 4, q_group_size: 64, residual_length: 32}
    label: quanto4
  - press: streaming_llm
    kv_retained: [0.7, 0.5]
    cache: {backend: hqq, nbits: 8, q_group_size: 64, residual_length: 32}
  - cache: {backend: int, nbits: [8, 4], q_group_size: 32}
  - cache: {backend: split, keys: {backend: int, nbits: 8, q_group_size: 32}, values: {backend: int, nbits: 4, q_group_size: 32}}
  - press: snapkv
    kv_retained: [0.5]
"""


def contract_of(policies: str, extra: str = ""):
    return parse_contract(yaml.safe_load(HEADER + extra + policies))


def error_of(policy: str) -> str:
    """The one-line error of a contract whose only policy entry is `policy` (a YAML flow mapping)."""
    with pytest.raises(CertkvError) as info:
        contract_of(f"policies:\n  - {policy}\n")
    message = str(info.value)
    assert "\n" not in message, message
    assert message.startswith("contract: policies.0"), message  # names the entry it is about
    return message


# -- the binding syntax ----------------------------------------------------------------------------


def test_cache_entries_expand_into_named_candidates_and_sequences():
    c = contract_of(POLICIES)
    assert sequences(c) == [
        ["quanto4@1.00"],
        ["streaming_llm+hqq8@0.70", "streaming_llm+hqq8@0.50"],
        ["int8g32@1.00", "int4g32@1.00"],  # the ladder over nbits, most bits first
        ["kint8g32-vint4g32@1.00"],
        ["snapkv@0.50"],
    ]
    got = {x.policy: x for x in candidates(c)}
    q4 = got["quanto4@1.00"]
    assert (q4.press, q4.kv_retained, q4.label, q4.sequence, q4.position) == ("none", 1.0, "quanto4", 0, 0)
    assert dict(q4.kv_format) == {"backend": "quanto", "nbits": 4, "q_group_size": 64, "residual_length": 32,
                                  "axis_key": 0, "axis_value": 0}
    for position, kv in enumerate((0.7, 0.5)):
        x = got[f"streaming_llm+hqq8@{kv:.2f}"]
        assert (x.press, x.kv_retained, x.sequence, x.position) == ("streaming_llm", kv, 1, position)
        assert x.kv_format["backend"] == "hqq" and x.kv_format["nbits"] == 8
    assert [got[p].kv_format["nbits"] for p in ("int8g32@1.00", "int4g32@1.00")] == [8, 4]
    assert [got[p].press for p in ("int8g32@1.00", "int4g32@1.00")] == ["none", "none"]
    split = got["kint8g32-vint4g32@1.00"].kv_format
    assert (split["keys"]["nbits"], split["values"]["nbits"]) == (8, 4)
    assert got["snapkv@0.50"].kv_format is None and got["snapkv@0.50"].press == "snapkv"
    # A cache anywhere orders candidates by bytes, unless the contract says otherwise.
    assert c.cost_measure == "bytes"
    assert contract_of(POLICIES, extra="kv_cost: peak\n").cost_measure == "peak"
    assert contract_of("policies:\n  - {press: snapkv, kv_retained: [0.5]}\n").cost_measure == "kv_retained"


def test_the_spec_carries_each_formats_engine_setting():
    info = certification_spec(contract_of(POLICIES)).candidate_info
    assert info["kint8g32-vint4g32@1.00"].engine_setting == "llama.cpp --cache-type-k q8_0 --cache-type-v q4_0"
    assert info["int4g32@1.00"].engine_setting == "llama.cpp --cache-type-k q4_0 --cache-type-v q4_0"
    assert info["quanto4@1.00"].engine_setting.startswith("transformers QuantizedCache(backend='quanto', nbits=4")
    assert info["quanto4@1.00"].kv_format["residual_length"] == 32
    assert info["snapkv@0.50"].kv_format is None and info["snapkv@0.50"].engine_setting is None


def test_format_ladder_and_defaults():
    assert [f.name for f in CacheBlock(backend="hqq", nbits=[8, 4, 2]).formats()] == ["hqq8", "hqq4", "hqq2"]
    assert format_ladder({"backend": "int", "nbits": 8}) == [{"backend": "int", "nbits": 8}]
    fp8 = parse_format({"backend": "fp8"})
    assert (fp8.dtype, fp8.scale, fp8.residual_length, fp8.name) == ("e4m3", 1.0, 0, "fp8e4m3")
    assert parse_format({"backend": "fp8", "dtype": "e5m2", "scale": 0.5}).name == "fp8e5m2s0.5"
    quanto = parse_format({"backend": "quanto", "nbits": 2})
    assert (quanto.q_group_size, quanto.residual_length) == (64, 32)  # transformers' QuantizedCache defaults
    assert parse_format({"backend": "int", "nbits": 8}).q_group_size is None  # one scale per token and head


# -- one line per mistake --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("policy", "expected"),
    [
        ("{cache: {backend: quanto, nbits: 3}}", "cache.nbits for backend quanto must be one of [2, 4], got 3"),
        ("{cache: {backend: zstd, nbits: 4}}", "cache.backend must be one of quanto, hqq, fp8, int, split, tiered, got 'zstd'"),
        ("{cache: {backend: int, nbits: [4, 8]}}", "cache.nbits must be strictly decreasing"),
        ("{press: snapkv, kv_retained: [0.7, 0.5], cache: {backend: int, nbits: [8, 4]}}",
         "a sequence runs over kv_retained or over cache.nbits, not both"),
        ("{kv_retained: [0.7], cache: {backend: fp8}}", "kv_retained and press_kwargs need a press"),
        ("{cache: {backend: split, keys: {backend: quanto, nbits: 4}, values: {backend: int, nbits: 4}}}",
         "cache.keys and cache.values of a split format must be fp8 or int formats"),
        ("{cache: {backend: int, nbits: 4, bits: 4}}", "cache.bits: Extra inputs are not permitted"),
        ("{cache: {backend: int, nbits: 9}}", "cache.nbits: Input should be less than or equal to 8"),
        ("{cache: {backend: fp8, dtype: e3m4}}", "cache.dtype: Input should be 'e4m3' or 'e5m2'"),
        ("{cache: {backend: tiered, full: 0.1, quantised: {backend: int, nbits: 4}}}",
         "a tiered cache ranks the context's tokens by a press's scores: put it beside a scorer press"),
        ("{press: snapkv, kv_retained: [0.5, 0.2], cache: {backend: tiered, full: 0.2, quantised: {backend: int, nbits: 4}}}",
         "cache.full 0.2 must be below every kv_retained (0.2)"),
        ("{press: compression_ratio_decoding, kv_retained: [0.5], press_kwargs: {base_press: tova}, "
         "cache: {backend: tiered, full: 0.1, quantised: {backend: fp8}}}",
         "a tiered cache ranks the context once, at prefill: put it beside a prefill-time scorer press"),
        ("{press: snapkv, kv_retained: [0.5], cache: {backend: tiered, full: 0.1, quantised: {backend: hqq, nbits: 4}}}",
         "cache.quantised: Input tag 'hqq' found using 'backend' does not match any of the expected tags"),
        ("{press: snapkv, kv_retained: [0.5], cache: {backend: tiered, full: 0, quantised: {backend: fp8}}}",
         "cache.full: Input should be greater than 0"),
    ],
    ids=["quanto_nbits", "unknown_backend", "increasing_ladder", "ladder_and_retentions", "retention_without_press",
         "split_with_quanto", "unknown_key", "int_nbits", "fp8_dtype", "tiered_without_press", "tiered_full_above_kept",
         "tiered_decoding_press", "tiered_transformers_tier", "tiered_no_full_tier"],
)
def test_each_bad_cache_block_is_one_line(policy, expected):
    assert expected in error_of(policy)


def test_an_entry_needs_a_press_or_a_cache():
    assert "needs a press, a cache (a KV format) or both" in error_of("{label: nothing}")


# -- prices and counterparts -----------------------------------------------------------------------


def test_bytes_share_against_hand_derived_bits():
    head = 64
    assert parse_format({"backend": "fp8"}).bytes_share(head) == 0.5  # 8 bits, a per-tensor scale
    # int8, one 16-bit scale per token and head of 64 elements
    assert parse_format({"backend": "int", "nbits": 8}).bytes_share(head) == (8 + 16 / 64) / 16
    assert parse_format({"backend": "int", "nbits": 8}).bytes_share(128) == (8 + 16 / 128) / 16  # per head: its size
    # quanto 4-bit, a 16-bit scale and a 16-bit zero point per group of 64
    quanto4 = parse_format({"backend": "quanto", "nbits": 4, "q_group_size": 64})
    assert quanto4.bytes_share(head) == (4 + 32 / 64) / 16 == 0.28125
    assert quanto4.bytes_share(128) == 0.28125  # grouped by q_group_size, whatever the head size
    assert parse_format({"backend": "hqq", "nbits": 2, "q_group_size": 32}).bytes_share(head) == (2 + 32 / 32) / 16
    split = parse_format({"backend": "split", "keys": {"backend": "int", "nbits": 8, "q_group_size": 32},
                          "values": {"backend": "int", "nbits": 4, "q_group_size": 32}})
    k_share, v_share = (8 + 16 / 32) / 16, (4 + 16 / 32) / 16
    assert split.bytes_share(head) == (k_share + v_share) / 2 == 0.40625


def test_engine_counterparts():
    fp8 = parse_format({"backend": "fp8", "dtype": "e4m3", "scale": 1.0}).engine_counterpart()
    assert "vLLM --kv-cache-dtype fp8_e4m3 without calibrated scales" in fp8
    assert "SGLang --kv-cache-dtype fp8_e4m3" in fp8
    scaled = parse_format({"backend": "fp8", "dtype": "e5m2", "scale": 0.5}).engine_counterpart()
    assert "vLLM --kv-cache-dtype fp8_e5m2 with k/v scale 0.5" in scaled
    split = parse_format({"backend": "split", "keys": {"backend": "int", "nbits": 8, "q_group_size": 32},
                          "values": {"backend": "int", "nbits": 4, "q_group_size": 32}})
    assert split.engine_counterpart() == "llama.cpp --cache-type-k q8_0 --cache-type-v q4_0"
    sglang = parse_format({"backend": "int", "nbits": 8}).engine_counterpart()
    assert sglang == "SGLang --kv-cache-dtype int8 (per token and head)"
    # No engine stores these: said as None, not as a near miss.
    assert parse_format({"backend": "int", "nbits": 4, "q_group_size": 64}).engine_counterpart() is None
    assert parse_format({"backend": "split", "keys": {"backend": "int", "nbits": 8, "q_group_size": 32},
                         "values": {"backend": "fp8"}}).engine_counterpart() is None


def test_a_tiered_format_beside_a_press_that_is_no_plain_scorer_is_refused_when_presses_are_built():
    """PyramidKV keeps a different count per layer with a compress() of its own: its kept entries
    have no top-k order to tier; calibration says so in one line before anything runs."""
    from certkv.calibration.run import build_candidates

    tiered = "cache: {backend: tiered, full: 0.1, quantised: {backend: int, nbits: 4}}"
    ok = contract_of(f"policies:\n  - {{press: snapkv, kv_retained: [0.5], {tiered}}}\n")
    assert [c.policy for c in build_candidates(ok)] == ["snapkv+tier0.1-int4@0.50"]
    with pytest.raises(CertkvError) as info:
        build_candidates(contract_of(f"policies:\n  - {{press: pyramidkv, kv_retained: [0.5], {tiered}}}\n",
                                     "protocol: {query_aware: true}\n"))
    assert "\n" not in str(info.value) and "pyramidkv is not one: choose a scorer press" in str(info.value)


def test_tiered_format_name_price_and_parts():
    from certkv.kv_formats.spec import full_share, key_value_formats, stored_share, with_pilot_scales

    tiered = parse_format({"backend": "tiered", "full": 0.25, "quantised": {
        "backend": "split", "keys": {"backend": "int", "nbits": 8}, "values": {"backend": "fp8", "scale": "pilot"}}})
    assert tiered.name == "tier0.25-kint8-vfp8e4m3p" and full_share(tiered) == 0.25
    assert full_share(parse_format({"backend": "fp8"})) == 0.0
    assert tiered.bytes_share(64) == ((8 + 16 / 64) / 16 + 8 / 16) / 2 == stored_share(tiered, 64)
    assert key_value_formats(tiered) == (tiered.quantised.keys, tiered.quantised.values)
    assert tiered.engine_counterpart() is None  # no engine stores tiers
    placed = with_pilot_scales(tiered, [[448.0, 224.0]])
    assert placed.quantised.values.scales(0) == (1.0, 0.5)
