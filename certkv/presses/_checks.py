"""Argument checks shared by certkv's presses: a wrong setting fails at construction, in one line."""

from __future__ import annotations

from kvpress.presses.scorer_press import ScorerPress


def check_ratio(value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
        raise ValueError(f"compression_ratio must be a number in [0, 1), got {value!r}")


def check_count(name: str, value: object, minimum: int = 0) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer ≥ {minimum}, got {value!r}")


def check_base_press(value: object) -> None:
    if not isinstance(value, ScorerPress):
        raise ValueError(f"base_press must be a kvpress ScorerPress (its score() gives the sizes), got {type(value).__name__}")
