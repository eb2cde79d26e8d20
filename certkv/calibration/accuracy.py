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
        answer = full_kv_answer(model, tokenizer, r.context, r.question, max_new_tokens, r.answer_prefix)
        s = score(utility, answer, r.answers, answer)
        scores[r.task].append(s)
        scores["all"].append(s)
    return {task: (len(v), sum(v) / len(v)) for task, v in scores.items()}


#: Below this full-cache accuracy a task is reported as one the model fails: a certificate on it
#: protects little, since most of its requests are wrong before any eviction (loss 0 either way).
FAILING_ACCURACY = 0.5


def failing_tasks(table: Mapping[str, tuple[int, float]]) -> list[str]:
    """The tasks of :func:`full_kv_accuracy`'s table (not ``all``) the model fails with the full cache."""
    return sorted(task for task, (_, acc) in table.items() if task != "all" and acc < FAILING_ACCURACY)


def print_accuracy_table(table: Mapping[str, tuple[int, float]], title: str) -> None:
    """Print the table of :func:`full_kv_accuracy` (one row per task, `all` last) under `title`,
    each task the model fails (accuracy below :data:`FAILING_ACCURACY`) marked and named below."""
    failing = failing_tasks(table)
    t = Table(title=title)
    t.add_column("task")
    t.add_column("n", justify="right")
    t.add_column("accuracy", justify="right")
    t.add_column("full cache")
    for task in sorted(table, key=lambda k: (k == "all", k)):
        n, acc = table[task]
        verdict = "" if task == "all" else ("fails" if task in failing else "answers")
        t.add_row(task, str(n), f"{acc:.3f}", verdict)
    console = Console()
    console.print(t)
    if failing:
        console.print(
            f"the model fails {len(failing)} task(s) with the full cache (accuracy below {FAILING_ACCURACY}): "
            f"{', '.join(failing)}; certify on the tasks it answers"
        )
