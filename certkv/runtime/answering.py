"""What the runtime's answering paths read of the runtime that calls them.

:mod:`certkv.runtime.pipeline` and :mod:`certkv.runtime.single_prefill` answer one request for a
:class:`~certkv.runtime.certified_runtime.CertifiedRuntime`, which imports them; they name it by
this protocol (the attributes they read), so that they need not import it back.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from kvpress import BasePress
    from transformers import PreTrainedModel

    from certkv.core.operating_point import OperatingPoint
    from certkv.model.generation import EncodedRequest
    from certkv.runtime.gates import RuntimeGate


class AnsweringRuntime(Protocol):
    """A :class:`~certkv.runtime.certified_runtime.CertifiedRuntime` as its answering paths see it."""

    @property
    def model(self) -> PreTrainedModel: ...

    @property
    def gate(self) -> RuntimeGate: ...

    @property
    def press(self) -> BasePress:
        """The certified press (never None on a path: without one the full cache answers first)."""
        ...

    @property
    def operating_point(self) -> OperatingPoint: ...

    @property
    def stop_ids(self) -> set[int]: ...

    @property
    def policy(self) -> str: ...

    def full_answer(self, enc: EncodedRequest, max_new: int, seconds: dict[str, float] | None = None) -> list[int]: ...
