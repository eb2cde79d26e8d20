"""The trainer's parts that decide what a run learns from (it runs outside CI; these pieces do not)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from certkv.model.embedded_tokenizer import EMBEDDED_DIR

    return AutoTokenizer.from_pretrained(EMBEDDED_DIR)


def _fresh(tokenizer, layers):
    from train_embedded import model_config, new_model

    config = model_config(len(tokenizer), tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id, layers)

    def fresh(seed):
        model = new_model(config, seed, shared_vector=False)
        state = {"seed": seed, "step": 0, "stage": 0, "since_start": 0, "history": []}
        return model, torch.optim.AdamW(model.parameters()), state

    return fresh


def test_grown_model_computes_what_its_source_did_and_can_learn(tokenizer, tmp_path):
    from train_embedded import grown, save_checkpoint

    small, opt, state = _fresh(tokenizer, 2)(3)
    state.update(step=120, stage=2, since_start=50)
    save_checkpoint(tmp_path / "checkpoint.pt", small, opt, state)
    deep, _, deep_state = grown(str(tmp_path), _fresh(tokenizer, 3))
    assert len(deep.model.layers) == 3
    assert (deep_state["step"], deep_state["stage"], deep_state["since_start"]) == (120, 2, 0)
    assert deep_state["grown_from"]["layers"] == 2
    ids = torch.randint(5, len(tokenizer), (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(deep(input_ids=ids).logits, small(input_ids=ids).logits)
    # the new layer is an identity, not a dead end: its output projections receive gradients
    deep(input_ids=ids).logits.square().mean().backward()
    assert deep.model.layers[2].self_attn.o_proj.weight.grad.abs().sum() > 0
    assert deep.model.layers[2].mlp.down_proj.weight.grad.abs().sum() > 0
    with pytest.raises(SystemExit, match="--layers above"):
        grown(str(tmp_path), _fresh(tokenizer, 2))


def test_batches_label_only_answer_tokens_and_accuracy_counts_whole_answers(tokenizer):
    from train_embedded import Batcher, answer_accuracy

    batcher = Batcher(tokenizer, seed=5, lookalike_share=1.0)
    ids, labels, first, tasks = batcher.batch(96, 3000, copy_share=0.0, mix={"multi_key": 1.0})
    assert set(tasks) == {"multi_key"}
    labelled = labels != -100
    assert labelled.any() and (first != -100).sum() < labelled.sum()
    # every labelled position predicts the next input token
    rows, cols = labelled.nonzero(as_tuple=True)
    assert torch.equal(labels[rows, cols], ids[rows, cols + 1])
    # perfect logits get every answer right; one wrong token loses exactly its answer
    logits = torch.nn.functional.one_hot(labels.clamp_min(0), len(tokenizer)).float()
    right, total = answer_accuracy(logits, labels)
    assert right == total > 0
    logits[rows[0], cols[0]] = 0
    assert answer_accuracy(logits, labels) == (total - 1, total)


def test_export_rebuilds_the_checkpoint_shape_and_resume_refuses_other_heads(tokenizer, tmp_path, monkeypatch):
    """4 / 2 and 8 / 4 heads give every weight the same shape: only the saved config tells them apart."""
    from train_embedded import export_from_checkpoint, main, model_config, new_model, save_checkpoint

    import certkv.model.embedded_tokenizer as embedded

    config = model_config(len(tokenizer), tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id, 2, 8, 4)
    model = new_model(config, 1, shared_vector=False)
    run = tmp_path / "run"
    run.mkdir()
    save_checkpoint(run / "checkpoint.pt", model, torch.optim.AdamW(model.parameters()), {"seed": 1, "step": 0, "stage": 0})
    target = tmp_path / "embedded"
    tokenizer.save_pretrained(target)
    monkeypatch.setattr(embedded, "EMBEDDED_DIR", target)
    export_from_checkpoint(run)
    from transformers import LlamaForCausalLM

    loaded = LlamaForCausalLM.from_pretrained(target)
    assert (loaded.config.num_attention_heads, loaded.config.num_key_value_heads) == (8, 4)
    ids = torch.randint(5, len(tokenizer), (1, 30), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(loaded(input_ids=ids).logits, model(input_ids=ids).logits, atol=1e-6)
    threads = str(torch.get_num_threads())  # train() sets the thread count before it reads the checkpoint
    with pytest.raises(SystemExit, match="resume it with --heads 8 --kv-heads 4"):
        main(["--out", str(run), "--steps", "1", "--threads", threads])
    with pytest.raises(SystemExit, match="grow it with --heads 8 --kv-heads 4"):
        main(["--out", str(tmp_path / "deeper"), "--grow-from", str(run), "--layers", "3", "--steps", "1", "--threads", threads])



def test_answer_sources_point_at_the_asked_records_tokens(tokenizer):
    from train_embedded import Batcher, answer_runs, answer_sources

    batcher = Batcher(tokenizer, seed=11, lookalike_share=0.5)
    key = tokenizer.convert_tokens_to_ids("\u2581apple")
    for task in ("multi_key", "single_needle"):
        for _ in range(5):
            ids, mask = batcher.task_sequence(task, 128)
            sources = answer_sources(ids, mask)
            runs = answer_runs(mask)
            # every answer token but the final </s> gets a source holding that very token, in the context
            assert len(sources) == sum(n - 1 for _, n in runs)
            context_end = runs[0][0]
            assert all(ids[q + 1] == ids[s] and s < context_end and mask[s] == 0 for q, s in sources.items())
            # the source is the asked record's span: the two tokens before it are the question's key and "is"
            for start, _ in runs:
                s = sources[start - 1]
                assert ids[s - 2 : s] == ids[start - 2 : start]
    # a value that appears after another key does not count: no source rather than a wrong one
    ids, mask = batcher.task_sequence("multi_key", 64)
    start, n = answer_runs(mask)[0]
    ids[start - 2] = key if ids[start - 2] != key else key + 1
    assert start - 1 not in answer_sources(ids, mask)
    for task in ("multi_value", "variable_tracking"):  # not a copy of one span after "<key> is"
        ids, mask = batcher.task_sequence(task, 128)
        assert answer_sources(ids, mask) == {}
    ids, mask = batcher.copy_sequence()
    sources = answer_sources(ids, mask, preceding=0)
    (start, n), = answer_runs(mask)
    assert sources == {start - 1 + j: 1 + j for j in range(n - 1)}


def test_key_sources_give_every_record_token_its_key(tokenizer):
    from train_embedded import Batcher

    from certkv.requests.vocabulary import KEY_WORDS

    batcher = Batcher(tokenizer, seed=12)
    ids, mask = batcher.task_sequence("multi_key", 128)
    sources = batcher.key_sources(ids)
    tokens = tokenizer.convert_ids_to_tokens(ids)
    keys = {"\u2581" + w for w in KEY_WORDS}
    assert sources and all(tokens[s] in keys and tokens[s - 1] == "\u2581for" and s < q <= s + 7 for q, s in sources.items())
    # a record's digits and its end, an answer's digits and its </s> all look at the key they belong to
    digits = [q for q in sources if tokens[q].isdigit()]
    # every "for <key>" is a record's, an answer prefix's (4 digits each) or a question's (none: it stops at "?")
    assert len(digits) == 4 * (tokens.count("\u2581for") - tokens.count("\u2581Question"))
    assert not any(q in sources for q, t in enumerate(tokens) if t in ("\u2581The", "\u2581Question", "\u2581Answer"))


def test_retrieval_loss_is_minus_log_of_the_attention_on_the_sources():
    from train_embedded import retrieval_loss

    weights = torch.softmax(torch.randn(2, 6, 6, generator=torch.Generator().manual_seed(0)), -1).requires_grad_()
    sources = torch.full((2, 6), -1)
    sources[0, 3], sources[1, 5] = 1, 4
    loss = retrieval_loss(weights, sources)
    expected = -(torch.log(weights[0, 3, 1] + 1e-6) + torch.log(weights[1, 5, 4] + 1e-6)) / 2
    assert torch.allclose(loss, expected)
    loss.backward()
    assert weights.grad[0, 3, 1] < 0 and weights.grad[1, 5, 4] < 0 and int((weights.grad != 0).sum()) == 2
    assert float(retrieval_loss(weights, torch.full((2, 6), -1)).detach()) == 0.0


def test_cooldown_lowers_the_rate_only_over_the_last_steps():
    from train_embedded import cooldown_factor

    assert [cooldown_factor(s, 1000, 0) for s in (0, 999)] == [1.0, 1.0]
    assert cooldown_factor(799, 1000, 200) == 1.0 and cooldown_factor(800, 1000, 200) == 1.0
    assert cooldown_factor(900, 1000, 200) == 0.5 and cooldown_factor(999, 1000, 200) == 0.05


def test_recite_sequences_copy_the_record_list_and_chain_each_key_to_the_one_before(tokenizer):
    """A recitation is one answer, a copy of the context's record list: every answer token but </s>
    gets its source in the list, and each position from the list's first key on looks at the last
    key strictly before it (a key position at the previous record's key: 12 tokens back)."""
    from train_embedded import Batcher, answer_runs, answer_sources

    batcher = Batcher(tokenizer, seed=13)
    for length in (64, 256):
        ids, mask = batcher.task_sequence("recite", length)
        (start, n), = answer_runs(mask)
        assert 42 + 1 <= n <= 126 + 1
        sources = answer_sources(ids, mask)
        assert len(sources) == n - 1 and all(ids[q + 1] == ids[s] and mask[s] == 0 for q, s in sources.items())
        keys = batcher.recite_key_sources(ids, mask)
        tokens = tokenizer.convert_ids_to_tokens(ids)
        record_keys = [i for i in range(1, len(ids)) if ids[i] in batcher.key_id_set and tokens[i - 1] == "\u2581for"]
        for q, s in keys.items():
            assert s in record_keys and s < q and not any(s < k < q for k in record_keys)
        # every key but a list's first has a source, the previous record's key, 12 tokens back
        chained = [k for k in record_keys if k in keys]
        assert len(chained) == len(record_keys) - 2 and all(keys[k] == k - 12 for k in chained)
        # the question names no record: nothing between the context's end and the answer prefix's key
        question = tokens.index("\u2581Question")
        assert all(q not in keys for q in range(question, start - 1))


def test_a_floor_far_below_the_weight_gives_a_vanishing_head_its_gradient():
    from train_embedded import retrieval_loss

    logits = torch.tensor([[[0.0, -30.0, 0.0]]], requires_grad=True)  # the target's weight is ~5e-14
    sources = torch.tensor([[1]])
    for floor, least in ((1e-6, 0.0), (1e-30, 0.99)):
        logits.grad = None
        retrieval_loss(torch.softmax(logits, -1), sources, floor).backward()
        push = -float(logits.grad[0, 0, 1])  # d(loss)/d(target logit), which -log(weight) makes 1 - weight
        assert push > least and (floor == 1e-30 or push < 1e-6)
