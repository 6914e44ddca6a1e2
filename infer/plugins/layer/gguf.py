"""GGUF weights kept in their block formats (`quantization` gguf): Q4_0, Q4_1, Q8_0, Q4_K, Q5_K and Q6_K.

A `.gguf` file (`--model FILE.gguf`, `infer.loading.gguf.gguf_folder`) reaches this layer as each
projection's raw block rows (`weight_blocks`, uint8 [rows, row bytes]) and a `weight_type` naming the format; a fused
projection (q, k, v; gate, up) gets its pieces one by one, each in its own format (a Q4_K_M file mixes
Q4_K and Q6_K). Each piece is taken apart once (`infer.kernels.gguf_reference.take_apart`): small
integers q and per group a float32 scale s and offset o, w = q * s + o, the values the gguf package's
own dequantization gives, bit for bit. 4-bit formats keep q two to a byte; 5-, 6- and 8-bit ones a byte
a value (so Q5_K, Q6_K and Q8_0 take a byte a weight here, not their 5.5 to 8.5 bits).
A piece stored in float (F16, F32, BF16) stays float.

The product: on the CPU (in bf16, or float32 for a row or two: `cpu_int4_pays`) a 4-bit piece whose
rows are a multiple of 16 goes through torch's int4 matmul over a second, repacked copy (`Piece.cpu_int4`);
otherwise the piece is dequantized in float32 and multiplied in the activation's dtype, as transformers runs a GGUF it has read. No GPU kernel
yet: on CUDA the same dequantize-then-multiply path runs.
"""

from __future__ import annotations

from typing import Any, Mapping

import gguf
import torch
import torch.nn.functional as F
from torch import nn

from infer.api import Capabilities
from infer.api.errors import ConfigError, ModelLoadError
from infer.api.hookspecs import hookimpl
from infer.kernels.gguf_reference import TYPES, Parts, take_apart
from infer.kernels.int4_reference import pack_nibbles, unpack_nibbles
from infer.plugins.layer.int4 import cpu_int4_pays

CPU_INT4 = ("Q4_0", "Q4_1", "Q4_K")  # formats torch's CPU int4 matmul runs (groups of 32)


class Piece(nn.Module):
    """Rows [offset, offset + size) of a projection in one format: `values` (a 4-bit format's q + `shift`
    two to a byte, uint8 [size, K/2]; another's q, int8 [size, K]), `scale` and `shift_by` (o, absent for
    0) per group; or a float piece's `weight`. Parameters, so that the model's weights count and move them."""

    def __init__(
        self, offset: int, size: int, kind: str, parts: Parts | None = None, weight: torch.Tensor | None = None
    ):
        super().__init__()
        self.offset, self.size, self.kind = offset, size, kind
        self.group, self.bits = (parts.group, parts.bits) if parts is not None else (0, 0)
        self.shift = 8 if kind == "Q4_0" else 0  # Q4_0's q is signed: stored as q + 8
        self.packed: tuple[torch.Tensor, torch.Tensor] | None = None  # the CPU int4 matmul's form, built once

        def param(t: torch.Tensor) -> nn.Parameter:
            return nn.Parameter(t, requires_grad=False)

        if parts is None:
            assert weight is not None
            self.weight = param(weight)
            return
        q = parts.q
        self.values = param(pack_nibbles(q.to(torch.int16) + self.shift) if self.bits == 4 else q)
        self.scale = param(parts.scale)
        self.shift_by = param(parts.offset) if parts.offset is not None else None

    def parts(self) -> Parts:
        q = self.values
        if self.bits == 4:
            q = (unpack_nibbles(q).to(torch.int16) - self.shift).to(torch.int8)
        return Parts(q, self.scale, self.shift_by, self.group, self.bits)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        if self.kind == "float":
            return self.weight.to(dtype)
        return self.parts().dequantize().to(dtype)

    def cpu_int4(self, x: torch.Tensor) -> torch.Tensor:
        """torch's int4 matmul: w = (u - 8) s + z with u the stored nibble (q + shift), z = o + (8 - shift) s."""
        if self.packed is None:
            u = unpack_nibbles(self.values).to(torch.int32).contiguous()
            offset = self.shift_by if self.shift_by is not None else torch.zeros_like(self.scale)
            zero = offset + (8 - self.shift) * self.scale
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(u, 2)
            self.packed = (packed, torch.stack([self.scale.t(), zero.t()], dim=-1).contiguous())
        packed, sz = self.packed
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, 32, sz.to(x.dtype))

    def runs_int4(self, x: torch.Tensor) -> bool:
        return self.kind in CPU_INT4 and self.size % 16 == 0 and cpu_int4_pays(x)


