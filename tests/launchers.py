"""What tests that start processes on loopback share (tests/ is on sys.path): a free port, and torchrun
launches as hosts would run them."""

from __future__ import annotations

import socket
import subprocess
import sys
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
