"""The detokenizer: token ids to text, off the critical path."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from infer.api.request import Request


@dataclass(slots=True)
class DetokenizedDelta:
    text: str  # the request's text so far, stop string removed
    stop_index: int | None = None  # output-token index that completed a stop string, if any


class Detokenizer(Protocol):
    """Turns output tokens into text, incrementally, and finds stop strings.

    `submit` hands over each request's full output token list after a step; `collect` returns
    what was submitted last, as text. A strategy may work between the two calls (in a thread),
    so the engine calls `collect` only after launching the next step's forward pass.
    """

    def submit(self, updates: list[tuple["Request", list[int]]]) -> None: ...

    def collect(self) -> dict[str, DetokenizedDelta]: ...

    def release(self, request_id: str) -> None: ...

    def close(self) -> None: ...
