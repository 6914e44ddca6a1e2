"""What tests that start processes on loopback share (tests/ is on sys.path): a free port, torchrun
launches as hosts would run them, and the process tree a server leaves (from /proc)."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(script: Path, args: list[str], hosts: int, per_host: int, timeout: float = 240) -> list[str]:
    """`script` under `hosts` torchrun launches of `per_host` processes each, on one loopback rendezvous, as
    that many hosts would start it. Asserts that each launch exits 0; returns their output lines."""
    port = free_port()
    launches = [
        subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(hosts), "--node-rank", str(host)]
            + ["--nproc-per-node", str(per_host), "--master-addr", "127.0.0.1", "--master-port", str(port)]
            + [str(script), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for host in range(hosts)
    ]
    outputs = [launch.communicate(timeout=timeout) for launch in launches]
    for launch, (_, err) in zip(launches, outputs):
        assert launch.returncode == 0, err[-3000:]
    return [line for out, _ in outputs for line in out.splitlines()]


def descendants(root: int) -> set[int]:
    """Every live process below `root`, by parent pid (any thread may have started one)."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parents[int(stat.parent.name)] = int(stat.read_text().rpartition(")")[2].split()[1])
        except (OSError, IndexError, ValueError):
            continue
    found, todo = set(), [root]
    while todo:
        parent = todo.pop()
        children = [pid for pid, ppid in parents.items() if ppid == parent and pid not in found]
        found.update(children)
        todo.extend(children)
    return found


def cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def alive(pid: int) -> bool:
    """Running (not gone, not a zombie)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def assert_gone(pids: set[int], timeout_s: float = 15) -> None:
    deadline = time.monotonic() + timeout_s
    while (left := [p for p in pids if alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, f"still running: {[(p, cmdline(p)) for p in left]}"
