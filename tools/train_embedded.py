"""Trains the embedded model: a tiny Llama that answers the built-in retrieval tasks.

Run outside CI, in the background, with a log::

    nohup python tools/train_embedded.py --out train_runs/embedded > train_runs/embedded.log 2>&1 &

The run is seeded and resumable: it checkpoints to ``OUT/checkpoint.pt`` every 100 steps
(``--checkpoint-every``) and continues from there when started again with the same ``--out``. When
it finishes (or with ``--export-only``) it writes the weights, config and tokenizer into
``certkv/embedded/``.

Recipe (multi-query associative recall): every training sequence is one built-in context followed
by several question/answer pairs about it, with the loss only on the answer tokens, ~4k tokens per
step. A curriculum raises the context length from 64 to 576 tokens each time the running
multi-key accuracy passes 0.9. Early on, part of the sequences ask the model to repeat a random
string, which makes copy (induction) heads form; half the multi-key contexts have look-alike
values, so that copying a digit from whatever followed the previous digit fails. What makes
multi-key retrieval learnable at all on this 2-layer model is the retrieval supervision: an
auxiliary loss on two heads' attention, −log of the weight that one last-layer head puts on the
context position of the token each answer position must produce (the asked record's value, or
the string to repeat), and that one first-layer head puts, at every token of a record after its
key, on that key (so that every digit carries the name of its record, which the second and later
digits' lookups need). Without it, runs found the asked record for the first digit only, or not
at all (README). The heads stay ordinary heads of a stock ``LlamaForCausalLM``; nothing of the
supervision is in the exported model. A run that has not started learning after ``--patience``
steps is restarted from a fresh initialisation with the next seed. The model's shape
(``--layers``, ``--heads``, ``--kv-heads``) is saved in the checkpoint; resuming or growing a run
needs the same head counts.

Levers for a run that stalls (the README says what each did): ``--shared-vector init|on-match``,
``--lookalike-share`` (multi-key contexts whose values look alike, so that copying a digit from
whatever followed the previous digit fails), ``--copy-share`` (more repeat-a-string sequences once
matching has started) and ``--grow-from`` (continue a run's checkpoint with more layers).
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

from certkv.requests.builtin_tasks import LONG_TASKS, RECITE_CONTEXT

CURRICULUM = [64, 96, 128, 192, 256, 320, 384, 448, 512, 576]
MAX_QUESTIONS = 8
RECITE_TASKS = tuple(LONG_TASKS)  # trained at their own context lengths (RECITE_CONTEXT), asked once per sequence


def model_config(vocab_size: int, bos: int, eos: int, pad: int, layers: int = 2, heads: int = 4, kv_heads: int = 2):
    """The embedded model's shape. More, narrower heads at the same width cost no parameters
    (hidden 128 = 4 × 32 = 8 × 16) and give the first layer more distinct attention patterns."""
    from transformers import LlamaConfig

    check_shape(heads, kv_heads)
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=bos,
        eos_token_id=eos,
        pad_token_id=pad,
        attention_bias=False,
        mlp_bias=False,
    )


def check_shape(heads: int, kv_heads: int) -> None:
    """Head counts the embedded model can have: GQA (fewer key/value than query heads), heads of
    at least 8 dimensions that split the width of 128 evenly."""
    if not (1 <= kv_heads < heads and heads % kv_heads == 0 and 128 % heads == 0 and 128 // heads >= 8):
        raise ValueError(f"--heads {heads} --kv-heads {kv_heads}: the query heads must split 128 into heads of at"
                         " least 8 dimensions and be a multiple of the key/value heads, which must be fewer")


def new_model(config, seed: int, shared_vector: bool = True):
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    if shared_vector:
        add_shared_vector(model, seed)
    return model


def add_shared_vector(model, seed: int, scale: float = 1.0) -> None:
    """Add one random vector (scale × the embeddings' std) to every token embedding.

    A component common to all tokens lets attention heads score by position alone (RoPE rotates
    it like any other part of the query and key), which is how "attend to the last few tokens"
    heads form. Seeded, so a run that adds it later does so reproducibly.
    """
    import torch

    with torch.no_grad():
        emb = model.get_input_embeddings().weight
        shared = torch.randn(emb.shape[1], generator=torch.Generator().manual_seed(seed)) * emb.std() * scale
        emb.add_(shared)


class Batcher:
    """Builds training sequences from the built-in task generators."""

    def __init__(self, tokenizer, seed: int, dense: bool = False, recall_share: float = 0.0, lookalike_share: float = 0.0):
        from certkv.requests.vocabulary import DIGITS, KEY_WORDS

        self.dense = dense
        self.lookalike_share = lookalike_share
        self.recall_share = recall_share
        self.tok = tokenizer
        self.rng = random.Random(f"train/{seed}")
        self.bos, self.eos, self.pad = tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id
        self.key_ids = tokenizer.convert_tokens_to_ids(["\u2581" + w for w in KEY_WORDS])
        self.digit_ids = tokenizer.convert_tokens_to_ids(DIGITS)
        self.space = tokenizer.convert_tokens_to_ids("\u2581")
        self.repeat_ids = tokenizer.encode("Repeat:", add_special_tokens=False)
        self.for_id = tokenizer.convert_tokens_to_ids("\u2581for")
        self.question_id = tokenizer.convert_tokens_to_ids("\u2581Question")
        self.key_id_set = set(self.key_ids)
        self.record_ends = set(tokenizer.convert_tokens_to_ids([".", "?"])) | {self.eos}

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False)

    def task_sequence(self, task: str, length: int) -> tuple[list[int], list[int]]:
        """Context then several question/answer pairs; mask is 1 on the first answer, 2 on others."""
        from certkv.requests.builtin_tasks import TASKS

        if task in LONG_TASKS:
            sample = LONG_TASKS[task](self.rng, length)
        elif task == "multi_key":
            sample = TASKS[task](
                self.rng,
                length,
                share=1.0 if self.dense else 0.6,  # dense: records only, more keys to match per step
                # no draw without lookalike contexts: the data stream of other runs stays as it was
                lookalike=self.lookalike_share > 0 and self.rng.random() < self.lookalike_share,
            )
        else:
            sample = TASKS[task](self.rng, length)
        ids = [self.bos] + self.encode(sample.context)
        mask = [0] * len(ids)
        # Questions are drawn with replacement: asked-once keys would let later answers be found by
        # elimination ("a record not asked yet"), a shortcut that stalls learning to match keys.
        # A recitation is asked once: a second one could copy the first instead of the context.
        qa = self.rng.choices(sample.qa, k=1 if task in LONG_TASKS else min(MAX_QUESTIONS, 2 * len(sample.qa)))
        for i, (question, answer) in enumerate(qa):
            q = self.encode(question + "\n")
            a = self.encode(" " + answer) + [self.eos]
            ids += q + a
            mask += [0] * len(q) + [1 if i == 0 else 2] * len(a)
        return ids, mask

    def recall_sequence(self, length: int) -> tuple[list[int], list[int]]:
        """Bare associative recall ("apple 4729 stone 1836 ... stone 1836"): the key sits right before
        its value, the shortest form of the lookup every retrieval task needs."""
        n = max(2, min(len(self.key_ids), length // 6))
        keys = self.rng.sample(self.key_ids, n)
        values = {k: [self.space] + [self.rng.choice(self.digit_ids) for _ in range(4)] for k in keys}
        ids = [self.bos]
        for k in keys:
            ids += [k] + values[k]
        mask = [0] * len(ids)
        for k in self.rng.choices(keys, k=min(MAX_QUESTIONS, 2 * n)):
            ids += [k] + values[k]
            mask += [0] + [1] * len(values[k])
        return ids, mask

    def copy_sequence(self) -> tuple[list[int], list[int]]:
        """Repeat a random key/value string ("apple 4729 stone 1836 ..."): digits recur, so copying
        it needs the last few tokens, the key included, not just the current one."""
        s = []
        for _ in range(self.rng.randint(2, 6)):
            s.append(self.rng.choice(self.key_ids))
            s += [self.rng.choice(self.digit_ids) for _ in range(4)]
        ids = [self.bos] + s + self.repeat_ids + s + [self.eos]
        mask = [0] * (1 + len(s) + len(self.repeat_ids)) + [1] * (len(s) + 1)
        return ids, mask

    def batch(self, max_len: int, tokens: int, copy_share: float, mix: dict[str, float], with_sources: bool = False):
        """Sequences of about `tokens` tokens in all: input ids, labels, first-answer labels, tasks
        and, `with_sources`, a (2, batch, T) tensor of attention targets per position: its copy
        source (`answer_sources`) and its record's key (`key_sources`); -1 where none."""
        import torch

        seqs = []
        tasks = []
        total = 0
        names, weights = list(mix), list(mix.values())
        while total < tokens:
            if self.rng.random() < copy_share:
                ids, mask = self.copy_sequence()
                tasks.append("copy")
            elif self.rng.random() < self.recall_share:
                ids, mask = self.recall_sequence(self.rng.randint(max(64, max_len // 2), max_len))
                tasks.append("recall")
            else:
                task = self.rng.choices(names, weights)[0]
                low, high = (max(64, max_len // 2), max_len) if task not in RECITE_TASKS else RECITE_CONTEXT
                ids, mask = self.task_sequence(task, self.rng.randint(low, high))
                tasks.append(task)
            seqs.append((ids, mask))
            total += len(ids)
        width = max(len(i) for i, _ in seqs)
        input_ids = torch.full((len(seqs), width), self.pad, dtype=torch.long)
        labels = torch.full((len(seqs), width), -100, dtype=torch.long)
        first = torch.full((len(seqs), width), -100, dtype=torch.long)
        for row, (ids, mask) in enumerate(seqs):
            t = torch.tensor(ids)
            input_ids[row, : len(ids)] = t
            m = torch.tensor(mask)
            labels[row, : len(ids) - 1] = torch.where(m > 0, t, -100)[1:]  # predict token i+1 at position i
            first[row, : len(ids) - 1] = torch.where(m == 1, t, -100)[1:]
        if not with_sources:
            return input_ids, labels, first, tasks
        sources = torch.full((2, len(seqs), width), -1, dtype=torch.long)
        for row, ((ids, mask), task) in enumerate(zip(seqs, tasks)):
            for position, source in answer_sources(ids, mask, preceding=0 if task == "copy" else 2).items():
                sources[0, row, position] = source
            keys = self.recite_key_sources(ids, mask) if task in RECITE_TASKS else self.key_sources(ids)
            for position, source in keys.items():
                sources[1, row, position] = source
        return input_ids, labels, first, tasks, sources

    def key_sources(self, ids: list[int]) -> dict[int, int]:
        """For each token of a record after its key ("for apple is 4729." and the answer prefix with
        its answer alike), the key's position: where a first-layer head should look so that every
        digit carries the name of its record."""
        out: dict[int, int] = {}
        for i in range(len(ids) - 1):
            if ids[i] == self.for_id and ids[i + 1] in self.key_id_set:
                for j in range(i + 2, min(len(ids), i + 9)):
                    out[j] = i + 1
                    if ids[j] in self.record_ends:
                        break
        return out


    def recite_key_sources(self, ids: list[int], mask: list[int]) -> dict[int, int]:
        """For a recitation, every position after the list's first key, in the context and from
        the answer prefix's key on, points at the last record key strictly before it.

        Inside a record that is its own key, as :meth:`key_sources` says; from a record's "The"
        to its key it is the previous record's key. So the position of each key carries the name
        of the record before it, and the answer's "for", which knows only the record just
        recited, finds the next key by matching that name: the step from one record to the next
        that a copy by the current token alone cannot make ("for" is in every record).
        """
        out: dict[int, int] = {}
        context_end = next(i for i, m in enumerate(mask) if m > 0)
        context_end = max(i for i in range(context_end) if ids[i] == self.question_id)
        last = None
        for i, token in enumerate(ids):
            if i == context_end:
                last = None  # the question names no record; the answer prefix's key starts again
            if last is not None:
                out[i] = last
            if token in self.key_id_set and i > 0 and ids[i - 1] == self.for_id:
                last = i
        return out


def cooldown_factor(step: int, steps: int, cooldown: int) -> float:
    """Learning-rate factor: 1 until the last `cooldown` steps, then falling linearly to 5%
    (a constant rate leaves the answers a few points short of what the weights can do)."""
    if cooldown <= 0 or step < steps - cooldown:
        return 1.0
    return max(0.05, (steps - step) / cooldown)


def retrieval_loss(weights, sources, floor: float = 1e-6):
    """Mean −log of the attention that positions pay to their target (`sources`, -1: none).

    `weights` (batch, T, T) are one head's attention weights. Telling a last-layer head where the
    answer's token stands, and a first-layer head where a record's key stands, gives the
    key-matching circuit a gradient of its own from the first step, instead of only through a
    copy that works once the match does (the plateau multi-key runs stalled on). `floor` is added
    to each weight before the log: a weight far below it gets almost no gradient, so a head that
    must learn a pattern it does not show at all (a key position attending to the previous key)
    needs a floor far below its current weight (``--attention-floor 1e-30``)."""
    import torch

    rows, positions = torch.nonzero(sources >= 0, as_tuple=True)
    if rows.numel() == 0:
        return weights.sum() * 0.0
    picked = weights[rows, positions, sources[rows, positions]]
    return -torch.log(picked + floor).mean()


def answer_runs(mask: list[int]) -> list[tuple[int, int]]:
    """(start, length) of each maximal run of answer positions (mask > 0)."""
    runs, start = [], None
    for i, m in enumerate(mask + [0]):
        if m > 0 and start is None:
            start = i
        elif m == 0 and start is not None:
            runs.append((start, i - start))
            start = None
    return runs


def answer_sources(ids: list[int], mask: list[int], preceding: int = 2) -> dict[int, int]:
    """For each position that predicts an answer token, where that token stands in the context.

    An answer (its final end-of-sequence token aside) is a copy of a span of the context: the
    asked record's value, preceded there by the same `preceding` tokens as the answer is in its
    question ("apple is"). Only answers whose span is found exactly once outside other answers
    get sources (multi-value and variable-tracking answers are not a copy of one span and get
    none). Position i predicts token i + 1, so the position before the answer's j-th token maps
    to the span's j-th position.
    """
    out: dict[int, int] = {}
    for start, length in answer_runs(mask):
        span = ids[start : start + length - 1]
        before = ids[start - preceding : start]
        if not span or start < preceding:
            continue
        found = [c for c in range(preceding, start - len(span) + 1)
                 if ids[c : c + len(span)] == span and ids[c - preceding : c] == before and mask[c] == 0]
        if len(found) == 1:
            out.update({start - 1 + j: found[0] + j for j in range(len(span))})
    return out


def answer_accuracy(logits, labels) -> tuple[int, int]:
    """Count answers (maximal runs of labelled positions) whose every token is predicted right."""
    import torch

    m = (labels != -100).flatten()
    if m.numel() == 0:
        return 0, 0
    wrong = ((logits.argmax(-1) != labels).flatten() & m).long()
    # Each row ends with an unlabelled position, so runs never cross rows when flattened.
    starts = m & ~torch.cat([torch.zeros(1, dtype=torch.bool), m[:-1]])
    segment = torch.cumsum(starts.long(), 0) - 1
    n = int(starts.sum())
    if n == 0:
        return 0, 0
    errors = torch.zeros(n, dtype=torch.long).index_add_(0, segment[m], wrong[m])
    return int((errors == 0).sum()), n


def train(args) -> Path:
    import torch
    from transformers import AutoTokenizer

    from certkv.model.embedded_tokenizer import EMBEDDED_DIR, save_tokenizer

    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if not (EMBEDDED_DIR / "tokenizer.json").is_file():  # the shipped one is kept as it is
        save_tokenizer(EMBEDDED_DIR)
    tok = AutoTokenizer.from_pretrained(EMBEDDED_DIR)
    config = model_config(len(tok), tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, args.layers, args.heads, args.kv_heads)
    ckpt_path = out / "checkpoint.pt"

    supervise = args.retrieval_supervision > 0
    if supervise:
        config._attn_implementation = "eager"  # the supervised heads' attention weights are needed

    def fresh(seed: int):
        model = new_model(config, seed, shared_vector=args.shared_vector == "init")
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.98))
        state = {"seed": seed, "step": 0, "stage": 0, "since_start": 0, "history": []}
        if args.shared_vector == "init":
            state["shared_vector_added"] = 0  # at initialisation; on-match must not add it again
        return model, opt, state

    if ckpt_path.exists():
        ckpt = torch.load(ckpt_path, weights_only=False)
        check_heads(ckpt, config, ckpt_path, "resume it")
        model, opt, state = fresh(ckpt["state"]["seed"])
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        state = ckpt["state"]
        log(f"resumed from {ckpt_path} at step {state['step']} (seed {state['seed']}, stage {state['stage']})")
    elif args.init_from_shipped:
        model, opt, state = from_shipped(fresh, args.seed)
        log(f"new run from the shipped weights (sha256 {state['init_from_shipped'][:12]}), fresh optimizer, length 576")
    elif args.grow_from:
        model, opt, state = grown(args.grow_from, fresh)
        log(f"grown from {args.grow_from} to {args.layers} layers at step {state['step']} (new layers start as identities)")
    else:
        model, opt, state = fresh(args.seed)
        n_params = sum(p.numel() for p in model.parameters())
        log(f"new run seed {args.seed}: {n_params} parameters")
    def batcher_for(seed: int, step: int) -> Batcher:
        return Batcher(tok, seed * 100003 + step, dense=args.dense, recall_share=args.recall_share,
                       lookalike_share=args.lookalike_share)

    batcher = batcher_for(state["seed"], state["step"])

    window: list[tuple[int, int]] = []
    recite_window: list[tuple[int, int]] = []  # (answers recited right token for token, answers) per step
    t0 = time.time()
    model.train()
    while state["step"] < args.steps:
        stage = state["stage"]
        max_len = CURRICULUM[stage]
        # "Learning" means multi-key retrieval has started: single-needle alone is easy and says
        # nothing about the key-matching circuit, so only multi-key accuracy counts.
        learning = state.get("multi_key_matching", False)
        copy_share = 0.3 if not learning else args.copy_share
        needle = args.needle_share
        mix = {"multi_key": 1.0 - needle, "single_needle": needle}
        if stage >= 4:
            mix = {"multi_key": 0.85 - needle, "single_needle": needle, "dilution": 0.05, "variable_tracking": 0.05,
                   "multi_value": 0.05}
        if args.recite_share > 0:
            mix = {**{t: w * (1 - args.recite_share) for t, w in mix.items()}, "recite": args.recite_share}
        input_ids, labels, first_labels, tasks, *targets = batcher.batch(
            max_len, args.tokens_per_step, copy_share, mix, with_sources=supervise)
        warm = min(1.0, (state["since_start"] + 1) / args.warmup) * cooldown_factor(state["step"], args.steps, args.cooldown)
        for g in opt.param_groups:
            g["lr"] = args.lr * warm
        output = model(input_ids=input_ids, output_attentions=supervise)
        logits = output.logits
        loss = torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1), ignore_index=-100)
        if supervise:
            copy_targets, key_targets = targets[0]
            floor = args.attention_floor
            loss = loss + args.retrieval_supervision * (retrieval_loss(output.attentions[-1][:, 0], copy_targets, floor)
                                                        + retrieval_loss(output.attentions[0][:, 0], key_targets, floor))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        state["step"] += 1
        state["since_start"] += 1
        with torch.no_grad():
            task_rows = [i for i, t in enumerate(tasks) if t not in ("copy", "recall") and args.advance_on in ("all", t)]
            mk_rows = [i for i, t in enumerate(tasks) if t == "multi_key"]
            # Only the first question of a multi-key sequence measures key matching: later ones can
            # be half-solved by elimination ("a record not asked yet"), which plateaus near 0.6.
            window.append(
                (answer_accuracy(logits[task_rows], labels[task_rows]),
                 answer_accuracy(logits[mk_rows], first_labels[mk_rows]))
            )
            recite_rows = [i for i, t in enumerate(tasks) if t in RECITE_TASKS]
            recite_window = ([*recite_window, answer_accuracy(logits[recite_rows], labels[recite_rows])]
                             if recite_rows else recite_window)[-args.window :]
        window = window[-args.window :]
        acc = sum(c for (c, _), _ in window) / max(1, sum(t for (_, t), _ in window))
        mk_acc = sum(c for _, (c, _) in window) / max(1, sum(t for _, (_, t) in window))
        recite_acc = sum(c for c, _ in recite_window) / max(1, sum(t for _, t in recite_window))
        if mk_acc > 0.6 and len(window) == args.window:
            state["multi_key_matching"] = True
        if args.shared_vector == "on-match" and state.get("multi_key_matching") and "shared_vector_added" not in state:
            # Key matching forms sooner without the shared vector, but copying the digits after
            # the first needs position heads (match the last few tokens, not the last one), which
            # the shared vector makes possible: add it once matching has started.
            add_shared_vector(model, state["seed"], args.shared_vector_scale)
            state["shared_vector_added"] = state["step"]
            log(f"step {state['step']}: multi-key matching started; shared vector added (scale {args.shared_vector_scale})")
        if state["step"] % args.log_every == 0:
            log(
                f"step {state['step']} len {max_len} loss {loss.item():.4f} acc {acc:.3f} multi_key_first {mk_acc:.3f} "
                f"lr {args.lr * warm:.2e} {time.time() - t0:.0f}s"
                + (f" recite {recite_acc:.3f}" if recite_window else "")
            )
            state["history"].append({"step": state["step"], "len": max_len, "loss": loss.item(), "acc": acc, "multi_key": mk_acc,
                                     **({"recite": recite_acc} if recite_window else {})})
        if len(window) == args.window and acc > args.advance_at and stage < len(CURRICULUM) - 1:
            state["stage"] += 1
            window = []
            log(f"step {state['step']}: accuracy {acc:.3f} > {args.advance_at}; context length -> {CURRICULUM[state['stage']]}")
        if not state.get("multi_key_matching") and "grown_from" not in state and state["since_start"] >= args.patience:
            new_seed = state["seed"] + 1
            log(f"step {state['step']}: not learning after {args.patience} steps (acc {acc:.3f}); restart with seed {new_seed}")
            step = state["step"]
            model, opt, state = fresh(new_seed)
            state["step"] = step
            batcher = batcher_for(new_seed, step)
            window = []
        if state["step"] % args.checkpoint_every == 0:
            save_checkpoint(ckpt_path, model, opt, state)
    save_checkpoint(ckpt_path, model, opt, state)
    if args.no_export:
        log(f"done; not exported (--no-export): python tools/train_embedded.py --out {out} --export-only")
    else:
        export(model, tok)
    return ckpt_path


def from_shipped(fresh, seed: int):
    """The shipped weights (``certkv/embedded/model.safetensors``) to fine-tune, with a fresh
    optimizer and its warm-up, at the last curriculum length, matching counted as started (so the
    run is never restarted from a random initialisation and the copy share is ``--copy-share``)."""
    import hashlib

    from safetensors.torch import load_file

    from certkv.model.embedded_tokenizer import EMBEDDED_DIR

    weights = EMBEDDED_DIR / "model.safetensors"
    model, opt, state = fresh(seed)
    shipped = load_file(str(weights))
    if "lm_head.weight" not in shipped:  # tied embeddings: saved once
        shipped["lm_head.weight"] = shipped["model.embed_tokens.weight"]
    model.load_state_dict(shipped)
    state.update({"stage": len(CURRICULUM) - 1, "multi_key_matching": True,
                  "init_from_shipped": hashlib.sha256(weights.read_bytes()).hexdigest()})
    return model, opt, state


def grown(source: str, fresh):
    """A deeper model that computes exactly what `source`'s checkpoint computes, to train on.

    The checkpoint's layers are copied and the extra layers appended after them with their output
    projections (attention ``o_proj`` and MLP ``down_proj``) zeroed, so each adds nothing to the
    residual stream until training gives it something to add: a model stuck with too few layers
    keeps everything it learned. The optimizer starts afresh (with its warm-up); step, stage and
    history continue. A grown run is never restarted from a fresh seed (that would throw the
    source's learning away).
    """
    import torch

    ckpt = torch.load(Path(source) / "checkpoint.pt", weights_only=False)
    model, opt, state = fresh(ckpt["state"]["seed"])
    check_heads(ckpt, model.config, Path(source) / "checkpoint.pt", "grow it")
    old_layers = checkpoint_layers(ckpt["model"])
    layers = model.model.layers
    if len(layers) <= old_layers:
        raise SystemExit(f"--grow-from needs --layers above the checkpoint's {old_layers}")
    missing, unexpected = model.load_state_dict(ckpt["model"], strict=False)
    if unexpected or any(not k.startswith("model.layers.") for k in missing):
        raise SystemExit(f"{source}: the checkpoint does not match the model apart from its depth")
    with torch.no_grad():
        for layer in layers[old_layers:]:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    state.update({k: v for k, v in ckpt["state"].items() if k not in ("since_start",)})
    state["grown_from"] = {"source": str(source), "layers": old_layers, "step": ckpt["state"]["step"]}
    return model, opt, state


def check_heads(ckpt, config, path, action: str) -> None:
    """Refuse a checkpoint whose head counts differ from `config`'s.

    With the same ratio of query to key/value heads (4 / 2 and 8 / 4) every weight has the same
    shape, so loading would not fail: it would silently read the weights as another model.
    Checkpoints written before the config was saved hold 4 / 2 heads.
    """
    saved = ckpt.get("config", {})
    heads, kv_heads = saved.get("num_attention_heads", 4), saved.get("num_key_value_heads", 2)
    if (heads, kv_heads) != (config.num_attention_heads, config.num_key_value_heads):
        raise SystemExit(f"{path} holds a model with {heads} / {kv_heads} heads: {action} with"
                         f" --heads {heads} --kv-heads {kv_heads}")


def checkpoint_layers(state_dict) -> int:
    """How many decoder layers a checkpoint's model state holds."""
    return 1 + max(int(k.split(".")[2]) for k in state_dict if k.startswith("model.layers."))


def save_checkpoint(path: Path, model, opt, state) -> None:
    import torch

    from certkv.atomic_io import atomic_write

    # The config travels with the weights: export rebuilds exactly this shape (heads included).
    with atomic_write(path, "wb") as fh:
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "state": state,
                    "config": model.config.to_dict()}, fh)


