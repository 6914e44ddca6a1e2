"""Where one tensor-parallel rank's slice of a checkpoint tensor sits in the full (tp = 1) tensor.

The parallel layers (infer.distributed.layers) carry a `Shard` per weight; the loader reads only those
rows or columns of a checkpoint tensor, and dummy initialisation cuts them from the very tensor tp = 1
draws, so the model is the same at every tp size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

__all__ = ["RowParallelQuantized", "Shard", "load_quantized", "shard_of", "take_quantized"]


@dataclass(frozen=True, slots=True)
class Shard:
    """Along `dim`, the full weight is the concatenation of `full_sizes` pieces (q, k, v; gate, up; or
    one piece); this rank holds `ranges[i]` of piece i, the pieces one after another, then zero rows."""

    dim: int  # 0: output rows (column- and vocab-parallel); 1: input columns (row-parallel)
    full_sizes: tuple[int, ...]
    ranges: tuple[tuple[int, int], ...]  # piece i -> (start within the piece, length)

    @property
    def local_size(self) -> int:
        return sum(n for _, n in self.ranges)

    def full_shape(self, local_shape: torch.Size) -> list[int]:
        shape = list(local_shape)
        shape[self.dim] = sum(self.full_sizes)
        return shape

    def load(self, param: torch.Tensor, piece: int, source: Any) -> None:
        """Copy this rank's part of piece `piece` from `source`, the piece alone: a tensor or a
        safetensors slice (indexing a slice reads just those rows or columns from the file)."""
        start, n = self.ranges[piece]
        offset = sum(length for _, length in self.ranges[:piece])
        part = source[start : start + n] if self.dim == 0 else source[:, start : start + n]
        param.narrow(self.dim, offset, n).copy_(part)

    def take(self, param: torch.Tensor, full: torch.Tensor) -> None:
        """Fill `param` with this rank's part of the full (fused) tensor."""
        param.zero_()  # padding rows (vocab) stay zero
        base = 0
        for piece, size in enumerate(self.full_sizes):
            self.load(param, piece, full.narrow(self.dim, base, size))
            base += size


def shard_of(model: nn.Module, param_name: str) -> Shard | None:
    """The `Shard` of a parameter's module, or None when the parameter is whole on every rank (a
    norm; a row-parallel layer's bias, which has no input dimension to split)."""
    owner_name = param_name.rpartition(".")[0]
    owner = model.get_submodule(owner_name)
    shard = owner.__dict__.get("shard")
    if shard is None or shard.dim >= model.get_parameter(param_name).dim():
        return None
    return shard


@runtime_checkable
class RowParallelQuantized(Protocol):
    """A quantized linear (`QuantizedLinear`) that can hold a row-parallel shard: `load_columns(name, start,
    tensor)` fills it with columns [start, start + in_features) of the whole checkpoint tensor `name`,
    quantizing each whole row first (so its scales are tp = 1's), and returns the parameter names filled.
    Its forward takes this rank's columns of x and returns this rank's partial sum."""

    def load_columns(self, name: str, start: int, tensor: torch.Tensor) -> list[str]: ...


def whole(source: Any) -> torch.Tensor:
    """A checkpoint tensor read whole: a tensor, or a safetensors slice (of any rank, a scalar too)."""
    return source if isinstance(source, torch.Tensor) else source[...]


def load_quantized(linear: Any, shard: Shard, name: str, piece: int, source: Any) -> list[str]:
    """Fill `linear`, a quantized linear holding `shard` (`QuantizedLinear`; `RowParallelQuantized` when row-parallel),
    from piece `piece` of checkpoint tensor `name`; returns the parameter names filled. Column-parallel: this
    rank's rows (a scale per tensor: whole); row-parallel: this rank's columns of the whole tensor, whose
    scales and bias are whole, the bias on the rank holding the first columns only (the partial sums add
    it once)."""
    start, n = shard.ranges[piece]
    if shard.dim == 0:
        offset = sum(length for _, length in shard.ranges[:piece])
        shape = source.shape if isinstance(source, torch.Tensor) else source.get_shape()
        rows = source[start : start + n] if len(shape) and shape[0] == shard.full_sizes[piece] else whole(source)
        return linear.load_rows(name, offset, n, rows)
    if name == "bias":
        linear.bias.copy_(whole(source) if start == 0 else torch.zeros_like(linear.bias))
        return ["bias"]
    return linear.load_columns(name, start, whole(source))


def take_quantized(linear: Any, shard: Shard, name: str, full: torch.Tensor) -> None:
    """`load_quantized` from the full (fused, tp = 1) tensor, every piece of it."""
    base = 0
    for piece, size in enumerate(shard.full_sizes):
        load_quantized(linear, shard, name, piece, full.narrow(shard.dim, base, size))
        base += size
