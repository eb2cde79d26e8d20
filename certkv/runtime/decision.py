"""The runtime's decision record: how one request was answered, and the signals it was decided on.

:class:`Decision` has a module of its own so that the answering paths
(:mod:`certkv.runtime.pipeline`, :mod:`certkv.runtime.single_prefill`) can name it: its public home,
:mod:`certkv.runtime.certified_runtime`, imports them and re-exports it.
"""

from __future__ import annotations

from dataclasses import field, make_dataclass
from typing import TYPE_CHECKING, Any, TypeAlias

from certkv.core.signals import SIGNALS


def _copied(value: Any) -> Any:
    return list(value) if isinstance(value, list) else value


def _decision_class() -> type:
    """:class:`Decision`, its signal fields derived from :data:`certkv.core.signals.SIGNALS`."""
    head: list[Any] = [
        ("mode", str),
        ("reason", str | None),
        ("policy", str),
        ("stratum", str | None, field(default=None)),
        ("gate_kind", str | None, field(default=None)),
        ("gate_threshold", float | None, field(default=None)),
        ("certificate_bound", float | None, field(default=None)),
    ]
    signals: list[Any] = [(s.name, (list[float] if s.kind == "heads" else float) | None, field(default=None)) for s in SIGNALS]
    tail: list[Any] = [
        ("escalated", bool, field(default=False)),
        ("kv_retained", float, field(default=1.0)),
        ("kv_retained_actual", float, field(default=1.0)),
        ("detail", str | None, field(default=None)),
    ]

    names = tuple(f[0] for f in [*head, *signals, *tail])

    def to_dict(self) -> dict:
        """The record as a dict (lists copied): ``dataclasses.asdict`` without its deep copy, which
        costs a live server more than the rest of its response."""
        return {name: _copied(getattr(self, name)) for name in names}

    def signal_values(self) -> dict:
        """The gate signals measured so far (None: not computed): what the runtime's gate reads."""
        return {s.name: getattr(self, s.name) for s in SIGNALS}

    doc = "\n".join(f"    {s.name}: {s.doc}" for s in SIGNALS)
    return make_dataclass(
        "Decision",
        [*head, *signals, *tail],
        namespace={
            "__module__": "certkv.runtime.certified_runtime",  # its public home, as before
            "to_dict": to_dict,
            "signal_values": signal_values,
            "__doc__": (
                "How one request was answered, and the signals it was decided on (None: not computed).\n\n"
                'mode: ``"evicted"`` (the press\'s cache answered) or ``"full"``. reason: why the full cache '
                "answered: ``fallback``, ``uncovered`` (outside the coverage envelope), ``precondition``, ``gate`` "
                "(agreement drop), ``lookahead``, ``learned``, ``confidence``, ``certificate``, or ``monitor`` "
                "(certkv serve); None when the press answered. stratum: the stratum the request named. "
                "gate_kind: the operating point's gate (:attr:`certkv.core.spec.GateSettings.kind`). escalated: the "
                "evicted answer was decoded, then replaced by the full cache's. kv_retained / kv_retained_actual: "
                "nominal and realised retention of the cache that answered (1.0 for the full cache).\n\n"
                "The gate signals, one field each (certkv.core.signals):\n\n" + doc
            ),
        },
    )


if TYPE_CHECKING:
    # Built at run time from the signal registry, so a type checker cannot see its fields.
    Decision: TypeAlias = Any
else:
    #: How one request was answered (see its docstring); fields per gate signal come from the registry.
    Decision = _decision_class()
