"""Host work that waits for the engine's thread to wait on the device (`DeviceWaits`).

A strategy that works in a thread beside the engine (the `parallel` detokenizer) competes with the
engine's thread for the GIL, and between two forwards every microsecond of the engine's thread is
on the critical path whenever the next forward cannot be queued before the tokens it depends on
reach the host (a speculative verify step, an eager step). So such work is not started when it is
handed over but `defer`red, and starts when the engine's thread announces, with `waiting()`, that
it has queued a forward and is about to block until it has run: the GIL is free then.

The engine builds one `DeviceWaits` and hands it to whoever needs it, at construction: the
detokenizer factory (`factory(tokenizer, waits)`) defers through it; the model runners
(`ModelRunnerLike.waits`) announce before their sampler copies the tokens to the host (a decode
pipeline before it waits for them), and a decoder that blocks elsewhere announces there
(`DecoderContext.waits`). Work never started that way starts when its result is asked for, so a
start must be safe to call again, from another thread, once its work has begun (a later call does
nothing). Only the engine's thread calls `defer` and `waiting`.
"""

from __future__ import annotations

from collections.abc import Callable


class DeviceWaits:
    """One engine's deferred host work, started at its thread's next wait on the device."""

    __slots__ = ("_queue",)

    def __init__(self) -> None:
        self._queue: list[Callable[[], None]] = []

    def defer(self, start: Callable[[], None]) -> None:
        """Call `start` (once) when the engine's thread next announces a wait on the device."""
        if start not in self._queue:  # at most once: an engine that never announces a wait keeps one entry
            self._queue.append(start)

    def waiting(self) -> None:
        """The engine's thread has queued its forward and is about to block on the device: start what
        was deferred, each one whatever the others do; the first error is raised after the rest started."""
        queue = self._queue
        if not queue:
            return
        self._queue = []
        error: BaseException | None = None
        for start in queue:
            try:
                start()
            except BaseException as exc:  # noqa: BLE001 - re-raised below, after the rest have started
                error = error or exc
        if error is not None:
            raise error
