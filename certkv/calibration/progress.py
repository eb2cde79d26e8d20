"""The calibration progress bar, shared by the local run and the Ray driver.

Both executors show the same bar (requests done, requests per second, time left) so that a user
reads a Ray run like a local one.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Literal

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    Task,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.text import Text


class _NoProgress:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> Literal[False]:
        return False


class _RateColumn(TextColumn):
    def render(self, task: Task) -> Text:  # requests per second, from rich's own speed estimate
        speed = task.finished_speed or task.speed
        return Text(f"{speed:.2f} req/s" if speed else "… req/s")


def progress_bar(quiet: bool, console: Console | None, workers: bool = False) -> AbstractContextManager[Progress | None]:
    """The calibration progress bar (requests done, req/s, ETA) on `console`, or a context that
    yields None when `quiet`; `workers` adds the task's ``workers`` field (the loaded workers of a Ray run)."""
    if quiet:
        return _NoProgress()
    columns: list[ProgressColumn] = [
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        _RateColumn(""),
        TimeElapsedColumn(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
    ]
    if workers:
        columns.append(TextColumn("workers {task.fields[workers]}"))
    return Progress(*columns, console=console)
