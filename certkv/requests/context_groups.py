"""Which calibration requests share a context, and the contract's rule for certifying them.

The certificate's binomial bound treats its n requests as n independent draws. Several questions
asked of one context are not: they fail together when the compression drops the part of the
context they need, so the effective sample is smaller than n and a per-request bound is too
optimistic. A request set whose contexts repeat must therefore say how to certify them
(``requests.group_by`` in the contract, docs/design.md "Statistical rules"):

* ``context``: the unit of sampling is the context; the records carry each request's group and
  the certificate is computed over groups (:mod:`certkv.core.grouped`);
* ``request``: the user states that the questions are independent draws despite sharing contexts
  (the per-request bound, at the user's risk).

A request's group is its ``group`` field when the request file gives one, otherwise its context:
two requests with the same context text share a group (the same text gives the same tokens, so
this is the "identical context tokens" rule without loading a tokenizer).
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Sequence

from certkv.errors import CertkvError
from certkv.requests.request_set import Request


def group_of(request: Request) -> str:
    """The request's context group: its ``group`` field, else ``context-`` and the first 16 hex
    digits of its context's sha256 (stable across runs and machines, unlike ``hash()``)."""
    if request.group:
        return request.group
    return "context-" + hashlib.sha256(request.context.encode("utf-8")).hexdigest()[:16]


def context_groups(requests: Sequence[Request]) -> list[str]:
    """Each request's group (:func:`group_of`), in request order."""
    return [group_of(r) for r in requests]


def check_grouping(requests: Sequence[Request], group_by: str | None) -> list[str] | None:
    """The requests' groups when the contract certifies per context (``group_by: context``), None
    otherwise; a one-line error when contexts repeat and the contract does not say how to certify
    them (``group_by`` unset)."""
    _check_one_group_per_context(requests)
    if group_by == "context":
        return context_groups(requests)
    if group_by is not None:  # "request": the user's statement that questions are independent
        return None
    groups = context_groups(requests)
    sizes = Counter(groups)
    repeated = [g for g, size in sizes.items() if size > 1]
    if repeated:
        first = next(r for r, g in zip(requests, groups) if g == repeated[0])
        largest = max(sizes.values())
        raise CertkvError(
            f"requests share contexts: the context of request {first.id!r} is asked {sizes[repeated[0]]} times "
            f"({_repeats(len(repeated))}, up to {largest} questions each), and questions on one context fail "
            "together; set requests.group_by: context in the contract to certify per context, or "
            "requests.group_by: request to treat them as independent"
        )
    return None


def _check_one_group_per_context(requests: Sequence[Request]) -> None:
    """Requests with the same context text must carry the same ``group`` (or none): a group field
    names contexts that identical text would not reveal, it must not split one context into
    several groups and hide that its questions are asked together."""
    first: dict[str, Request] = {}
    for request in requests:
        seen = first.setdefault(request.context, request)
        if seen.group != request.group:
            raise CertkvError(
                f"requests {seen.id!r} and {request.id!r} share a context but not a group ({_group_text(seen)} and "
                f"{_group_text(request)}); give requests that share a context one group, or none"
            )


def _group_text(request: Request) -> str:
    return repr(request.group) if request.group else "none"


def _repeats(count: int) -> str:
    return "1 context repeats" if count == 1 else f"{count} contexts repeat"
