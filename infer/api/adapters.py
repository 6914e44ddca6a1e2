"""Adapters: many fine-tunes of one base model served at once (plugin API 2.3).

An adapter (a PEFT LoRA folder, say) changes some of the model's projections: y = W x + delta(x).
A request names one (`LoRARequest`, in vLLM's shape); requests for different adapters and for the
base model run in the same steps. The `adapter` slot's strategy (`--adapter`, built-in `lora`) is
an `AdapterKind`: it reads an adapter's folder into host tensors, keeps up to `max_adapters` of them
on the device in numbered slots (the engine decides which adapter has which slot, evicting the least
recently used to host memory), and adds each token's adapter's delta to the projections' outputs.

The model takes part through `AdaptableModel`: it lists the projections an adapter may change
(`AdapterTarget`: a module, the HF projections its output concatenates, this rank's part of it under
tensor parallelism) and calls the layer the kind built for each, `y = layer(x, y)`, right after it.
Once a step, before the forward and on every rank, the engine hands the kind the step's slots
(`AdapterBatch`: each sequence's slot, -1 for the base model) through `plan`; a kind whose layers
read them only through static tensors, with fixed grids for a given token count, is CUDA-graph
safe (`Capabilities.cuda_graph_safe`), else the run's CUDA graphs are off.

The prefix cache keys a request's blocks under its adapter (`Request.prefix_key`): requests of
different adapters never share a block, since an adapter changes every K/V after its first layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Literal, Mapping, Protocol, runtime_checkable

import torch

__all__ = [
    "LoRARequest",
    "AdapterTarget",
    "AdapterSpec",
    "AdapterBatch",
    "AdapterKind",
    "AdapterLayer",
    "AdaptableModel",
    "begin_adapter",
]


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """An adapter a request runs with: `LLM.generate(..., lora_request=LoRARequest("sql", 1, "/path"))`.
    vLLM's shape: a name the server lists it under, a positive integer id unique per adapter, and its
    folder (`adapter_config.json` and `adapter_model.safetensors`)."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def path(self) -> str:
        return self.lora_path


Split = Literal["column", "row"]


@dataclass(frozen=True, slots=True)
class AdapterTarget:
    """A projection an adapter may change, as the model built it on this rank.

    Its output is the concatenation of `pieces`, HF's names for the projections it fuses (Llama's
    qkv_proj: q_proj, k_proj, v_proj), each of `out_features[i]` rows in the whole (tp = 1) model.
    Under tensor parallelism (`split`): "column", this rank holds rows `out_slices[i]` (start, length)
    of each piece and the whole input; "row", it holds input columns `in_slice` and its output is a
    partial sum over the ranks. `summed`: that output is summed already when the layer sees it (a row
    split whose projection all-reduces itself), so a row split's delta must be summed too
    (`AdapterSpec.all_reduce`); otherwise the delta joins the partial sum, summed with it."""

    module: str  # the projection's name in the model, "layers.3.self_attn.qkv_proj"
    layer: int  # its decoder layer
    pieces: tuple[str, ...]  # ("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"), ...
    in_features: int  # the whole model's
    out_features: tuple[int, ...]  # each piece's rows, the whole model's
    split: Split | None = None  # None: tp = 1, the whole projection here
    out_slices: tuple[tuple[int, int], ...] = ()  # column: (start, length) of each piece on this rank
    in_slice: tuple[int, int] | None = None  # row: (start, length) of the input on this rank
    summed: bool = False
    # HF names of checkpoints that fuse pieces themselves, and the pieces each covers (Phi-3's
    # ("qkv_proj", ("q_proj", "k_proj", "v_proj"))): an adapter of such a module has one A for them all
    # and a B of their rows stacked
    aliases: tuple[tuple[str, tuple[str, ...]], ...] = ()

    @property
    def local_out(self) -> tuple[int, ...]:
        """Each piece's rows on this rank."""
        return tuple(n for _, n in self.out_slices) if self.split == "column" else self.out_features

    @property
    def local_in(self) -> int:
        return self.in_slice[1] if self.split == "row" and self.in_slice is not None else self.in_features


