"""The embedded model loads offline through transformers and answers the built-in tasks."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from certkv.errors import CertkvError


def test_embedded_model_is_a_gqa_llama(embedded):
    model, tokenizer = embedded
    from transformers import LlamaForCausalLM

    assert isinstance(model, LlamaForCausalLM)
    cfg = model.config
    assert cfg.num_key_value_heads < cfg.num_attention_heads
    assert tokenizer.decode(tokenizer.encode(" 4729", add_special_tokens=False)) == "4729"


def test_loads_offline_through_auto_classes(tmp_path):
    code = (
        "from transformers import AutoModelForCausalLM, AutoTokenizer;"
        "from certkv.model.loading import EMBEDDED_DIR;"
        "m = AutoModelForCausalLM.from_pretrained(EMBEDDED_DIR, local_files_only=True);"
        "t = AutoTokenizer.from_pretrained(EMBEDDED_DIR, local_files_only=True);"
        "print(type(m).__name__, len(t))"
    )
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "empty_hf_home"))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.startswith("LlamaForCausalLM")


def test_local_folder_loads_like_embedded(embedded, tmp_path):
    from certkv.model.loading import load_model

    model, tokenizer = embedded
    model.save_pretrained(tmp_path / "copy")
    tokenizer.save_pretrained(tmp_path / "copy")
    m2, _ = load_model(str(tmp_path / "copy"), device="cpu")
    import torch

    for a, b in zip(model.parameters(), m2.parameters()):
        assert torch.equal(a, b)


def test_missing_hub_model_offline_is_one_line(monkeypatch):
    from certkv.model.loading import load_model

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(CertkvError, match="not available offline") as err:
        load_model("certkv-tests/no-such-model", device="cpu")
    assert "\n" not in str(err.value)
    with pytest.raises(CertkvError, match="has no config.json"):
        load_model(str(__import__("pathlib").Path(__file__).parent), device="cpu")


def test_full_kv_generation_answers_needles(embedded):
    from certkv.model.generation import full_kv_answer
    from certkv.requests.request_set import generate_requests

    model, tokenizer = embedded
    reqs = generate_requests("demo", 20, seed=9001, context_length="256-512")
    correct = sum(full_kv_answer(model, tokenizer, r.context, r.question) == r.answers[0] for r in reqs)
    assert correct >= 18, f"{correct}/20 full-KV answers correct"
