"""Taking a tensor-parallel group down: every rank at once after a clean stop, or abort after a failure.

After rank 0's stop, each rank destroys its CUDA graphs (NCCL's teardown waits for every graph that
captured one of its collectives), meets the others at a barrier on the store, runs the collective
clean-ups (`ParallelState.teardown`), then destroys its process groups at the same time as the
others. A rank that failed, or does not come within the wait, is not waited for: the clean-ups are
skipped and NCCL's groups aborted.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Iterable

import torch

from infer.distributed.state import ParallelState

TEARDOWN = "infer/teardown"  # ranks done with every collective, about to take their groups down together


def release_graphs(runners: Iterable[Any], device: torch.device, wait: bool = True) -> None:
    """Destroy this rank's runners' CUDA graphs, after its last step has finished (`wait`): NCCL's
    teardown, abort included, waits for every graph that captured one of its collectives to be gone.
    Without `wait` (a failed rank: a step may never finish) a graph still running is freed by CUDA
    when it completes, which the abort makes happen."""
    if wait and device.type == "cuda":
        torch.cuda.synchronize(device)
    for runner in runners:  # ModelRunners: `graphs` is None where none were captured
        if runner.graphs is not None:
            runner.graphs.release()


def meet_for_teardown(parallel: ParallelState, wait_s: float) -> bool:
    """A barrier on the store, once this rank's last step has finished (`release_graphs` waited for
    it): True when every rank arrived within `wait_s`. NCCL's teardown can be collective (torch asks
    every rank to destroy its groups, at about the same time), so the ranks take their groups down
    together, not one after the other: a rank that destroys its groups after the others have left
    may wait for them forever."""
    deadline = time.monotonic() + wait_s
    arrived = parallel.store.add(TEARDOWN, 1)
    while arrived < parallel.num_processes:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
        arrived = parallel.store.add(TEARDOWN, 0)
    return True


def take_down_groups(parallel: ParallelState, together: bool, runners: Iterable[Any] = ()) -> None:
    """Destroy this process's groups when every rank does the same now, after the collective
    clean-ups (`parallel.teardown`); otherwise (a rank failed or did not come) skip those, which
    would wait for it, and abort NCCL's groups, which waits for no peer and no pending collective.
    Either way the runners' CUDA graphs go first (already gone after a clean stop; after a failure
    a graph still running is freed when it completes, which the abort makes happen)."""
    import torch.distributed as dist

    from infer.distributed.all_reduce.symm_mem import forget_group

    with contextlib.suppress(Exception):
        release_graphs(runners, parallel.device, wait=False)
    group_name = parallel.group.group_name if parallel.group is not None else None
    hooks, parallel.teardown[:] = list(parallel.teardown), []
    for hook in hooks if together else []:
        with contextlib.suppress(Exception):
            hook()
    with contextlib.suppress(Exception):
        if together or parallel.device.type != "cuda":  # gloo's teardown waits for no peer
            dist.destroy_process_group()
        else:
            from torch.distributed.distributed_c10d import _abort_process_group

            _abort_process_group()
    if group_name is not None:
        forget_group(group_name)
