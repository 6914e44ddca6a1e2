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
from pathlib import Path

__all__ = ["available", "busy", "choose"]

CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")  # cgroup v2: "QUOTA PERIOD", or "max PERIOD"


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
