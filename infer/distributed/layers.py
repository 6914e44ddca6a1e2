"""Megatron-style tensor-parallel layers (used by the built-in models when the tensor-parallel group has more than one rank).

Column-parallel (qkv_proj, gate_up_proj): a rank holds some output rows (its query heads and KV
heads, its slice of the MLP width) and needs no communication; its output stays split. Row-parallel
(o_proj, down_proj): a rank holds the matching input columns, and the partial outputs are summed by
ONE all-reduce. Vocab-parallel embedding and LM head: a rank holds a contiguous slice of the
vocabulary (the last one padded with zero rows); the embedding masks ids outside it and all-reduces,
the head computes its slice of the logits and rank 0 gathers the rest. A partial sum left unreduced
(`reduce=False`, or pushed into the ranks' exchange) is summed by the norm that takes it
(`reduce_add_norm`, `reduce_norm`), fused with it where the fast all-reduce can.

Each parallel module carries a `Shard` saying where its weight sits in the full (tp = 1) weight. The
loader reads only those rows or columns of a checkpoint tensor (a safetensors slice), and dummy
initialisation cuts them from the very tensor tp = 1 draws: the model is the same at every tp size.
The matmuls are plain `F.linear`, or the layers hook's linear's `matmul` where it has one. Under a
quantization the projections are the run's quantized linear itself, built at this rank's shape and
carrying its `Shard` (its own forward, kernels and all, is the local product; `quantized_shard`).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from infer.api import PlainRMSNorm, QuantizedLinear, pushes_partial_sums
from infer.api.config import ModelConfig
from infer.api.errors import ConfigError
from infer.api.weights import check_unscaled
from infer.distributed.state import ParallelState
from infer.loading.shards import RowParallelQuantized, Shard, load_quantized, shard_of

Matmul = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (x [T, in], weight [out, in]) -> [T, out]


def split(size: int, parallel: ParallelState) -> tuple[int, int]:
    """This rank's (start, length) of `size` split evenly."""
    n = size // parallel.world_size
    return parallel.rank * n, n


class ColumnParallelLinear(nn.Module):
    """y_r = x W_r^T: this rank's output rows; the output stays split across ranks."""

    def __init__(self, in_features: int, shard: Shard, matmul: Matmul = F.linear, bias: bool = False) -> None:
        super().__init__()
        self.shard = shard
        self.matmul = matmul
        self.weight = nn.Parameter(torch.empty(shard.local_size, in_features))
        self.bias = nn.Parameter(torch.empty(shard.local_size)) if bias else None  # the same rows as the weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(x, self.weight)
        return y if self.bias is None else y + self.bias


class RowParallelLinear(nn.Module):
    """y = sum_r x_r W_r^T: this rank's input columns, then one all-reduce. With `reduce=False` the
    output is this rank's partial sum, and whoever takes it sums it (`reduce_add_norm`,
    which can fuse the all-reduce with the residual add and RMSNorm that follow). With `push` (set by
    a model whose every partial sum is taken so), a matmul that can (`matmul.pushes`) stores a
    one-token partial sum straight into the ranks' exchange (`infer.distributed.all_reduce.lamport`).
    A bias is whole on every rank and added once: after the all-reduce, or by rank 0's partial sum."""

    def __init__(
        self,
        out_features: int,
        shard: Shard,
        parallel: ParallelState,
        matmul: Matmul = F.linear,
        reduce: bool = True,
        bias: bool = False,
    ) -> None:
        super().__init__()
        self.shard = shard
        self.parallel = parallel
        self.matmul = matmul
        self.reduce = reduce
        self.push = False
        self.weight = nn.Parameter(torch.empty(out_features, shard.local_size))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x: torch.Tensor, matmul: Matmul | None = None) -> torch.Tensor:
        """`matmul`: another with the same contract (e.g. the activation's fused down projection)."""
        matmul = matmul or self.matmul
        target = None
        if self.push and pushes_partial_sums(matmul):
            target = push_target(self.parallel, x, self.weight.shape[0])
        y = matmul(x, self.weight) if target is None else matmul(x, self.weight, push=target)
        if self.bias is None:
            return self.parallel.all_reduce(y) if self.reduce else y
        if self.reduce:
            return self.parallel.all_reduce(y) + self.bias
        assert target is None, "a model whose row-parallel layers have biases does not push"
        return y + self.bias if self.parallel.rank == 0 else y


