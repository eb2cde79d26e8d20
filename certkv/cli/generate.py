"""`certkv generate`: write a built-in request set to JSONL."""

from __future__ import annotations

from pathlib import Path

import typer

from certkv.errors import CertkvError
from certkv.requests.builtin_tasks import MIXES, TASKS

#: The tasks the embedded model answers at full KV: the `demo` mix holds exactly those, and the
#: model fails the others even then (tests/requests/test_tasks.py checks both against the measured table,
#: benchmarks/results/embedded_accuracy.json).
_ANSWERED = list(MIXES["demo"])
_UNANSWERED = [task for task in TASKS if task not in MIXES["demo"]]
SOURCE_HELP = (
    "builtin:<mix> or builtin:<task>=<weight>,... (e.g. builtin:multi_key=2,single_needle=1). "
    f"Mixes: demo = {', '.join(_ANSWERED)}, the tasks the embedded model answers with the full cache; "
    f"all = every task, adding {', '.join(_UNANSWERED)}, which the embedded model fails even with the "
    "full cache, so on it they measure nothing for eviction (they are for larger models); "
    "ruler = the RULER families and reading comprehension in natural English, for real models "
    "(512-8192 model tokens); the long-output tasks recite_steps, recite_diary and summarise_story "
    "answer in 100-250 tokens, for real models (640-4096 model tokens)"
)


def generate(
    source: str = typer.Argument(..., metavar="SOURCE", help=SOURCE_HELP),
    n: int = typer.Option(1200, "--n", help="number of requests"),
    seed: int = typer.Option(0, "--seed", help="seed; request i depends only on (seed, i)"),
    context_length: str | None = typer.Option(
        None, "--context-length",
        help="tokens, e.g. 512 or 256-512: 64-2048, default 256-512 (ruler tasks: 512-8192, 512-1024; "
        "long-output tasks: 640-4096, 640-960)",
    ),
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
