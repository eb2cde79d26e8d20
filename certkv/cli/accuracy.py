"""`certkv accuracy`: the model's full-KV accuracy per task on a request set."""

from __future__ import annotations

import typer

from certkv.core.spec import DEFAULT_MAX_NEW_TOKENS


def accuracy(
    source: str = typer.Argument(..., help="a JSONL request file or builtin:<mix>"),
    model: str = typer.Option("embedded", "--model", help="embedded, smollm2-135m, a .gguf file, a folder or a hub id"),
    n: int = typer.Option(0, "--n", help="use at most this many requests (0: all; builtin default 1200)"),
    seed: int = typer.Option(0, "--seed", help="seed for builtin sources"),
    context_length: str | None = typer.Option(
        None, "--context-length", help="for builtin sources: 64-2048, default 256-512 (ruler tasks: 512-8192, default 512-1024)"
    ),
    utility: str = typer.Option("exact_match", "--utility", help="exact_match, contains, f1 or rouge_l"),
    max_new_tokens: int = typer.Option(DEFAULT_MAX_NEW_TOKENS, "--max-new-tokens"),
    device: str = typer.Option("auto", "--device"),
    dtype: str = typer.Option("auto", "--dtype"),
) -> None:
    """Answer every request with the full KV cache and print accuracy per task."""
    from certkv.calibration.accuracy import full_kv_accuracy, print_accuracy_table
    from certkv.model.loading import load_model
    from certkv.requests.request_set import load_requests

    requests = load_requests(source, limit=n or None, seed=seed, context_length=context_length)
    lm, tokenizer = load_model(model, device=device, dtype=dtype)
    table = full_kv_accuracy(lm, tokenizer, requests, utility=utility, max_new_tokens=max_new_tokens)
    print_accuracy_table(table, title=f"full-KV {utility} of {model} on {source}")
