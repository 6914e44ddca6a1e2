"""Rank 0's handle on the other tensor-parallel ranks: their failures, shutdown, and the executor
and block mover that send each forward and each step's block copies to them.

Failures. A rank that fails posts its error to the rendezvous store and exits. Rank 0's next
collective then fails (gloo: the peer's socket closes; NCCL: a watcher aborts the group when a
spawned rank exits, else the collective timeout) and rank 0 raises `WorkerError` naming the rank and
its error. `close` stops the ranks: a stop message, then every rank takes its process groups down at
the same time (NCCL's teardown is collective), then terminate for any rank that does not exit.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from infer.api import BlockOps
from infer.api.errors import InferError, WorkerError
from infer.api.runner import StepInputs
from infer.common.log import get_logger
from infer.distributed.state import ParallelState
from infer.distributed.step_channel import StepChannel
from infer.distributed.teardown import meet_for_teardown, release_graphs, take_down_groups

STOPPED = "infer/stopped"  # ranks 1..N-1 that have taken down their process groups after rank 0's stop
STOP_WAIT_S = 30.0


def error_key(rank: int) -> str:
    return f"infer/error/{rank}"


class RankGroup:
    """Rank 0's handle on the other ranks: their failures, and shutdown."""

    def __init__(self, parallel: ParallelState, processes: dict[int, Any], cpu_threads: int | None = None) -> None:
        self.parallel = parallel
        self.channel = StepChannel(parallel)
        self.processes = processes  # rank -> spawned process (empty under torchrun)
        self.runners: tuple[Any, ...] = ()  # rank 0's model runners: their CUDA graphs go before the groups
        self.broken = False  # a step failed part-way: the ranks are out of step
        self.closed = False
        self._cpu_threads = cpu_threads  # rank 0's torch thread count before the run, restored on close
        self._closing = threading.Event()
        if processes and parallel.device.type == "cuda":  # gloo notices a dead peer by itself; NCCL waits
            threading.Thread(target=self._watch, name="infer-tp-watch", daemon=True).start()

    @property
    def kind(self) -> str:
        """What the other processes are, for messages."""
        return "pipeline-parallel" if self.parallel.num_stages > 1 else "tensor-parallel"

    def executor(self, model_id: int) -> MirroredExecutor:
        return MirroredExecutor(self, model_id)

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        if self.broken:
            raise WorkerError(
                "a tensor-parallel step failed earlier, so the ranks are out of step: close this engine and build a new one"
            )
        try:
            yield
        except BaseException as exc:
            self.broken = True
            error = self.diagnose(exc) if isinstance(exc, Exception) else exc
            if error is exc:
                raise
            raise error from exc

    def diagnose(self, exc: BaseException) -> BaseException:
        """A WorkerError when another rank failed (its message, or its exit code), else `exc` itself."""
        if isinstance(exc, InferError):
            return exc
        # a rank that crashed (a signal) may take seconds to exit while the OS writes its core
        reasons = self._worker_errors(wait_s=10.0)
        if not reasons:
            return exc
        return WorkerError(
            f"{self.kind} {'; '.join(reasons)}: the engine stopped (the rank's traceback is in its "
            f"output); close it and start again"
        )

    def _worker_errors(self, wait_s: float) -> list[str]:
        # a killed rank posts nothing and its exit code shows up a moment after its sockets close
        deadline = time.monotonic() + wait_s
        reasons: dict[int, str] = {}
        while True:
            for rank in range(1, self.parallel.num_processes):
                key = error_key(rank)
                with contextlib.suppress(Exception):
                    if rank not in reasons and self.parallel.store.check([key]):
                        reasons[rank] = f"rank {rank} failed with {self.parallel.store.get(key).decode()}"
                process = self.processes.get(rank)
                if rank not in reasons and process is not None and process.exitcode not in (None, 0):
                    code = process.exitcode
                    reasons[rank] = f"rank {rank} exited with " + (f"signal {-code}" if code < 0 else f"code {code}")
            if reasons or time.monotonic() > deadline:
                return [reasons[r] for r in sorted(reasons)]
            time.sleep(0.05)

    def _watch(self) -> None:
        while not self._closing.wait(0.5):
            dead = {r: p.exitcode for r, p in self.processes.items() if p.exitcode not in (None, 0)}
            if dead and not self._closing.is_set():
                get_logger().error("tensor-parallel rank exited: aborting the NCCL group", exit_codes=dead)
                with contextlib.suppress(Exception):  # unblocks rank 0's pending collectives
                    from torch.distributed.distributed_c10d import _abort_process_group

                    _abort_process_group()
                return

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._closing.set()
        together = False
        if not self.broken:
            with contextlib.suppress(Exception):
                self.channel.send_stop()
                release_graphs(self.runners, self.parallel.device)
                together = meet_for_teardown(self.parallel, STOP_WAIT_S)
        if not together:  # a rank is gone or out of step: it is not coming to the teardown
            stop_processes(list(self.processes.values()), wait_s=2.0)
        take_down_groups(self.parallel, together, self.runners)
        if self.processes:
            stop_processes(list(self.processes.values()), wait_s=STOP_WAIT_S)
        elif together:  # torchrun: no process to join; rank 0 waits until the others are done with the store
            self._wait_for_stopped(STOP_WAIT_S)
        if self._cpu_threads is not None:
            torch.set_num_threads(self._cpu_threads)

    def _wait_for_stopped(self, wait_s: float) -> None:
        deadline = time.monotonic() + wait_s
        with contextlib.suppress(Exception):
            while self.parallel.store.add(STOPPED, 0) < self.parallel.num_processes - 1 and time.monotonic() < deadline:
                time.sleep(0.01)


def stop_processes(processes: list[Any], wait_s: float) -> None:
    deadline = time.monotonic() + wait_s
    for p in processes:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in processes:
        if p.is_alive():
            p.terminate()
            p.join(5.0)
        if p.is_alive():
            p.kill()
            p.join(5.0)


@dataclass(slots=True)
class MirroredExecutor:
    """Rank 0's executor for the runners of one model (a self-draft shares the target's): each
    forward goes to every rank, then the runner runs it here. A pipelined step's ids, still on this rank's device,
    follow the step over the model's group (`serve` takes them on the other ranks)."""

    ranks: RankGroup
    model_id: int

    @contextlib.contextmanager
    def forwarding(self, step: StepInputs) -> Iterator[None]:
        with self.ranks.guard():
            self.ranks.channel.send_forward(self.model_id, step)
            if step.input_ids_t is not None:
                self.ranks.parallel.broadcast_tensor(step.input_ids_t)
            yield  # the runner runs the step here


class MirroredBlockMover:
    """Rank 0's block mover: a step's KV block copies reach every rank's caches."""

    def __init__(self, inner: Any, ranks: RankGroup) -> None:
        self.inner = inner
        self.ranks = ranks

    def apply(self, ops: BlockOps) -> None:
        if not ops:
            return
        with self.ranks.guard():
            self.ranks.channel.send_block_ops(ops)
            self.inner.apply(ops)