class VocabParallelEmbedding(nn.Module):
    """Rows [start, start + num_local) of the [vocab, hidden] table; as the LM head, the same slice
    of the logits."""

    def __init__(self, vocab_size: int, hidden_size: int, parallel: ParallelState, matmul: Matmul = F.linear) -> None:
        super().__init__()
        self.matmul = matmul  # for the logits
        per_rank = -(-vocab_size // parallel.world_size)
        self.vocab_size = vocab_size
        self.start = parallel.rank * per_rank
        self.num_local = max(0, min(per_rank, vocab_size - self.start))
        self.parallel = parallel
        self.shard = Shard(0, (vocab_size,), ((self.start, self.num_local),))
        self.weight = nn.Parameter(torch.zeros(per_rank, hidden_size))
        self.push = False  # set by a model whose layers push: a one-token embedding goes to the exchange

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # input_ids: [T] -> [T, hidden]; an id outside this rank's rows contributes zeros
        if self.push and (target := embed_push_target(self.parallel, input_ids, self.weight)) is not None:
            from infer.kernels.layers import embedding_push

            return embedding_push(input_ids, self.weight, self.start, self.num_local, target)  # summed by the next norm
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.num_local)
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.parallel.all_reduce(x.masked_fill_(outside[:, None], 0.0))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [R, hidden] -> [R, vocab] float32 (complete on rank 0)
        return self.parallel.gather_columns(self.matmul(hidden, self.weight))[:, : self.vocab_size].float()


class ParallelLMHead(VocabParallelEmbedding):
    """An untied LM head: the same vocab-parallel [vocab, hidden] weight, used through `logits`."""


def reduce_add_norm(
    parallel: ParallelState, x: torch.Tensor, residual: torch.Tensor, norm: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(sum_r x_r + residual), sum_r x_r + residual) for a row-parallel layer's partial
    output `x`: one all-reduce, fused with the residual add and RMSNorm when the fast all-reduce
    has such a kernel and `norm` is a plain RMSNorm (the layers hook's `rms_norm` contract)."""
    fast = parallel.fast_all_reduce
    plain = _plain(norm)
    if (exchange := parallel.exchange) is not None and exchange.takes(x):  # pushed by its GEMV
        return exchange.reduce(x, residual, norm.weight, norm.eps) if plain else norm(exchange.reduce(x), residual)
    if fast is not None and fast.add_rms_norm is not None and plain and fast.fits(x):
        return fast.add_rms_norm(x, residual, norm.weight, norm.eps)
    return norm(parallel.all_reduce(x), residual)


def reduce_norm(parallel: ParallelState, x: torch.Tensor, norm: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x), x) for the first layer's input: summed first where the vocab-parallel embedding
    pushed it into the exchange, else whole on every rank already."""
    if (exchange := parallel.exchange) is None or not exchange.takes(x):
        return norm(x), x
    if _plain(norm):
        return exchange.reduce(x, None, norm.weight, norm.eps)
    total = exchange.reduce(x)
    return norm(total), total


def _plain(norm: Any) -> bool:
    """Whether the reduce may compute `norm` itself, from its `weight` and `eps` (`PlainRMSNorm`)."""
    return isinstance(norm, PlainRMSNorm) and bool(norm.plain_rms_norm)


def push_target(parallel: ParallelState, x: torch.Tensor, out_features: int) -> Any:
    """Where a row-parallel layer's GEMV over `x` pushes its partial sum (`PushTarget`), or None
    when this step's sums go through the all-reduce. The same answer on every rank."""
    exchange = parallel.exchange
    if exchange is None or out_features != exchange.hidden_size or not exchange.fits(x):
        return None
    return exchange.target()


def embed_push_target(parallel: ParallelState, input_ids: torch.Tensor, weight: torch.Tensor) -> Any:
    """Where a vocab-parallel embedding of `input_ids` with `weight` pushes its rows, or None
    (more than one token, or no exchange for these rows). The same answer on every rank."""
    exchange = parallel.exchange
    if (
        exchange is None
        or input_ids.numel() != 1
        or weight.dtype != exchange.dtype
        or weight.shape[1] != exchange.hidden_size
    ):
        return None
    return exchange.embed_target()


def quantized_shard(linear: Any, features: int, shard: Shard, bias: bool = False) -> nn.Module:
    """The quantized linear class `linear` (`QuantizedLinear`) at this rank's shape, carrying `shard`:
    column-parallel [shard's rows, features], or row-parallel [features, shard's columns], whose output is
    this rank's partial sum (its bias held by the rank with the first columns: `load_quantized`). Its
    weights are tp = 1's (`RowParallelQuantized.load_columns`); it quantizes its own columns of x as it
    would a whole input, so no collective precedes the product."""
    if shard.dim == 1 and not isinstance(linear, RowParallelQuantized):
        raise ConfigError(
            f"the quantized linear {linear.__module__}.{linear.__qualname__} cannot hold a row-parallel shard "
            f"(it has no load_columns): use --tp 1 with this quantization"
        )
    in_features, out_features = (features, shard.local_size) if shard.dim == 0 else (shard.local_size, features)
    module = linear(in_features, out_features, bias=bias)
    module.shard = shard  # a plain attribute: `shard_of` and `load_sharded` read it
    return module