class GGUFLinear(nn.Module):
    quantization = "gguf"
    capabilities = Capabilities(priority=0)
    cpu_dtype = torch.bfloat16  # torch's CPU int4 matmul is fast in bf16 (`cpu_int4_pays`)

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("anchor", torch.empty(0), persistent=False)  # the device pieces load onto
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.pieces = nn.ModuleList()  # `Piece`s by offset
        self._pending: dict[int, dict[str, Any]] = {}  # offset -> the rows or the type, until both are read
        self._checked = False

    @classmethod
    def for_checkpoint(cls, quantization_config: Mapping[str, Any] | None) -> Any:
        if quantization_config is None:
            raise ConfigError(
                "--quantization gguf: GGUF weights come from a .gguf file only: pass --model FILE.gguf "
                "and drop --quantization"
            )
        return cls

    @torch.no_grad()
    def load_rows(self, name: str, offset: int, size: int, tensor: torch.Tensor) -> list[str]:
        """Rows [offset, offset + size): `weight_blocks` (raw block rows, uint8) with `weight_type` (the
        piece's ggml type id), or `weight` (a piece stored in float); `bias`."""
        self._checked = False
        if name == "bias" and self.bias is not None:
            self.bias[offset : offset + size].copy_(tensor)
            return ["bias"]
        if name == "weight" and tensor.dtype.is_floating_point:
            weight = tensor.to(self.anchor.device, torch.float32)
            return self._add(Piece(offset, size, "float", weight=weight))
        if name in ("weight_blocks", "weight_type"):
            pending = self._pending.setdefault(offset, {"size": size})
            pending["rows" if name == "weight_blocks" else "type"] = tensor
            if "rows" in pending and "type" in pending:
                del self._pending[offset]
                return self._add(self._piece(offset, size, pending["rows"], int(pending["type"])))
        return []

    def _piece(self, offset: int, size: int, rows: torch.Tensor, type_id: int) -> Piece:
        try:
            kind = gguf.GGMLQuantizationType(type_id).name
        except ValueError:
            kind = f"ggml type {type_id}"
        if kind not in TYPES:
            raise ModelLoadError(
                f"a GGUF projection is stored as {kind}, which this layer does not keep "
                f"(it keeps {', '.join(TYPES)}): use a GGUF of those formats (Q4_K_M, Q4_0, Q8_0, ...)"
            )
        try:
            parts = take_apart(kind, rows.to(self.anchor.device), self.in_features)
        except ValueError as exc:
            raise ModelLoadError(
                f"a GGUF projection's {kind} rows do not fit its {self.in_features} inputs: {exc}"
            ) from exc
        if parts.q.shape[0] != size:
            raise ModelLoadError(f"a GGUF projection piece has {parts.q.shape[0]} rows where {size} were expected")
        return Piece(offset, size, kind, parts=parts)

    def _add(self, piece: Piece) -> list[str]:
        """Keep `piece` (in place of one at its offset); the names of every piece's parameters, as loaded."""
        kept = sorted([p for p in self.pieces if p.offset != piece.offset] + [piece], key=lambda p: p.offset)
        self.pieces = nn.ModuleList(kept)
        return [name for name, _ in self.pieces.named_parameters(prefix="pieces")]

    def _check(self) -> None:
        at = 0
        for piece in self.pieces:
            if piece.offset != at:
                break
            at += piece.size
        if at != self.out_features or self._pending:
            raise ModelLoadError(
                f"a GGUF projection of {self.out_features} rows has only rows [0, {at}) loaded: the file lacks a "
                f"piece of it (q, k or v; gate or up)"
            )
        self._checked = True

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """W [N, K]: every piece's values, in `dtype`."""
        if not self._checked:
            self._check()
        return torch.cat([p.dequantized(dtype) for p in self.pieces])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self._checked:
            self._check()
        rows = x.reshape(-1, self.in_features)
        outs = []
        for piece in self.pieces:
            if piece.runs_int4(rows):
                outs.append(piece.cpu_int4(rows.contiguous()))
            else:
                outs.append(F.linear(rows, piece.dequantized(rows.dtype)))
        y = (outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)).reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


@hookimpl
def infer_register_layers(register) -> None:
    register("linear", GGUFLinear)
