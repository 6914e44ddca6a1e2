"""Tensor parallelism as the core sees it: this process's rank (`Communicator`), how a runner's
forward reaches every rank (`Executor`) and who starts the ranks (`Launch`). `infer.distributed`
implements them; `SingleProcess` and `LocalExecutor` are one rank's. Every rank builds the same
engine, making the same calls in the same order: `min` and `set_up` wait for every rank.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Protocol

import torch

if TYPE_CHECKING:
    from infer.api.config import EngineConfig, ModelConfig
    from infer.api.runner import StepInputs


@dataclass(frozen=True, slots=True)
class HeadLayout:
    """One rank's attention heads. With fewer KV heads than ranks, each rank holds the one KV head
    that its query heads read (a copy of it lives on `world_size / num_kv_heads` ranks)."""

    num_heads: int  # query heads on this rank
    num_kv_heads: int  # KV heads on this rank
    q_start: int  # first query head (of the model's)
    kv_start: int  # first KV head (of the model's)


@dataclass(frozen=True, slots=True)
class PipelineStage:
    """One pipeline stage's share of a model (`--pp N`, plugin API 2.7): decoder layers [start, end) of
    `num_layers`. The first stage embeds the tokens; the last applies the final norm and the LM head.
    A model plugin with a pipeline-parallel form takes it as `stage=` and builds only these layers (and
    the embedding or the head where its stage needs them), keeping each layer's index in its names."""

    index: int
    num_stages: int
    start: int
    end: int
    num_layers: int

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.num_stages - 1

    def __contains__(self, layer: int) -> bool:
        return self.start <= layer < self.end

    @classmethod
    def split(cls, num_layers: int, num_stages: int, index: int) -> PipelineStage:
        """Contiguous runs as even as they go; the first `num_layers % num_stages` stages take one more."""
        base, extra = divmod(num_layers, num_stages)
        start = index * base + min(index, extra)
        return cls(index, num_stages, start, start + base + (index < extra), num_layers)


@dataclass(slots=True)
class StageActivations:
    """What one pipeline stage hands the next: the last layer's output and the residual stream, each
    [T, hidden] (a model's `forward` returns these on every stage but the last)."""

    hidden: torch.Tensor
    residual: torch.Tensor


class PipelineLink(Protocol):
    """This process's links to the stages beside it (`Communicator.link`, plugin API 2.7): with --tp, a
    rank's to the same rank of the stages beside its stage. Every stage runs each forward's
    micro-batches in the same order, so each send meets its receive by order alone.
    Sends may return before the data has left; `finish()` waits for this forward's sends."""

    stage_index: int
    num_stages: int

    def send_activations(self, carried: StageActivations) -> None: ...  # to the next stage

    def recv_activations(self, num_tokens: int, hidden_size: int, dtype: torch.dtype) -> StageActivations: ...

    def send_rows(self, rows: torch.Tensor) -> None: ...  # the last stage's logits (or hidden rows) to process 0

    def recv_rows(self, shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor | None:
        """On the first stage: the rows the last sent, in order; None on a rank that samples nothing."""

    def finish(self) -> None: ...


class ShardRule(Protocol):
    """Where a tensor-parallel parameter sits in the whole (tp = 1) one (`TensorParallelLayers.shard_of`)."""

    dim: int  # 0: output rows (column- and vocab-parallel); 1: input columns (row-parallel)
    full_sizes: tuple[int, ...]  # the pieces the whole concatenates along `dim` (q, k, v; gate, up; one)
    ranges: tuple[tuple[int, int], ...]  # piece i -> (start within the piece, length) on this rank


class TensorParallelLayers(Protocol):
    """The tensor-parallel building blocks a model plugin builds its layers from (`ModelParallel.layers`;
    the engine's are `infer.distributed.layers`): column- and row-parallel projections of attention and
    the MLP, the vocabulary-parallel embedding and LM head, the partial sums' all-reduce fused with the
    next residual add and norm, and the loading of each rank's slice of a checkpoint."""

    RowParallelLinear: type  # a row-parallel projection (its output a partial sum)
    VocabParallelEmbedding: type  # (vocab_size, hidden_size, parallel, matmul)
    ParallelLMHead: type  # (vocab_size, hidden_size, parallel, matmul)
    attention_projections: Callable[..., tuple[Any, Any]]  # (config, parallel, matmul, qkv_bias, o_bias, ...)
    mlp_projections: Callable[..., tuple[Any, Any]]  # (config, parallel, matmul, reduce, quantized)
    reduce_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]]  # (parallel, x, norm) -> (normed, residual)
    reduce_add_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]]  # (parallel, x, residual, norm)
    load_sharded: Callable[..., set[str]]  # (model, weights, target) -> the parameters loaded
    shard_of: Callable[..., ShardRule | None]  # (model, parameter name) -> its shard rule, or None (whole)


