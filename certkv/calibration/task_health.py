"""Tasks that measure nothing: the model fails them even with the full cache.

A request's loss is ``utility(full) − utility(policy)``. On a task whose full-cache utility is 0
on every request, no eviction policy can lose anything, so its requests are never violated: they
add to the certificate's n without testing eviction at all, and dilute the measured risk of the
tasks that do test it. ``certkv calibrate`` warns about such tasks, read from the store's
full-cache records (nothing here knows which model fails which task).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from certkv.calibration.store import CalibrationStore, db_path


@dataclass(frozen=True)
class FailedTask:
    """A task with full-cache utility 0 on all of its `requests` stored requests."""

    task: str
    requests: int


def tasks_failed_at_full_cache(store: str | Path) -> list[FailedTask]:
    """Tasks of the store whose full-cache utility is 0 on every stored request, by task name.

    Requests without a task label are left out (nothing to name). A store that does not exist yet
    has no such task.
    """
    if not db_path(store).is_file():
        return []
    with CalibrationStore.read(store) as opened:
        rows = opened.full_cache_utility_by_task()
    return [FailedTask(task, count) for task, count, best in rows if best is not None and best <= 0.0]


def failed_task_warnings(store: str | Path, model: str) -> list[str]:
    """One warning line per task that measures nothing for eviction (empty when there is none)."""
    hint = "remove it from the request set" + (
        " (builtin:demo holds the tasks the embedded model answers)" if model == "embedded" else ""
    )
    lines = []
    for failed in tasks_failed_at_full_cache(store):
        where = "its only request" if failed.requests == 1 else f"all {failed.requests} of its requests"
        lines.append(
            f"warning: task {failed.task} measures nothing for eviction because the model fails it even "
            f"with the full cache (utility 0 on {where}); no policy can lose anything on it, so it only "
            f"dilutes the measured risk; {hint}"
        )
    return lines