@dataclass(slots=True)
class AdapterSpec:
    """What an adapter kind's factory gets: `factory(spec) -> AdapterKind`."""

    targets: tuple[AdapterTarget, ...]  # every projection the model lets an adapter change
    max_adapters: int  # device slots (`--max-loras`): the distinct adapters one step may run
    max_rank: int  # the largest rank an adapter may have (`--max-lora-rank`)
    dtype: torch.dtype  # the model's
    device: torch.device
    max_tokens: int  # the most tokens one forward carries (static buffers are this long)
    rank: int = 0  # this process's tensor-parallel rank
    world_size: int = 1
    # sums a tensor over the ranks, in place or not (use the result); None at tp = 1
    all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None


@dataclass(slots=True)
class AdapterBatch:
    """One forward's adapters, handed to `AdapterKind.plan` on every rank before the forward. Sequences
    follow one another in the forward's token order; `num_tokens` may exceed sum(query_lens) (a CUDA
    graph's padded rows), and every token past them runs the base model alone."""

    seq_slots: list[int]  # sequence i -> its adapter's slot, -1 for the base model
    query_lens: list[int]  # sequence i -> its tokens in this forward
    num_tokens: int  # the forward's rows, padding included (a CUDA graph's bucket)
    # a CUDA graph's capture, or the warm-up forward before it: every kernel the layers would launch for
    # `num_tokens` rows must launch (the graph replays it for other batches), though no row runs an adapter
    capture: bool = False

    def token_slots(self) -> list[int]:
        """Each row's slot (-1 for the base model and for padding)."""
        slots = [s for s, n in zip(self.seq_slots, self.query_lens) for _ in range(n)]
        return slots + [-1] * (self.num_tokens - len(slots))


class AdapterLayer(Protocol):
    """What the model calls right after a target projection: `y = layer(x, y)` with x [T, local_in]
    its input and y [T, sum(local_out)] its output; returns y with each token's adapter's delta added
    (in place or not: the model uses the result). Tokens of slot -1 keep y.

    Optional (API 2.8): `begin(x)`, which a model calls (through `begin_adapter`) with the projection's
    input just before the projection, and then `layer(x, y)` with the same x after it, before it begins
    another target's layer. A layer may start there the part of its work that needs x alone (LoRA's
    shrink, on a stream of its own, beside the projection), so that only the rest waits for y. A layer
    without `begin` does it all in `layer(x, y)`; a model that never calls `begin` loses nothing but
    the overlap."""

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor: ...


def begin_adapter(layer: AdapterLayer | None, x: torch.Tensor) -> None:
    """`layer.begin(x)` if the layer has one (`AdapterLayer`): a model calls it with a target
    projection's input just before the projection, then `layer(x, y)` as always."""
    begin = getattr(layer, "begin", None)
    if begin is not None:
        begin(x)


class AdapterKind(Protocol):
    """An `adapter` slot strategy, built once per target model with `factory(spec: AdapterSpec)`.

    `read(path, name)` on the engine's thread when an adapter is added (and on each rank when it is
    first loaded there): its host tensors, this rank's part, in whatever form `load` takes; a
    `RequestError` naming the problem and the fix for a folder it cannot serve (another kind, a
    rank over `max_rank`, a module the model has no target for).
    `layers()` once, before the model first runs: target module -> `AdapterLayer`.
    `load(slot, adapter)` puts an adapter read before into device slot `slot` (0 <= slot <
    max_adapters), replacing what was there, between forwards. `plan(batch)` once a forward, on
    every rank, before it (a CUDA graph's replay included). It keeps: its device slots' tensors
    and what `plan` derived, until the next `plan`."""

    def read(self, path: str, name: str) -> Any: ...

    def layers(self) -> Mapping[str, AdapterLayer]: ...

    def load(self, slot: int, adapter: Any) -> None: ...

    def plan(self, batch: AdapterBatch) -> None: ...


@runtime_checkable
class AdaptableModel(Protocol):
    """A model plugin that serves adapters: the projections an adapter may change, and where it calls
    the kind's layers. `attach_adapters` is called once, after the weights load, with a layer for
    each target module (a model that fuses an activation into a target's matmul, or pushes a partial
    sum before the delta could join it, stops doing so there)."""

    def adapter_targets(self) -> list[AdapterTarget]: ...

    def attach_adapters(self, layers: Mapping[str, AdapterLayer]) -> None: ...
