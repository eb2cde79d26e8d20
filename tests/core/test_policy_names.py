"""The one naming rule for candidates: names written by the contract read back into their parts."""

from __future__ import annotations

import itertools
import re

import pytest

from certkv.core.policy_names import REFERENCE_POLICY, gated_policy_name, is_gated_policy, parse_policy_name, policy_name


@pytest.mark.parametrize(
    ("display", "kv", "drop", "cert"),
    list(itertools.product(["snapkv", "streaming_llm", "lab.el:x-1"], [1.0, 0.9, 0.5, 0.123, 0.05],
                           [None, 0.1, -0.043, 0.0], [None, 1.7, 1e6])),
)
def test_written_names_read_back(display, kv, drop, cert):
    name = gated_policy_name(policy_name(display, kv), drop, cert)
    parsed = parse_policy_name(name)
    assert parsed.display == display
    assert parsed.kv_retained == float(f"{kv:.2f}")
    assert parsed.is_gated == (drop is not None or cert is not None) == is_gated_policy(name)
    assert parsed.stem == gated_policy_name(display, drop, cert)
    assert policy_name(parsed.display, parsed.kv_retained) + parsed.gate == name


@pytest.mark.parametrize("name", ["mypolicy", "a@b", "x@y+drop1", "snap@0.5x", "x@0.50+foo", "a+drop1", "@0.5", "", "a@@0.5"])
def test_foreign_names_never_fail_and_keep_the_loss_table_rules(name):
    """Loss tables from other systems may name policies anything: the press is what precedes '@',
    the sequence stem drops the first '@<number>', and a '+drop'/'+cert' anywhere marks a gate."""
    parsed = parse_policy_name(name)
    assert parsed.display == name.split("@", 1)[0]
    assert parsed.stem == re.sub(r"@[0-9]+(\.[0-9]+)?", "", name, count=1)
    assert parsed.is_gated == ("+drop" in name or "+cert" in name)


def test_the_reference_is_not_a_candidate_name():
    parsed = parse_policy_name(REFERENCE_POLICY)
    assert (parsed.display, parsed.kv_retained, parsed.is_gated) == ("full", None, False)


def test_pilot_gate_names_parse_back():
    from certkv.core.policy_names import gated_policy_name, is_gated_policy, parse_policy_name

    for kind, marker in (("confidence", "+confq"), ("lookahead", "+lookq"), ("learned", "+learnq")):
        name = gated_policy_name("snapkv@0.70", pilot_kind=kind, quantile=0.1)
        assert name == f"snapkv@0.70{marker}0.1" and is_gated_policy(name)
        parsed = parse_policy_name(name)
        assert parsed.display == "snapkv" and parsed.kv_retained == 0.7 and parsed.gate == f"{marker}0.1"
        assert parsed.stem == f"snapkv{marker}0.1"
