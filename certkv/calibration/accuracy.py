"""Full-KV accuracy of a model on a request set, per task."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence

from rich.console import Console
from rich.progress import track
from rich.table import Table
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from certkv.calibration.utility import score
from certkv.core.spec import DEFAULT_MAX_NEW_TOKENS
from certkv.model.generation import full_kv_answer
from certkv.requests.request_set import Request


def full_kv_accuracy(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    requests: Sequence[Request],
    utility: str = "exact_match",
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    progress: bool = True,
) -> dict[str, tuple[int, float]]:
    """Return {task: (n, mean utility)} with an `all` row, answering each request on the full cache."""
    scores: dict[str, list[float]] = defaultdict(list)
    iterator: Iterable[Request] = requests
    if progress:
        iterator = track(requests, description="answering", transient=True)
    for r in iterator:
        answer = full_kv_answer(model, tokenizer, r.context, r.question, max_new_tokens)
        s = score(utility, answer, r.answers, answer)
        scores[r.task].append(s)
        scores["all"].append(s)
    return {task: (len(v), sum(v) / len(v)) for task, v in scores.items()}


def print_accuracy_table(table: Mapping[str, tuple[int, float]], title: str) -> None:
    """Print the table of :func:`full_kv_accuracy` (one row per task, `all` last) under `title`."""
    t = Table(title=title)
    t.add_column("task")
    t.add_column("n", justify="right")
    t.add_column("accuracy", justify="right")
    for task in sorted(table, key=lambda k: (k == "all", k)):
        n, acc = table[task]
        t.add_row(task, str(n), f"{acc:.3f}")
    Console().print(t)
