"""The calibration progress bar, shared by the local run and the Ray driver.

Both executors show the same bar (requests done, requests per second, time left) so that a user
reads a Ray run like a local one; rich is imported only when a bar is shown.
"""

from __future__ import annotations


class _NoProgress:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def progress_bar(quiet: bool, console, workers: bool = False):
    """The calibration progress bar (requests done, req/s, ETA) on `console`, or a context that
    yields None when `quiet`; `workers` adds the task's ``workers`` field (live workers of a Ray run)."""
    if quiet:
        return _NoProgress()
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    class RateColumn(TextColumn):
        def render(self, task):  # requests per second, from rich's own speed estimate
            from rich.text import Text

            speed = task.finished_speed or task.speed
            return Text(f"{speed:.2f} req/s" if speed else "… req/s")

    columns = [
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        RateColumn(""),
        TimeElapsedColumn(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
    ]
    if workers:
        columns.append(TextColumn("workers {task.fields[workers]}"))
    return Progress(*columns, console=console)
