"""Full-KV accuracy of a model on a request set, per task."""

from __future__ import annotations

from collections import defaultdict

from certkv.core.spec import DEFAULT_MAX_NEW_TOKENS


def full_kv_accuracy(
    model, tokenizer, requests, utility: str = "exact_match", max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, progress=True
):
    """Return {task: (n, mean utility)} with an `all` row, answering each request on the full cache."""
    from certkv.calibration.utility import score
    from certkv.model.generation import full_kv_answer

    scores: dict[str, list[float]] = defaultdict(list)
    iterator = requests
    if progress:
        from rich.progress import track

        iterator = track(requests, description="answering", transient=True)
    for r in iterator:
        answer = full_kv_answer(model, tokenizer, r.context, r.question, max_new_tokens)
        s = score(utility, answer, r.answers, answer)
        scores[r.task].append(s)
        scores["all"].append(s)
    return {task: (len(v), sum(v) / len(v)) for task, v in scores.items()}


def print_accuracy_table(table, title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=title)
    t.add_column("task")
    t.add_column("n", justify="right")
    t.add_column("accuracy", justify="right")
    for task in sorted(table, key=lambda k: (k == "all", k)):
        n, acc = table[task]
        t.add_row(task, str(n), f"{acc:.3f}")
    Console().print(t)