def attention_projections(
    config: ModelConfig,
    parallel: ParallelState,
    matmul: Matmul = F.linear,
    qkv_bias: bool = False,
    o_bias: bool = False,
    reduce: bool = False,
    quantized: Any = None,
) -> tuple[nn.Module, nn.Module]:
    """qkv_proj (this rank's q, k and v heads, fused) and o_proj (the matching input columns; its
    partial output is summed by the norm that takes it, see the models' `DecoderLayer`, or by
    o_proj itself with `reduce`). `quantized`: the run's quantized linear class, which then holds
    both shards (`quantized_shard`; their partial sums are left to the norm)."""
    d = config.head_dim
    heads = parallel.heads(config.num_heads, config.num_kv_heads)
    q_full, kv_full = config.num_heads * d, config.num_kv_heads * d
    q = (heads.q_start * d, heads.num_heads * d)
    kv = (heads.kv_start * d, heads.num_kv_heads * d)  # the same KV head on several ranks when replicated
    qkv_shard = Shard(0, (q_full, kv_full, kv_full), (q, kv, kv))
    if quantized is not None:
        _check_partial_sums(reduce)
        o_shard = Shard(1, (q_full,), (q,))
        return quantized_shard(quantized, config.hidden_size, qkv_shard, qkv_bias), quantized_shard(
            quantized, config.hidden_size, o_shard, o_bias
        )
    qkv_proj = ColumnParallelLinear(config.hidden_size, qkv_shard, matmul, bias=qkv_bias)
    o_proj = RowParallelLinear(config.hidden_size, Shard(1, (q_full,), (q,)), parallel, matmul, reduce, o_bias)
    return qkv_proj, o_proj


def _check_partial_sums(reduce: bool) -> None:
    if reduce:  # a quantized row-parallel shard's partial sum is summed by the norm after it
        raise ConfigError(
            "FP8 weights under --tp need a family whose row-parallel outputs the next norm sums, which this "
            "model's (Gemma 2) is not: use --tp 1 with --quantization fp8, or drop --quantization"
        )


def mlp_projections(
    config: Any, parallel: ParallelState, matmul: Matmul = F.linear, reduce: bool = False, quantized: Any = None
) -> tuple[nn.Module, nn.Module]:
    """gate_up_proj (this rank's slice of gate and of up, fused) and down_proj (the same slice of its
    input; its partial output is summed by the norm that takes it, or by down_proj itself with `reduce`).
    `quantized`: as for `attention_projections`."""
    width = config.intermediate_size
    part = split(width, parallel)
    if quantized is not None:
        _check_partial_sums(reduce)
        gate_up = Shard(0, (width, width), (part, part))
        return quantized_shard(quantized, config.hidden_size, gate_up), quantized_shard(
            quantized, config.hidden_size, Shard(1, (width,), (part,))
        )
    gate_up_proj = ColumnParallelLinear(config.hidden_size, Shard(0, (width, width), (part, part)), matmul)
    down_proj = RowParallelLinear(config.hidden_size, Shard(1, (width,), (part,)), parallel, matmul, reduce)
    return gate_up_proj, down_proj


def load_sharded(
    model: nn.Module,
    weights: Iterable[tuple[str, Any]],
    target: Callable[[str], tuple[str, int | None] | None],
) -> set[str]:
    """Fill a tensor-parallel model from (checkpoint name, tensor or safetensors slice) pairs, reading
    only this rank's part of each. `target(name)` names the parameter a tensor fills and its piece
    of a fused parameter (None: unfused), or returns None for a tensor the model does not use."""
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for hf_name, source in weights:
        found = target(hf_name)
        if found is None or found[0] not in params:
            continue  # layers beyond an early-exit cut, or tensors this model does not use
        name, piece = found
        owner, _, attr = name.rpartition(".")
        module = model.get_submodule(owner)
        if isinstance(module, QuantizedLinear):  # its form (and scales) from its rows or columns: `quantized_shard`
            loaded.update(f"{owner}.{p}" for p in load_quantized(module, module.shard, attr, piece or 0, source))
            continue
        shard = shard_of(model, name)
        if shard is None:
            params[name].data.copy_(check_unscaled(name, source[:], params[name]))  # whole on every rank (norms)
        else:
            check_unscaled(name, source, params[name])
            shard.load(params[name].data, piece or 0, source)
        loaded.add(name)
    return loaded
