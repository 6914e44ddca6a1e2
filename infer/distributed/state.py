"""Tensor parallelism: this process's place in the group (`ParallelState`, the core's
`Communicator`), the collectives the model needs, and how heads are split across ranks.

A `ParallelState` is made once per engine (by `infer.distributed.launch`) and passed explicitly to the
builder, the model and rank 0's executors; nothing here is module-level state. Two process groups
serve a run: `group` carries the model's collectives (NCCL on GPUs, gloo on the CPU) and
`control_group` (always gloo, no deadline) carries rank 0's step messages, so a worker may wait
between steps for as long as the engine stays idle.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import torch

from infer.api import Executor, HeadLayout, LocalExecutor, PipelineStage
from infer.api.errors import ConfigError
from infer.common import env


def check_tensor_parallel(
    name: str, num_heads: int, num_kv_heads: int, intermediate_size: int, world_size: int
) -> None:
    """Refuse a model whose heads (or MLP width) do not split evenly over `world_size` ranks."""
    if world_size == 1:
        return
    options = [n for n in range(1, num_heads + 1) if _splits(num_heads, num_kv_heads, intermediate_size, n)]
    fix = "use --tp " + (", ".join(map(str, options[:-1])) + " or " if len(options) > 1 else "") + str(options[-1])
    if num_heads % world_size:
        raise ConfigError(f"--tp {world_size} does not divide the {num_heads} query heads of {name}: {fix}")
    if num_kv_heads >= world_size and num_kv_heads % world_size:
        raise ConfigError(f"--tp {world_size} does not divide the {num_kv_heads} KV heads of {name}: {fix}")
    if num_kv_heads < world_size and world_size % num_kv_heads:
        raise ConfigError(
            f"--tp {world_size} is not a multiple of the {num_kv_heads} KV heads of {name} (each rank needs whole "
            f"KV heads): {fix}"
        )
    if intermediate_size % world_size:
        raise ConfigError(f"--tp {world_size} does not divide the MLP width {intermediate_size} of {name}: {fix}")


def check_pipeline_parallel(name: str, num_layers: int, num_stages: int) -> None:
    """Refuse a split into more pipeline stages than `name` has layers (each stage holds one at least)."""
    if num_stages > num_layers:
        raise ConfigError(
            f"--pp {num_stages} splits the {num_layers} layers of {name}: each stage needs one; use --pp "
            f"{num_layers} or fewer"
        )


def _splits(num_heads: int, num_kv_heads: int, intermediate_size: int, n: int) -> bool:
    kv_ok = num_kv_heads % n == 0 if num_kv_heads >= n else n % num_kv_heads == 0
    return num_heads % n == 0 and kv_ok and intermediate_size % n == 0


class FastAllReduce(Protocol):
    """A fast all-reduce for small tensors (`--all-reduce`: `SymmetricAllReduce`, `FlashInferAllReduce`).
    `fits(x)` says whether it sums `x` (the same answer on every rank), and calling it sums `x`.
    `exchange`: the `LamportExchange` one-token steps' partial sums are pushed into, or None.
    `add_rms_norm(x, residual, weight, eps)`, where not None, sums fused with the residual add and
    RMSNorm. `close()` frees its shared buffers: collective, at the teardown."""

    exchange: Any
    add_rms_norm: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], tuple[torch.Tensor, torch.Tensor]] | None

    def fits(self, x: torch.Tensor) -> bool: ...

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...

    def close(self) -> None: ...


@dataclass(frozen=True, slots=True)
class ParallelState:
    """This process's rank in the tensor-parallel group (world_size 1: no group, no collectives)."""

    rank: int = 0
    world_size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    group: Any = None  # ProcessGroup for the model's collectives (all-reduce, all-gather)
    control_group: Any = None  # gloo ProcessGroup for rank 0's step messages (CPU tensors)
    store: Any = None  # the rendezvous store: a failing rank posts its error under error_key(rank)
    fast_all_reduce: FastAllReduce | None = None  # for small tensors (--all-reduce); None: NCCL only
    # collective clean-ups (freeing buffers the ranks share): run by every rank, in this order, when
    # the ranks take their groups down together; a copy of this state (dataclasses.replace) shares the list
    teardown: list[Any] = field(default_factory=list, repr=False, compare=False)
    all_reduce_line: str | None = None  # what `set_up` chose for --all-reduce, for the run's description
    ranks: Any = field(default=None, repr=False, compare=False)  # rank 0's RankGroup: forwards go to every rank
    # --pp N > 1: `num_stages` stages of `world_size` tensor-parallel ranks each (`group`: this stage's
    # ranks); process p is rank p % world_size of stage p // world_size
    num_stages: int = 1
    stage_index: int = 0
    link: Any = field(default=None, repr=False, compare=False)  # the stage's `PipelineLink` (P2PLink)

    @property
    def process_rank(self) -> int:
        """This process among all of the engine's (its global rank): stage by stage, then tensor rank."""
        return self.stage_index * self.world_size + self.rank

    @property
    def num_processes(self) -> int:
        return self.world_size * self.num_stages

    @property
    def is_parallel(self) -> bool:
        return self.num_processes > 1

    @property
    def is_driver(self) -> bool:
        """Process 0 runs the scheduler, the sampler and the engine loop; the other ranks follow it."""
        return self.process_rank == 0

    @property
    def layers(self) -> Any:
        """The tensor-parallel layers model plugins build with (`infer.api.TensorParallelLayers`)."""
        from infer.distributed import layers  # it imports this module

        return layers

    def heads(self, num_heads: int, num_kv_heads: int) -> HeadLayout:
        n, r = self.world_size, self.rank
        per_rank = num_heads // n
        if num_kv_heads >= n:
            kv_per_rank = num_kv_heads // n
            return HeadLayout(per_rank, kv_per_rank, r * per_rank, r * kv_per_rank)
        return HeadLayout(per_rank, 1, r * per_rank, r // (n // num_kv_heads))  # replicated KV head

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks (row-parallel outputs, the vocab-parallel embedding): in place, or a
        new tensor where a fast path or the exchange sums it; use the result."""
        if (exchange := self.exchange) is not None and exchange.takes(x):  # pushed by its GEMV: summed there
            return exchange.reduce(x)  # not in place: x is the exchange's slot, reset by now
        fast = self.fast_all_reduce
        if fast is not None and fast.fits(x):
            return fast(x)
        import torch.distributed as dist

        dist.all_reduce(x, group=self.group)
        return x

    @property
    def exchange(self) -> Any:
        """The fast all-reduce's `LamportExchange` (one-token steps' partial sums pushed by the
        row-parallel GEMVs), or None."""
        return self.fast_all_reduce.exchange if self.fast_all_reduce is not None else None

    def gather_columns(self, x: torch.Tensor) -> torch.Tensor:
        # x: [R, C] on every rank -> [R, world_size * C], rank i's columns i*C:(i+1)*C.
        # One all-gather (a single collective, safe inside a CUDA graph); only rank 0 uses the result.
        import torch.distributed as dist

        # a torch module's attribute that only some versions have
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        rows, cols = x.shape
        out = x.new_empty(self.world_size * rows, cols)
        gather(out, x.contiguous(), group=self.group)
        return out.view(self.world_size, rows, cols).transpose(0, 1).reshape(rows, self.world_size * cols)

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's CPU tensor `x` to every rank (in place on the others), over the control group."""
        import torch.distributed as dist

        dist.broadcast(x, src=0, group=self.control_group)
        return x

    def broadcast_tensor(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's tensor `x` (on this rank's device) to every rank, in place on the others, over
        the model's group: the ids a pipelined decode step sampled, still on rank 0's GPU."""
        import torch.distributed as dist

        dist.broadcast(x, src=0, group=self.group)
        return x

    def min(self, value: int) -> int:
        """The smallest `value` over every process (KV blocks: every rank's cache holds the same blocks)."""
        if not self.is_parallel:
            return value
        import torch.distributed as dist

        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.control_group)
        return int(t.item())

    def set_up(self, all_reduce: str, dtype: torch.dtype, hidden_size: int) -> ParallelState:
        """Collective: the fast all-reduce for `--all-reduce` (`make_all_reduce`) in the state returned."""
        if self.world_size == 1:  # pipeline stages of one rank sum nothing
            return self
        if self.num_stages > 1:  # the fast all-reduces know one group of the engine's ranks: NCCL sums a stage's
            if all_reduce not in ("auto", "nccl"):
                raise ConfigError(f"--all-reduce {all_reduce} with --pp {self.num_stages}: use --all-reduce nccl")
            return dataclasses.replace(self, all_reduce_line="nccl (each pipeline stage's ranks)")
        from infer.distributed.all_reduce import make_all_reduce

        fast, line = make_all_reduce(all_reduce, self, dtype, hidden_size)
        if fast is not None:  # its buffers are freed by every rank together, at the teardown
            self.teardown.append(fast.close)
        return dataclasses.replace(self, fast_all_reduce=fast, all_reduce_line=line)

    def model_kwargs(self, name: str, architecture: Any, config: Any) -> dict[str, Any]:
        """`parallel=` this state under --tp > 1, once the model is known to split over the ranks; `stage=`
        its layers under --pp > 1, once the model is known to take them; nothing on one process."""
        kwargs: dict[str, Any] = {}
        if self.num_stages > 1:
            if not _accepts(architecture, "stage"):
                raise ConfigError(
                    f"the model architecture of {name} has no pipeline-parallel form (no `stage` argument): use --pp 1"
                )
            kwargs["stage"] = self.stage(config.num_layers)
        if self.world_size == 1:
            return kwargs
        check_tensor_parallel(name, config.num_heads, config.num_kv_heads, config.intermediate_size, self.world_size)
        if not _accepts(architecture, "parallel"):
            raise ConfigError(
                f"the model architecture of {name} has no tensor-parallel form (no `parallel` argument): use --tp 1"
            )
        return {**kwargs, "parallel": self}

    def stage(self, num_layers: int) -> PipelineStage | None:
        """This rank's stage of a model of `num_layers` layers under --pp; None: every layer."""
        if self.num_stages == 1:
            return None
        check_pipeline_parallel("the model", num_layers, self.num_stages)  # a draft's, past the launch's check
        return PipelineStage.split(num_layers, self.num_stages, self.stage_index)

    def executor(self, model_id: int) -> Executor:
        """Rank 0's sends each forward to the other ranks, then runs it; the other ranks run what it sends."""
        return LocalExecutor() if self.ranks is None else self.ranks.executor(model_id)

    def describe(self, model: Any) -> dict[str, Any]:
        if not self.all_reduce_line:
            return {}
        line = self.all_reduce_line
        # a model plugin's optional attribute (the built-in DecoderModel's): its one-token sums are pushed
        if self.exchange is not None and getattr(model, "pushes", False):
            line += "; one-token steps' sums pushed by the row-parallel GEMVs and the embedding"
        return {"all_reduce": line}


def _accepts(architecture: Any, argument: str) -> bool:
    import inspect

    try:
        return argument in inspect.signature(architecture).parameters
    except (TypeError, ValueError):
        return False


def torchrun_host() -> tuple[int, int] | None:
    """(ranks torchrun runs on this host, this process's index among them) when torchrun started this
    process, else None (the engine spawns its ranks itself, all on this host)."""
    placement = env.torchrun()
    return None if placement is None else (placement.local_world_size, placement.local_rank)
