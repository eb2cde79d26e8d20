"""`certkv generate`: write a built-in request set to JSONL."""

from __future__ import annotations

from pathlib import Path

import typer

from certkv.errors import CertkvError


def generate(
    source: str = typer.Argument(..., help="builtin:<mix>, e.g. builtin:demo, builtin:all, builtin:multi_key=2,single_needle=1"),
    n: int = typer.Option(1200, "--n", help="number of requests"),
    seed: int = typer.Option(0, "--seed", help="seed; request i depends only on (seed, i)"),
    context_length: str = typer.Option("256-512", "--context-length", help="tokens, e.g. 512 or 256-512 (64-2048)"),
    output: Path = typer.Option(..., "-o", "--output", help="JSONL file to write"),
) -> None:
    """Generate a deterministic request set from the built-in long-context tasks."""
    from collections import Counter

    from certkv.requests.request_set import generate_requests, write_jsonl

    if not source.startswith("builtin:"):
        raise CertkvError(f"source {source!r} is not a built-in mix; use builtin:<mix>, e.g. builtin:demo")
    requests = generate_requests(source.removeprefix("builtin:"), n, seed, context_length)
    count = write_jsonl(requests, output)
    tasks = ", ".join(f"{t} {c}" for t, c in sorted(Counter(r.task for r in requests).items()))
    typer.echo(f"wrote {count} requests to {output} ({tasks})")
