"""Host work that waits for the engine's thread to wait on the device.

A strategy that works in a thread beside the engine (the `parallel` detokenizer) competes with the
engine's thread for the GIL, and between two forwards every microsecond of the engine's thread is
on the critical path whenever the next forward cannot be queued before the tokens it depends on
reach the host (a speculative verify step, an eager step). So such work is not started when it is
handed over but `defer`red, and starts when the engine's thread announces, with `waiting()`, that
it has queued a forward and is about to block until it has run: the GIL is free then.

The runner calls `waiting()` before its sampler copies the tokens to the host (and the decode
pipeline before it waits for them); a decoder that blocks elsewhere calls it there. Work never
started that way starts when its result is asked for. Per thread, like the engine's loop: a start
must be safe to call again, from another thread, once its work has begun (a later call does nothing).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

_local = threading.local()


def defer(start: Callable[[], None]) -> None:
    """Call `start` (once) when this thread next announces a wait on the device."""
    queue = getattr(_local, "queue", None)
    if queue is None:
        queue = _local.queue = []
    if start not in queue:  # at most once: a thread that never announces a wait keeps one entry
        queue.append(start)


def waiting() -> None:
    """This thread has queued its forward and is about to block on the device: start what was deferred."""
    queue = getattr(_local, "queue", None)
    if queue:
        _local.queue = []
        error: BaseException | None = None
        for start in queue:  # each one, whatever the others do
            try:
                start()
            except BaseException as exc:  # noqa: BLE001 - re-raised below, after the rest have started
                error = error or exc
        if error is not None:
            raise error
