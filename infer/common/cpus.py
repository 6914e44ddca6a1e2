"""How many CPU threads a CPU engine's torch should run on, for the machine as it is.

Torch sizes its intra-op pool by the machine's cores; its threads spin while they wait for each other,
so on cores that other processes hold a step waits for threads that are not running (`infer run` on the
default model took 163 s on a 2-core machine at load 12, 12 s on one thread). `available()` is the
cores this process may use: its CPU affinity, capped by a cgroup's CPU quota (a container's
`cpu.max`). `busy()` says whether the other processes already keep those cores busy (the 1-minute
load average, at engine build, when this process computes nothing yet).
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path

__all__ = ["available", "busy", "choose", "Governor", "OthersUse"]

CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")  # cgroup v2: "QUOTA PERIOD", or "max PERIOD"
PROC_STAT = Path("/proc/stat")  # "cpu  user nice system idle iowait irq softirq steal ...", in clock ticks


def available() -> int:
    """The cores this process may run on: its affinity, capped by its cgroup's quota (at least 1)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cores = os.cpu_count() or 1
    try:
        quota, period = CGROUP_CPU_MAX.read_text().split()[:2]
        if quota != "max":
            cores = min(cores, max(1, math.floor(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return max(cores, 1)


def load() -> float | None:
    """The 1-minute load average (runnable processes), or None where the system has none."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def busy(cores: int) -> bool:
    """Whether other processes keep `cores` cores busy already: the load average at least that many."""
    current = load()
    return current is not None and current >= cores


def choose(asked: int | None, current: int) -> tuple[int, str | None]:
    """(torch's threads, a warning or None). `asked`: the user's choice (--cpu-threads, INFER_CPU_THREADS);
    else torch's `current` setting, capped by the cores available, and one on a busy machine."""
    if asked is not None:
        return asked, None
    cores = available()
    threads = min(current, cores)
    if threads > 1 and busy(cores):
        return 1, (
            f"this machine is busy (load {load():.1f} on the {cores} cores this process may use): torch runs on 1 "
            f"thread, which waits for no other; --cpu-threads N (or INFER_CPU_THREADS) chooses"
        )
    return threads, None


def _busy_seconds() -> float | None:
    """CPU seconds the whole machine has spent busy (not idle, not waiting for I/O) since boot."""
    try:
        fields = PROC_STAT.read_text().split("\n", 1)[0].split()
        ticks = [int(x) for x in fields[1:9]]
        return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):  # not Linux
        return None


class OthersUse:
    """The cores the other processes kept busy since the last call: the machine's busy CPU time less
    this process's, over the wall time between calls (None where /proc/stat is missing)."""

    def __init__(self) -> None:
        self._last = self._sample()

    @staticmethod
    def _sample() -> tuple[float, float | None, float]:
        times = os.times()
        return time.monotonic(), _busy_seconds(), times.user + times.system

    def __call__(self) -> float | None:
        now = self._sample()
        (t0, busy0, mine0), (t1, busy1, mine1) = self._last, now
        self._last = now
        if busy0 is None or busy1 is None or t1 - t0 <= 0:
            return None
        return max(0.0, (busy1 - busy0) - (mine1 - mine0)) / (t1 - t0)


class Governor:
    """Keeps torch's threads off cores that other processes take while a CPU engine runs: when the others
    use more than the cores this process leaves free (half a core of slack), torch drops to one thread
    (its threads spin while they wait for each other, so a starved one stalls every step: `infer run`
    went from 13 s to 129 s on two cores when a test suite started beside it); after three quiet
    intervals it goes back to `threads`. `tick()` runs once a step; it looks at most every `interval_s`."""

    def __init__(self, threads: int, cores: int, interval_s: float = 1.0, current: int | None = None) -> None:
        import torch

        self._torch = torch
        self.threads = threads
        self.cores = cores
        self.interval_s = interval_s
        self.current = threads if current is None else current  # what torch runs on now
        self._use = OthersUse()
        self._next = time.monotonic() + interval_s
        self._quiet = 0
        self._warned = False

    def tick(self) -> None:
        now = time.monotonic()
        if now < self._next:
            return
        self._next = now + self.interval_s
        others = self._use()
        if others is None:
            return
        if self.current > 1 and others > self.cores - self.current + 0.5:
            self._set(1)
            self._quiet = 0
            if not self._warned:
                self._warned = True
                from infer.common.log import get_logger

                get_logger().warning(
                    f"other processes took {others:.1f} of the {self.cores} cores this process may use: torch runs "
                    f"on 1 thread while they do; --cpu-threads N (or INFER_CPU_THREADS) fixes the count"
                )
        elif self.current < self.threads:
            self._quiet = self._quiet + 1 if others < self.cores - self.threads + 0.25 else 0
            if self._quiet >= 3:
                self._set(self.threads)

    def _set(self, threads: int) -> None:
        self.current = threads
        self._torch.set_num_threads(threads)
