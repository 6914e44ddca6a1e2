"""Whether the engine is warming up: a shape first met then may be tuned or compiled (seconds),
where met in a serving step it would stall that step.

The CUDA graph runner warms up each of its row buckets under `warming_up()` before capturing it;
the several-row GEMV (`infer.kernels.gemv`) takes a row count it has no tuned tile for only then,
so an eager step of a new small row count (a short prompt's prefill) stays on cuBLAS instead of
tuning mid-run. Process-wide, like the kernels' tile tables it guards.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

_depth = 0


@contextmanager
def warming_up() -> Iterator[None]:
    global _depth
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1


def is_warming_up() -> bool:
    return _depth > 0