class ModelParallel(Protocol):
    """What a model plugin gets as `parallel` under `--tp N > 1` (None on one rank): its heads, and the
    tensor-parallel layers to build with (it passes itself back to them)."""

    rank: int
    world_size: int

    def heads(self, num_heads: int, num_kv_heads: int) -> HeadLayout: ...

    @property
    def layers(self) -> TensorParallelLayers: ...


class Executor(Protocol):
    """How a runner's forward reaches every rank: the runner enters `forwarding(step)` around each
    forward it runs here. Under tensor parallelism rank 0's sends the step to
    the other ranks on entry (they run it themselves), and turns a failure inside into the error that
    names a rank that died; on one rank it does nothing. It never calls the runner back."""

    def forwarding(self, step: StepInputs) -> AbstractContextManager[None]: ...


class LocalExecutor:
    """One rank's: the forward runs here alone."""

    def forwarding(self, step: StepInputs) -> AbstractContextManager[None]:
        return _NOTHING


_NOTHING = nullcontext()  # reentrant, and reusable: one object for every step


class Communicator(Protocol):
    """This process's place among the tensor-parallel ranks, as the builder and its runners use it."""

    rank: int
    world_size: int
    device: torch.device  # this rank's
    is_parallel: bool  # more than one rank
    is_driver: bool  # rank 0: runs the scheduler, the sampler and the engine loop

    def heads(self, num_heads: int, num_kv_heads: int) -> HeadLayout: ...

    def min(self, value: int) -> int: ...  # the smallest value over the ranks

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """`x` summed over the ranks, in place or a new tensor: use the result (2.3: adapters' deltas)."""

    def set_up(self, all_reduce: str, dtype: torch.dtype, hidden_size: int) -> Communicator:
        """Once per engine, before its first model: the collectives for activations of `dtype` x
        `hidden_size` (`--all-reduce`). The models are built with the communicator returned."""

    def model_kwargs(self, name: str, architecture: Any, config: ModelConfig) -> dict[str, Any]:
        """What `architecture` gets on this rank beyond (config, layers, attention): {} on one rank;
        a ConfigError names the fix when the model does not split or has no tensor-parallel form."""

    def executor(self, model_id: int) -> Executor:
        """For the runners of model `model_id` (the order the builder loads them: the target 0, then drafts)."""

    def stage(self, num_layers: int) -> PipelineStage | None:
        """This process's stage of a model of `num_layers` layers under `--pp N > 1`; None: every layer (2.7)."""

    @property
    def link(self) -> PipelineLink | None:
        """The links to the stages beside this one under `--pp N > 1`, else None (2.7)."""

    def describe(self, model: Any) -> dict[str, Any]:
        """The run's description entries (the all-reduce chosen), once the target `model` is built."""


class Launch(Protocol):
    """Starts (or joins) the ranks of a `--tp N > 1` run once the builder's checks have passed; each
    rank builds its engine with `build_engine(config, extra_plugins, parallel=its Communicator)`.
    Returns rank 0's parts, which it drives; the other ranks serve rank 0 inside the call."""

    def __call__(
        self, config: EngineConfig, extra_plugins: Any, name: str, model_config: ModelConfig, device: torch.device
    ) -> Any: ...  # rank 0's `EngineParts` (the core's: the API names no engine class)


@dataclass(frozen=True, slots=True)
class SingleProcess:
    """One rank (`--tp 1`): every head here, no collectives."""

    device: torch.device
    rank: int = 0
    world_size: int = 1
    is_parallel: bool = False
    is_driver: bool = True

    def heads(self, num_heads: int, num_kv_heads: int) -> HeadLayout:
        return HeadLayout(num_heads, num_kv_heads, 0, 0)

    def min(self, value: int) -> int:
        return value

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def set_up(self, all_reduce: str, dtype: torch.dtype, hidden_size: int) -> SingleProcess:
        return self

    def model_kwargs(self, name: str, architecture: Any, config: ModelConfig) -> dict[str, Any]:
        return {}

    def executor(self, model_id: int) -> Executor:
        return LocalExecutor()

    def stage(self, num_layers: int) -> PipelineStage | None:
        return None

    link: PipelineLink | None = None

    def describe(self, model: Any) -> dict[str, Any]:
        return {}
