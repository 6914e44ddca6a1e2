"""Requests waiting outside the scheduler while a logits processor prepares them (`PreparingProcessor`:
a grammar compiling in a pool), so that slow preparation never stalls the step loop."""

from __future__ import annotations

import concurrent.futures
import time
from concurrent.futures import FIRST_COMPLETED, Future
from dataclasses import dataclass
from typing import Any, Sequence

from infer.api import PreparingProcessor
from infer.api.request import Request
from infer.core.output import Group

WAIT_S = 0.05  # an idle engine waits this long at most for a preparation before it looks at its inbox again


@dataclass(slots=True, eq=False)
class Preparing:
    group: Group  # the request (its samples), added to the output but to no scheduler queue yet
    futures: list[Future]  # one per processor preparing it
    deadline: float  # perf_counter time past which it is refused


def prepare(processors: Sequence[Any], request: Request) -> list[Future]:
    """The futures of the processors that prepare something for `request` (a RequestError if one refuses it)."""
    futures: list[Future] = []
    try:
        for processor in processors:
            if isinstance(processor, PreparingProcessor):
                future = processor.prepare(request)
                if future is not None:
                    futures.append(future)
    except BaseException:
        for future in futures:
            future.cancel()
        raise
    return futures


class Preparations(dict[str, Preparing]):
    """Parent id -> its request being prepared."""

    def settle(self, wait: bool) -> tuple[list[Preparing], list[Preparing]]:
        """(the requests whose futures are all done, those past their deadline), both taken out. wait: the
        engine has nothing else to do, so block up to WAIT_S for a future to finish."""
        if wait:
            pending = [f for p in self.values() for f in p.futures if not f.done()]
            nearest = min(p.deadline for p in self.values()) - time.perf_counter()
            if pending and nearest > 0:
                concurrent.futures.wait(pending, timeout=min(WAIT_S, nearest), return_when=FIRST_COMPLETED)
        now = time.perf_counter()
        ready = [p for p in self.values() if all(f.done() for f in p.futures)]
        expired = [p for p in self.values() if now > p.deadline and not all(f.done() for f in p.futures)]
        for preparing in (*ready, *expired):
            del self[preparing.group.request_id]
        for preparing in expired:
            cancel(preparing)
        return ready, expired

    def cancel(self, parent_id: str) -> None:
        """The request left (aborted, or its engine call failed): its preparation is not needed any more."""
        preparing = self.pop(parent_id, None)
        if preparing is not None:
            cancel(preparing)


def cancel(preparing: Preparing) -> None:
    for future in preparing.futures:
        future.cancel()
