"""Progress of a run for people: a bar on a terminal, else one line every few seconds on stderr
(a log file or CI gets requests done, output tokens/s and the time left, not a redrawn bar)."""

from __future__ import annotations

import contextlib
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Literal

import click

from infer.api.request import RequestOutput

ProgressMode = Literal["bar", "lines", "off"]


def _duration(seconds: float) -> str:
    s = int(seconds + 0.5)
    return f"{s // 3600}h{s // 60 % 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


@dataclass(slots=True)
class ProgressLines:
    """on_finish for run_workload: writes a line when `interval_s` passed since the last one, and at the end."""

    label: str
    total: int  # requests in the workload
    echo: Callable[[str], None]
    interval_s: float = 5.0
    clock: Callable[[], float] = time.perf_counter
    done: int = 0
    output_tokens: int = 0
    started: float = field(default=0.0)
    last: float = field(default=0.0)

    def __post_init__(self) -> None:
        self.started = self.last = self.clock()

    def line(self, now: float, unfinished_tokens: int = 0) -> str:
        """unfinished_tokens: output tokens of requests still running, counted in the rate."""
        elapsed = max(now - self.started, 1e-9)
        rate = self.done / elapsed  # requests per second so far
        eta = f", ETA {_duration((self.total - self.done) / rate)}" if 0 < self.done < self.total else ""
        return (
            f"{self.label}: {self.done}/{self.total} requests, {(self.output_tokens + unfinished_tokens) / elapsed:,.1f} out tok/s, "
            f"{_duration(elapsed)} elapsed{eta}"
        )

    def __call__(self, out: RequestOutput) -> None:
        self.done += 1
        self.output_tokens += sum(len(c.token_ids) for c in out.outputs)
        now = self.clock()
        if now - self.last >= self.interval_s or self.done == self.total:
            self.last = now
            self.echo(self.line(now))

    def tick(self, engine: Any) -> None:
        """After a step: a line when `interval_s` passed, counting the tokens of unfinished requests
        too, so long requests that all finish late still report every few seconds."""
        now = self.clock()
        if now - self.last < self.interval_s:
            return
        self.last = now
        self.echo(self.line(now, sum(len(r.output_token_ids) for r in engine.requests.values())))


@contextlib.contextmanager
def progress(mode: ProgressMode, label: str, total: int) -> Iterator[Callable[[RequestOutput], Any] | None]:
    """The on_finish callback for `mode` (None when off), and the bar's lifetime."""
    if mode == "off":
        yield None
    elif mode == "bar":
        with click.progressbar(length=total, label=label, file=sys.stderr) as bar:
            yield lambda _out: bar.update(1)
    else:
        yield ProgressLines(label, total, lambda text: click.echo(text, err=True))
