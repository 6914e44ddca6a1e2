"""4-bit weights, 16-bit activations (W4A16): GPTQ, AWQ and compressed-tensors checkpoints, kept packed.

Three on-disk layouts of the same numbers: a weight W [N, K] in groups of `group_size` input columns
(or one group a row: per channel), each group's 4-bit values q with a scale s and a zero point z, so
W[n, k] = (q[n, k] - z[n, g(k)]) * s[n, g(k)], g(k) = k // group_size, or a checkpoint's own `g_idx`
(GPTQ's act-order, compressed-tensors' `weight_g_idx`: the columns quantized in another order).

- `gptq` (AutoGPTQ / GPTQModel): `qweight` [K/8, N] int32 packed along K, `qzeros` [G, N/8] int32
  packed along N (format v1 stores z - 1), `scales` [G, N], `g_idx` [K].
- `awq` (AutoAWQ, GEMM version): `qweight` [K, N/8] and `qzeros` [G, N/8] int32 packed along N in
  AWQ's interleaved order, `scales` [G, N]; always a zero point.
- `w4a16` (compressed-tensors `pack-quantized`, what llm-compressor writes): `weight_packed` [N, K/8]
  int32 packed along K, values offset by 8, `weight_scale` [N, G], `weight_zero_point` [N/8, G] packed
  along N (asymmetric only), `weight_g_idx` [K] (act-order).

Each loads into one form: `qweight` uint8 [N, K/2] (column 2j in the low nibble), `scales` float32 [N, G],
`zeros` uint8 [N, G], `g_idx` int32 [K]: a fused projection (q, k, v; gate, up) fills its rows piece by
piece, as it does with FP8. A weight in the model's dtype (a bf16 checkpoint with `--quantization`, or
`--load-format dummy`) is rounded to nearest in its groups here (RTN, GPTQ's grid: symmetric, zero 8).

The product dequantizes the weight in float32 and multiplies in the activation's dtype (what transformers
does once at load for these checkpoints: in float32 greedy tokens agree); on the CPU, where it pays
(`cpu_int4_pays`: bf16, or a row or two in float32) and the layout allows (groups of 32 to 256, rows a
multiple of 16), torch's int4 matmul runs instead over a second, repacked copy of the 4-bit weight, its
scales and zero points rounded to the activation's dtype. On a GPU up to GPU_GEMV_ROWS rows (decode steps)
take `infer.kernels.int4_gemv`, which streams the packed weight and dequantizes it in registers; more rows
dequantize it in one Triton pass (`infer.kernels.int4_dequant`) and multiply. Tensor parallelism is
refused (no `load_columns`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from infer.api import Capabilities
from infer.api.errors import ModelLoadError
from infer.api.hookspecs import hookimpl
from infer.kernels.int4_reference import AWQ_ORDER, pack_nibbles, quantize_rtn, unpack_int32, unpack_nibbles


@dataclass(frozen=True, slots=True)
class Int4Scheme:
    """How a checkpoint's 4-bit weights are grouped (config.json's `quantization_config`)."""

    group_size: int = 0  # input columns a scale covers; -1: one scale a row; 0: the largest of 128, 64, 32 that fits
    symmetric: bool = True
    zeros_minus_one: bool = False  # GPTQ format v1 stores each zero point less one


CPU_GROUPS = (32, 64, 128, 256)  # the group sizes torch's CPU int4 matmul takes
GPU_GEMV_ROWS = 8  # rows the GPU's int4 GEMV takes (`infer.kernels.int4_gemv`); more dequantize it in one pass


def cpu_int4_pays(x: torch.Tensor) -> bool:
    """Whether torch's CPU int4 matmul beats dequantizing the weight for `x`: in bf16 always (one row of a
    576 x 1536 projection on 2 cores: 27 us against 60 for the dense bf16 product alone); in float32 only
    for a row or two (754 us a row, against about 2.6 ms to dequantize; 16 rows: 12.5 ms)."""
    if x.device.type != "cpu":
        return False
    rows = x.numel() // x.shape[-1]
    return x.dtype == torch.bfloat16 or (x.dtype == torch.float32 and rows <= 2)


class Int4Linear(nn.Module):
    """The W4A16 linear of one checkpoint layout (a subclass per layout: its `quantization` and its
    `load_rows` of the layout's tensors)."""

    quantization = "w4a16"
    capabilities = Capabilities(priority=0)
    cpu_dtype = torch.bfloat16  # torch's CPU int4 matmul is fast in bf16 (`cpu_int4_pays`)

    default_scheme = Int4Scheme()  # `for_checkpoint` sets the checkpoint's

    def __init__(self, in_features: int, out_features: int, bias: bool = False, scheme: Int4Scheme | None = None):
        super().__init__()
        scheme = scheme if scheme is not None else self.default_scheme
        if scheme.group_size == 0:  # quantized as it loads: groups as large as divide the input
            group = next((g for g in (128, 64, 32) if in_features % g == 0), in_features)
            scheme = Int4Scheme(group, scheme.symmetric, scheme.zeros_minus_one)
        group = in_features if scheme.group_size == -1 else scheme.group_size
        if in_features % group or in_features % 8 or out_features % 8:
            raise ModelLoadError(
                f"a {in_features} -> {out_features} projection does not split into {group}-column groups of "
                f"4-bit weights packed 8 to a word: use a checkpoint quantized with a group size dividing "
                f"{in_features} (or the bf16 checkpoint)"
            )
        self.in_features, self.out_features, self.scheme, self.group = in_features, out_features, scheme, group
        groups = in_features // group

        def buffer(*shape: int, dtype: torch.dtype) -> nn.Parameter:
            return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)

        self.qweight = buffer(out_features, in_features // 2, dtype=torch.uint8)
        self.scales = buffer(out_features, groups, dtype=torch.float32)
        self.zeros = buffer(out_features, groups, dtype=torch.uint8)
        self.g_idx = buffer(in_features, dtype=torch.int32)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self._g_idx_source: str | None = None
        self._packed: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None  # the CPU's form
        self._balanced: bool | None = None
        self._act_order: bool | None = None  # whether g_idx scatters the groups (the GPU's GEMV reads it)

    @classmethod
    def for_checkpoint(cls, quantization_config: Mapping[str, Any] | None) -> Any:
        """The class's factory (in_features, out_features, bias) for a checkpoint's `quantization_config`
        (None: a model-dtype checkpoint quantized as it loads: symmetric groups of 128 columns, or 64 or
        32 where 128 does not divide the input)."""
        scheme = cls.scheme_of(quantization_config) if quantization_config else Int4Scheme()
        # a subclass, not a partial: the class's name and attributes stay readable (a refusal names it)
        return type(cls.__name__, (cls,), {"__qualname__": cls.__qualname__, "default_scheme": scheme})

    @staticmethod
    def scheme_of(qc: Mapping[str, Any]) -> Int4Scheme:
        return Int4Scheme(int(qc.get("group_size", 128)), bool(qc.get("sym", True)))

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """W [N, K] in `dtype`: (q - z) * s, computed in float32."""
        q = unpack_nibbles(self.qweight).float()
        g = self.g_idx.long()
        w = (q - self.zeros.float()[:, g]) * self.scales[:, g]
        return w.to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            return self._gpu_product(x)
        if self.group in CPU_GROUPS and self.out_features % 16 == 0 and self._even_groups() and cpu_int4_pays(x):
            return self._cpu_int4(x)
        return F.linear(x, self.dequantized(x.dtype), self.bias)

    def _gpu_product(self, x: torch.Tensor) -> torch.Tensor:
        """On the GPU: up to GPU_GEMV_ROWS rows (decode steps) stream the packed weight, dequantized in
        registers (`infer.kernels.int4_gemv`); more dequantize it in one Triton pass
        (`infer.kernels.int4_dequant`) for cuBLAS."""
        if self._act_order is None:  # once, outside any CUDA graph capture (the warm-up forward before it)
            plain = torch.arange(self.in_features, device=self.g_idx.device) // self.group
            self._act_order = not torch.equal(self.g_idx.long(), plain)
        rows = x.reshape(-1, self.in_features)
        if 0 < rows.shape[0] <= GPU_GEMV_ROWS:
            from infer.kernels.int4_gemv import int4_gemv

            y = int4_gemv(
                rows, self.qweight, self.scales, self.zeros, self.g_idx, self.group, self._act_order, self.bias
            )
            return y.reshape(*x.shape[:-1], self.out_features)
        from infer.kernels.int4_dequant import int4_dequantize

        w = int4_dequantize(self.qweight, self.scales, self.zeros, self.g_idx, self.group, self._act_order, x.dtype)
        return F.linear(x, w, self.bias)

    def _even_groups(self) -> bool:
        """Whether every group has `group` columns (act-order may scatter them, never unbalance them in
        GPTQ's checkpoints; a damaged g_idx dequantizes instead)."""
        if self._balanced is None:
            counts = torch.bincount(self.g_idx.long(), minlength=self.scales.shape[1])
            self._balanced = bool((counts == self.group).all())
        return self._balanced

    def _cpu_int4(self, x: torch.Tensor) -> torch.Tensor:
        """On the CPU (`cpu_int4_pays`): torch's int4 matmul over the weight repacked for it once (tinygemm's layout, w =
        (q - 8) * s + m with m = (8 - z) * s, the columns sorted by group when act-order scattered them)."""
        if self._packed is None:
            self._packed = self._cpu_pack()
        packed, scales_and_zeros, order = self._packed
        rows = x.reshape(-1, self.in_features)
        if order is not None:
            rows = rows.index_select(1, order)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            rows.contiguous(), packed, self.group, scales_and_zeros.to(rows.dtype)
        )
        y = y.reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def _cpu_pack(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        q = unpack_nibbles(self.qweight).to(torch.int32)
        g_idx = self.g_idx.long()
        order = None
        if not torch.equal(g_idx, torch.arange(self.in_features) // self.group):
            order = torch.argsort(g_idx, stable=True)  # act-order: each group's columns together
            q = q[:, order]
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.contiguous(), 2)
        scales = self.scales.t()
        mins = (8.0 - self.zeros.float().t()) * scales
        return packed, torch.stack([scales, mins], dim=-1).contiguous(), order

    # ------------------------------------------------------------------ loading

    @torch.no_grad()
    def load_rows(self, name: str, offset: int, size: int, tensor: torch.Tensor) -> list[str]:
        """Rows [offset, offset + size) from a checkpoint tensor `name`: this layout's (`load_layout`) or a
        model-dtype `weight`, rounded to nearest here."""
        rows = slice(offset, offset + size)
        self._packed, self._balanced, self._act_order = None, None, None  # found again from what is loaded
        if name == "weight" and tensor.dtype.is_floating_point:
            q, s, z = quantize_rtn(tensor.to(self.qweight.device), self.scheme.group_size, self.scheme.symmetric)
            self.qweight[rows].copy_(pack_nibbles(q))
            self.scales[rows].copy_(s)
            self.zeros[rows].copy_(z)
            self._set_g_idx(torch.arange(self.in_features, device=self.g_idx.device) // self.group, "its groups")
            return ["qweight", "scales", "zeros", "g_idx"]
        if name == "bias" and self.bias is not None:
            self.bias[rows].copy_(tensor)
            return ["bias"]
        return self.load_layout(name, rows, tensor)

    def load_layout(self, name: str, rows: slice, tensor: torch.Tensor) -> list[str]:
        raise NotImplementedError

    def _set_g_idx(self, g_idx: torch.Tensor, source: str) -> None:
        """One column order for the whole fused projection: q, k and v (gate and up) see the same input,
        so act-order gives them the same one."""
        g_idx = g_idx.to(device=self.g_idx.device, dtype=torch.int32).reshape(-1)
        if g_idx.numel() != self.in_features or int(g_idx.min()) < 0 or int(g_idx.max()) >= self.scales.shape[1]:
            span = f" in [{int(g_idx.min())}, {int(g_idx.max())}]" if g_idx.numel() else ""
            raise ModelLoadError(
                f"{source}: a g_idx of {g_idx.numel()} entries{span} for a projection of {self.in_features} "
                f"inputs in {self.scales.shape[1]} groups: the checkpoint is damaged"
            )
        if self._g_idx_source is not None and not torch.equal(self.g_idx, g_idx):
            raise ModelLoadError(
                f"{source}: the pieces of one fused projection (q, k, v or gate, up) order their input columns "
                f"differently (g_idx), which this layer cannot hold: quantize them with one order"
            )
        self.g_idx.copy_(g_idx)
        self._g_idx_source, self._balanced = source, None

    def _fill(self, rows: slice, q: torch.Tensor | None = None, scales=None, zeros=None, name: str = "") -> list[str]:
        size, groups = rows.stop - rows.start, self.scales.shape[1]
        for what, got, want in (("values", q, (size, self.in_features)), ("scales", scales, (size, groups)),
                                ("zero points", zeros, (size, groups))):  # fmt: skip
            if got is not None and tuple(got.shape) != want:
                raise ModelLoadError(
                    f"tensor {name} holds {what} for a {list(got.shape)} weight, but config.json and its "
                    f"quantization_config imply {list(want)} ({self.quantization}, group size "
                    f"{self.scheme.group_size}): use the config.json saved with these weights"
                )
        filled = []
        if q is not None:
            self.qweight[rows].copy_(pack_nibbles(q.to(self.qweight.device)))
            filled.append("qweight")
            if self._g_idx_source is None:  # the default order until a g_idx says otherwise
                self.g_idx.copy_(torch.arange(self.in_features, device=self.g_idx.device) // self.group)
                filled.append("g_idx")
        if scales is not None:
            self.scales[rows].copy_(scales.float())
            filled.append("scales")
        if zeros is not None:
            self.zeros[rows].copy_(zeros.to(torch.uint8))
            filled.append("zeros")
        return filled


class GPTQLinear(Int4Linear):
    quantization = "gptq"

    @staticmethod
    def scheme_of(qc: Mapping[str, Any]) -> Int4Scheme:
        v1 = str(qc.get("checkpoint_format", "gptq")) == "gptq"
        return Int4Scheme(int(qc.get("group_size", 128)), bool(qc.get("sym", True)), zeros_minus_one=v1)

    def load_layout(self, name: str, rows: slice, tensor: torch.Tensor) -> list[str]:
        if name == "qweight":  # [K/8, n]
            return self._fill(rows, q=unpack_int32(tensor, 0).t(), name=name)
        if name == "scales":  # [G, n]
            return self._fill(rows, scales=tensor.t(), name=name)
        if name == "qzeros":  # [G, n/8]
            zeros = unpack_int32(tensor, 1).t() + (1 if self.scheme.zeros_minus_one else 0)  # v1: 1..16
            return self._fill(rows, zeros=zeros, name=name)
        if name == "g_idx":
            self._set_g_idx(tensor, "g_idx")
            return ["g_idx"]
        return []


class AWQLinear(Int4Linear):
    quantization = "awq"

    @staticmethod
    def scheme_of(qc: Mapping[str, Any]) -> Int4Scheme:
        return Int4Scheme(int(qc.get("group_size", qc.get("q_group_size", 128))), symmetric=False)

    def load_layout(self, name: str, rows: slice, tensor: torch.Tensor) -> list[str]:
        if name == "qweight":  # [K, n/8]
            return self._fill(rows, q=unpack_int32(tensor, 1, AWQ_ORDER).t(), name=name)
        if name == "scales":  # [G, n]
            return self._fill(rows, scales=tensor.t(), name=name)
        if name == "qzeros":  # [G, n/8]
            return self._fill(rows, zeros=unpack_int32(tensor, 1, AWQ_ORDER).t(), name=name)
        return []


class CompressedInt4Linear(Int4Linear):
    quantization = "w4a16"

    @staticmethod
    def scheme_of(qc: Mapping[str, Any]) -> Int4Scheme:
        weights = next(iter((qc.get("config_groups") or {}).values()), {}).get("weights") or {}
        group = int(weights.get("group_size") or -1) if weights.get("strategy") == "group" else -1
        return Int4Scheme(group, bool(weights.get("symmetric", True)))

    def load_layout(self, name: str, rows: slice, tensor: torch.Tensor) -> list[str]:
        if name == "weight_packed":  # [n, K/8], values + 8
            return self._fill(rows, q=unpack_int32(tensor, 1), name=name)
        if name == "weight_scale":  # [n, G]
            filled = self._fill(rows, scales=tensor.reshape(tensor.shape[0], -1), name=name)
            if self.scheme.symmetric:
                self.zeros[rows].fill_(8)
                filled.append("zeros")
            return filled
        if name == "weight_zero_point":  # [n/8, G] packed along n, values + 8
            return self._fill(rows, zeros=unpack_int32(tensor, 0), name=name)
        if name == "weight_g_idx":
            self._set_g_idx(tensor, "weight_g_idx")
            return ["g_idx"]
        return []  # weight_shape: the layer knows its own


@hookimpl
def infer_register_layers(register) -> None:
    register("linear", GPTQLinear)
    register("linear", AWQLinear)
    register("linear", CompressedInt4Linear)
