"""Calibration requests: the record type, the built-in generator and JSONL input/output.

A request is ``{id, task, context, question, answers}``, with an optional ``answer_prefix`` and
``metadata``. Request sets are JSONL files (one request
per line) or ``builtin:<mix>`` specifications generated on the fly from a seed.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable
from pathlib import Path
from typing import cast

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from certkv.atomic_io import atomic_write
from certkv.errors import CertkvError, format_validation_error
from certkv.requests.builtin_tasks import (
    ALL_TASKS,
    CONTEXT_RANGES,
    LONG_TASKS,
    MIXES,
    MULTI_QUESTION_TASKS,
    NATURAL_MULTI_QUESTION_TASKS,
    QUESTIONS_PER_CONTEXT,
    TASKS,
)
from certkv.requests.long_tasks import NATURAL_LONG_TASKS
from certkv.requests.natural_tasks import NATURAL_TASKS, split_answer_prefix


class Request(BaseModel):
    """One calibration request; `answers` lists every acceptable answer. `answer_prefix` is text
    the answer starts with, placed after the question as the start of the model's own turn (after
    a chat template's assistant header; RULER's "The special magic number ... is"): a chat model
    continues a prefix there, where inside the question it tends to restate it. `metadata` holds
    any other labels of the request (a contract may certify per value of one: ``strata.by``).
    `group` names the context group of a request that shares its context with others by
    something other than identical text (:mod:`certkv.requests.context_groups`)."""

    model_config = ConfigDict(extra="forbid")

    id: str = Field(min_length=1)
    task: str = "unknown"
    context: str
    question: str
    answers: list[str]
    answer_prefix: str = ""
    metadata: dict[str, str | int | float | bool] = Field(default_factory=dict)
    group: str = ""

    def as_record(self) -> dict:
        """The request as written to JSONL and hashed: ``answer_prefix``, ``metadata`` and ``group``
        only when they hold something, so request files and store digests made before they existed
        are unchanged."""
        empty = {name for name in ("answer_prefix", "metadata", "group") if not getattr(self, name)}
        return self.model_dump(exclude=empty or None)


def stratum_of(request: Request, by: str) -> str | None:
    """The request's value of the strata field `by` (``task`` or ``metadata.<key>``) as text; None
    when the request does not give it (a task left to its default counts as not given)."""
    if by == "task":
        return request.task if "task" in request.model_fields_set else None
    value = request.metadata.get(by.removeprefix("metadata."))
    return None if value is None else str(value)


def check_strata(requests: list[Request], by: str) -> list[str]:
    """Each request's stratum under `by`, or a one-line error: a field no request has, a request
    without it, an empty value."""
    values = [stratum_of(r, by) for r in requests]
    if values and all(v is None for v in values):
        keys = sorted({k for r in requests for k in r.metadata})
        offered = ", ".join(["task", *(f"metadata.{k}" for k in keys)])
        raise CertkvError(f"strata.by {by!r}: no request has this field; requests offer: {offered}")
    missing = [r.id for r, v in zip(requests, values) if v is None]
    if missing:
        raise CertkvError(
            f"strata.by {by!r}: request {missing[0]!r} does not give it ({len(missing)} of {len(requests)} "
            "requests lack it); give every request a value or stratify by another field"
        )
    given = cast("list[str]", values)  # no value is None past the check above
    empty = [r.id for r, v in zip(requests, given) if not v.strip()]
    if empty:
        raise CertkvError(f"strata.by {by!r}: request {empty[0]!r} has an empty value; every stratum needs a name")
    return given


def parse_mix(spec: str) -> dict[str, float]:
    """Parse a mix: a named mix (`demo`, `all`), a task name, or `task=weight,task=weight`."""
    spec = spec.strip()
    if spec in MIXES:
        return dict(MIXES[spec])
    weights: dict[str, float] = {}
    for part in spec.split(","):
        name, _, weight = part.strip().partition("=")
        name = name.strip()
        if name not in ALL_TASKS:
            known = ", ".join([*MIXES, *ALL_TASKS])
            raise CertkvError(f"unknown task or mix {name!r} in {spec!r}; use one of: {known}")
        try:
            w = float(weight) if weight else 1.0
        except ValueError:
            raise CertkvError(f"weight {weight!r} of task {name!r} is not a number") from None
        if w <= 0:
            raise CertkvError(f"weight of task {name!r} must be positive, got {w}")
        weights[name] = w
    return weights


def _ranges_text() -> str:
    """The allowed spans, one per family of tasks, as an error message names them."""
    spans: dict[tuple[int, int], list[str]] = {}
    for name, span in CONTEXT_RANGES.items():
        spans.setdefault(span, []).append(name)
    def family(names: list[str]) -> str:
        if set(names) <= {*TASKS, "multi_question"}:
            return "embedded tasks"
        if set(names) <= set(NATURAL_LONG_TASKS):
            return "natural-English long-output tasks"
        return ", ".join(names) if set(names) <= set(LONG_TASKS) else "natural-English ruler tasks"

    return " or ".join(f"{low}-{high} tokens ({family(names)})" for (low, high), names in spans.items())


def _mix_range(tasks: Iterable[str]) -> tuple[int, int, str]:
    """(low, high, which tasks) of the lengths every task of a mix allows; an empty span is an error."""
    names = sorted(tasks)
    low = max(CONTEXT_RANGES[t][0] for t in names)
    high = min(CONTEXT_RANGES[t][1] for t in names)
    spans = sorted({CONTEXT_RANGES[t] for t in names})
    what = f"task {names[0]}" if len(names) == 1 else ("this mix" if len(spans) == 1 else "every task of this mix")
    if low > high:
        detail = "; ".join(f"{', '.join(t for t in names if CONTEXT_RANGES[t] == span)}: {span[0]}-{span[1]}" for span in spans)
        raise CertkvError(f"the tasks of this mix allow no common context length ({detail}); generate them separately")
    return low, high, what


def parse_context_length(spec: str | int, tasks: Iterable[str] | None = None) -> tuple[int, int]:
    """Parse `512` or `256-512` into an inclusive (low, high) range within the supported span.

    With `tasks` (a mix's task names) the span is the one every task allows; without, any span of
    one family of tasks is accepted (a contract's lengths are checked before its mix is expanded)."""
    text = str(spec).strip()
    low_text, sep, high_text = text.partition("-")
    try:
        low = int(low_text)
        high = int(high_text) if sep else low
    except ValueError:
        raise CertkvError(f"context length {text!r} must be an integer or a range like 256-512") from None
    if tasks is not None:
        lo, hi, what = _mix_range(tasks)
        if not (lo <= low <= high <= hi):
            raise CertkvError(f"context length {text!r} must lie within {lo}-{hi} tokens for {what}, low <= high")
    elif not any(lo <= low <= high <= hi for lo, hi in set(CONTEXT_RANGES.values())):
        raise CertkvError(f"context length {text!r} must lie within {_ranges_text()}, low <= high")
    return low, high


#: A builtin mix's context lengths when none is given (model tokens), per family of tasks.
EMBEDDED_DEFAULT_CONTEXT_LENGTH = "256-512"
NATURAL_DEFAULT_CONTEXT_LENGTH = "512-1024"
LONG_DEFAULT_CONTEXT_LENGTH = "128-256"
NATURAL_LONG_DEFAULT_CONTEXT_LENGTH = "640-960"


def default_context_length(mix: str | dict[str, float]) -> str:
    """The context lengths of a builtin mix that gives none: 256-512 tokens for the embedded tasks,
    128-256 for the embedded long-output task (so that context and a 126-token answer stay short),
    512-1024 for the natural-English ruler tasks (the short end of their span, where a 135M model
    answers and a calibration of every press fits in a CPU session), 640-960 for the long-output
    tasks (prompts of a few hundred tokens: their cost is the long answer)."""
    weights = parse_mix(mix) if isinstance(mix, str) else mix
    if weights and set(weights) <= set(NATURAL_LONG_TASKS):
        return NATURAL_LONG_DEFAULT_CONTEXT_LENGTH
    if weights and set(weights) <= {*NATURAL_TASKS, *NATURAL_MULTI_QUESTION_TASKS}:
        return NATURAL_DEFAULT_CONTEXT_LENGTH
    if weights and set(weights) & set(LONG_TASKS):
        return LONG_DEFAULT_CONTEXT_LENGTH
    return EMBEDDED_DEFAULT_CONTEXT_LENGTH


def generate_requests(
    mix: str | dict[str, float], n: int, seed: int, context_length: str | int | tuple[int, int] | None = None
) -> list[Request]:
    """Generate `n` requests deterministically from `seed`.

    Draw j picks its task from the mix's weights and its context length uniformly from the range,
    and gives one request (a multi-question task: up to :data:`QUESTIONS_PER_CONTEXT` requests on
    the same context, each with a different question, all with the draw's ``group``); draw j
    depends only on (seed, j), so a larger `n` extends a smaller set. The range must be one every
    task of the mix allows (embedded tasks 64-2048, recite 64-256, natural ones 512-8192);
    None: :func:`default_context_length`.
    """
    weights = parse_mix(mix) if isinstance(mix, str) else dict(mix)
    if context_length is None:
        context_length = default_context_length(weights)
    if isinstance(context_length, tuple):
        low, high = parse_context_length(f"{context_length[0]}-{context_length[1]}", weights)
    else:
        low, high = parse_context_length(context_length, weights)
    if n < 1:
        raise CertkvError(f"--n must be at least 1, got {n}")
    names = sorted(weights)
    out: list[Request] = []
    draw = 0
    while len(out) < n:
        rng = random.Random(f"certkv/{seed}/{draw}")
        task = rng.choices(names, weights=[weights[t] for t in names])[0]
        sample = ALL_TASKS[task](rng, rng.randint(low, high))
        out.extend(_draw_requests(rng, task, sample, f"{task}-s{seed}-{draw:06d}"))
        draw += 1
    return out[:n]


def _draw_requests(rng: random.Random, task: str, sample, name: str) -> list[Request]:
    """The requests of one draw: one question of `sample`, or several on its context for a
    multi-question task (ids ``<name>-q<i>``, group `name`)."""
    if task not in MULTI_QUESTION_TASKS:
        question, answer = rng.choice(sample.qa)
        question, prefix = split_answer_prefix(question) if task in NATURAL_TASKS else (question, "")
        return [Request(id=name, task=task, context=sample.context, question=question, answers=[answer], answer_prefix=prefix)]
    asked = rng.sample(sample.qa, min(QUESTIONS_PER_CONTEXT, len(sample.qa)))
    out = []
    for i, (text, answer) in enumerate(asked):
        question, prefix = split_answer_prefix(text) if task in NATURAL_MULTI_QUESTION_TASKS else (text, "")
        out.append(Request(id=f"{name}-q{i}", task=task, context=sample.context, question=question, answers=[answer],
                           answer_prefix=prefix, group=name))
    return out


def write_jsonl(requests: Iterable[Request], path: Path) -> int:
    """Write requests to `path` atomically (temp file + rename); return how many."""
    count = 0
    with atomic_write(path) as fh:
        for r in requests:
            fh.write(json.dumps(r.as_record(), ensure_ascii=False) + "\n")
            count += 1
    return count


def read_jsonl(path: Path) -> list[Request]:
    """Read a JSONL request file; any malformed line is a one-line error naming the line."""
    path = Path(path)
    if not path.is_file():
        raise CertkvError(f"request file {path} does not exist; check the path or generate it with `certkv generate`")
    out = []
    seen: set[str] = set()
    with path.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                data = json.loads(line)
            except json.JSONDecodeError as exc:
                raise CertkvError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from None
            if not isinstance(data, dict):
                raise CertkvError(f"{path}:{lineno}: expected a JSON object with id, context, question, answers")
            try:
                req = Request.model_validate(data)
            except ValidationError as exc:
                raise CertkvError(format_validation_error(exc, f"{path}:{lineno}")) from None
            if req.id in seen:
                raise CertkvError(f"{path}:{lineno}: duplicate request id {req.id!r}; ids must be unique")
            seen.add(req.id)
            out.append(req)
    return out


def load_requests(source: str, limit: int | None = None, seed: int = 0, context_length: str | None = None) -> list[Request]:
    """Load requests from a JSONL path or generate them from `builtin:<mix>`.

    A `limit` below a file's size takes a seeded random subset (kept in file order), not the first
    lines: files are often written task by task, and a prefix would silently change the mix.
    """
    if source.startswith("builtin:"):
        return generate_requests(source.removeprefix("builtin:"), limit or 1200, seed, context_length)
    requests = read_jsonl(Path(source))
    if limit and limit < len(requests):
        keep = sorted(random.Random(f"certkv-limit/{seed}").sample(range(len(requests)), limit))
        requests = [requests[i] for i in keep]
    return requests