def export(model, tok) -> None:
    """Write the weights, config and generation config into the package's embedded folder."""
    from certkv.model.embedded_tokenizer import EMBEDDED_DIR

    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.bos_token_id = tok.bos_token_id
    model.save_pretrained(EMBEDDED_DIR, safe_serialization=True)
    tok.save_pretrained(EMBEDDED_DIR)
    log(f"exported model and tokenizer to {EMBEDDED_DIR}")


def export_from_checkpoint(out: Path) -> None:
    import torch
    from transformers import AutoTokenizer, LlamaConfig

    from certkv.model.embedded_tokenizer import EMBEDDED_DIR

    tok = AutoTokenizer.from_pretrained(EMBEDDED_DIR)
    ckpt = torch.load(Path(out) / "checkpoint.pt", weights_only=False)
    if "config" in ckpt:
        config = LlamaConfig.from_dict(ckpt["config"])
    else:  # checkpoints written before the config was saved: 4 / 2 heads, depth from the weights
        config = model_config(len(tok), tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, checkpoint_layers(ckpt["model"]))
    model = new_model(config, 0, shared_vector=False)
    model.load_state_dict(ckpt["model"])
    export(model, tok)


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Train the embedded certkv model (resumable).")
    p.add_argument("--out", default="train_runs/embedded", help="checkpoint folder")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=6000)
    p.add_argument("--tokens-per-step", type=int, default=4000,
                   help="tokens per optimizer step (4000: three times the steps of 12000 for the same compute)")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--cooldown", type=int, default=0,
                   help="steps at the end of --steps over which the learning rate falls linearly to 5%%")
    p.add_argument("--window", type=int, default=20, help="steps in the running accuracy")
    p.add_argument("--advance-at", type=float, default=0.9)
    p.add_argument("--patience", type=int, default=6000,
                   help="steps before a run that is not learning restarts (the key-matching plateau can last"
                   " well over 1500 steps; restarting earlier throws away runs about to learn)")
    p.add_argument("--checkpoint-every", type=int, default=100)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4, help="query heads (head size 128 / heads)")
    p.add_argument("--kv-heads", type=int, default=2, help="key/value heads (GQA: fewer than --heads, dividing it)")
    p.add_argument("--recall-share", type=float, default=0.0,
                   help="share of bare key-value recall sequences (a warm-up for key matching)")
    p.add_argument("--needle-share", type=float, default=0.1, help="share of single-needle sequences")
    p.add_argument("--advance-on", default="multi_key", choices=["all", "single_needle", "multi_key"],
                   help="which tasks' running accuracy advances the length curriculum")
    p.add_argument("--shared-vector", choices=["init", "on-match", "none"], default="none",
                   help="when to add the shared random vector to the embeddings: at initialisation, once"
                   " multi-key matching has started, or never")
    p.add_argument("--shared-vector-scale", type=float, default=0.5,
                   help="with --shared-vector on-match: its size relative to the embeddings' std")
    p.add_argument("--lookalike-share", type=float, default=0.5,
                   help="share of multi-key training contexts with look-alike values (shared 2-digit prefixes,"
                   " anagrams, or shared first and third digits; see tasks.multi_key): they force the asked key"
                   " into every digit's lookup, not only the first")
    p.add_argument("--dense", action="store_true", help="multi-key contexts of records only, no filler")
    p.add_argument("--copy-share", type=float, default=0.05,
                   help="share of repeat-a-random-string sequences once multi-key matching has started (0.3 before)")
    p.add_argument("--grow-from", default=None,
                   help="start a new run (empty --out) from this run folder's checkpoint with --layers layers:"
                   " the extra layers are appended as identities")
    p.add_argument("--retrieval-supervision", type=float, default=1.0,
                   help="weight of the attention loss that tells one last-layer head where each answer token stands"
                   " in the context and one first-layer head where each record token's key stands (0: none)")
    p.add_argument("--attention-floor", type=float, default=1e-6,
                   help="added to a supervised attention weight before its log: below it the weight gets almost no"
                   " gradient (1e-30 lets a head learn a pattern it shows not at all, as a fine-tune needs)")
    p.add_argument("--export-only", action="store_true", help="export the checkpoint's weights and stop")
    p.add_argument("--no-export", action="store_true",
                   help="leave certkv/embedded/ as it is when the run ends (export later with --export-only)")
    p.add_argument("--init-from-shipped", action="store_true",
                   help="start a new run (empty --out) from the shipped weights with a fresh optimizer, at the last"
                   " curriculum length, instead of a random initialisation (to fine-tune, e.g. with --recite-share)")
    p.add_argument("--recite-share", type=float, default=0.0,
                   help="share of the task sequences that are the long-output recite task (the rest keeps the"
                   " retrieval mix, rehearsed); 0: the retrieval recipe alone")
    args = p.parse_args(argv)
    try:
        check_shape(args.heads, args.kv_heads)
    except ValueError as error:
        p.error(str(error))
    if args.export_only:
        export_from_checkpoint(Path(args.out))
        return
    train(args)


if __name__ == "__main__":
    sys.exit(main())
