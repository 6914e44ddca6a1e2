"""`llama`: the Llama-2 / Llama-3 architecture (and SmolLM2, which shares it).

RMSNorm, rotary embeddings as transformers computes them for the config's rope_parameters, grouped-query attention over
the paged KV cache, SwiGLU, tied or untied embeddings. Q/K/V and gate/up are fused into one
matmul each; `load_weights` maps HF checkpoint names onto the fused parameters. Given a
tensor-parallel `parallel` state (`--tp N`), the projections, embedding and LM head are the
sharded ones of `parallel_layers` and each rank loads only its slices.
"""

from __future__ import annotations

import functools
import inspect
import itertools
from typing import Any, Iterable, Iterator

import torch
from torch import nn

from infer.core.config import ModelConfig
from infer.core.hookspecs import hookimpl
from infer.core.interfaces import (
    AttentionBackend,
    FusingActivation,
    KVCache,
    Layers,
    LinearMatmul,
    PushingMatmul,
    RotaryFusingAttention,
    RotaryTables,
)
from infer.distributed import layers as tp
from infer.distributed.state import ParallelState
from infer.models.loader import check_shape
from infer.models.rope import Rope

_LLAMA2 = dict(
    architectures=["LlamaForCausalLM"],
    vocab_size=32000,
    max_position_embeddings=4096,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    bos_token_id=1,
    eos_token_id=2,
    torch_dtype="float16",
)
_LLAMA3 = dict(
    architectures=["LlamaForCausalLM"],
    vocab_size=128256,
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    bos_token_id=128000,
    eos_token_id=[128001, 128009],
    torch_dtype="bfloat16",
)

PRESETS: dict[str, dict[str, Any]] = {
    "llama2-7b": {
        **_LLAMA2,
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
    },
    "llama2-13b": {
        **_LLAMA2,
        "hidden_size": 5120,
        "intermediate_size": 13824,
        "num_hidden_layers": 40,
        "num_attention_heads": 40,
        "num_key_value_heads": 40,
    },
    "llama2-70b": {
        **_LLAMA2,
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
    },
    "llama3-8b": {
        **_LLAMA3,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
    },
    "smollm2-135m": {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 49152,
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "rope_theta": 100000.0,
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "bfloat16",
    },
}


_FUSED = {  # HF name piece -> (our name piece, shard index)
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


def tp_matmul(layers: Layers) -> Any:
    """The chosen linear layer's matmul for the tensor-parallel projections (F.linear when it has none)."""
    return layers.linear.matmul if isinstance(layers.linear, LinearMatmul) else torch.nn.functional.linear


def pushes_partial_sums(matmul: Any) -> bool:
    fn = matmul.__func__ if inspect.ismethod(matmul) else matmul  # a bound method's attributes are its function's
    return isinstance(fn, PushingMatmul) and bool(fn.pushes)


class LlamaAttention(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        layers: Layers,
        attention: AttentionBackend,
        parallel: ParallelState | None = None,
        rope: Rope | None = None,  # default: config.rope(); the model computes it once for all layers
    ) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        if parallel is not None:  # this rank's heads
            heads = parallel.heads(config.num_heads, config.num_kv_heads)
            self.num_heads, self.num_kv_heads = heads.num_heads, heads.num_kv_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        if parallel is None:
            self.qkv_proj = layers.linear(config.hidden_size, self.q_size + 2 * self.kv_size)
            self.o_proj = layers.linear(self.q_size, config.hidden_size)
        else:
            self.qkv_proj, self.o_proj = tp.attention_projections(config, parallel, tp_matmul(layers))
        self.rotary = layers.rotary_embedding(rope or config.rope(), config.max_position_embeddings)
        self.attention = attention
        # a rotary layer that lends its tables to a backend whose cache write can rotate q and k
        self.rotary_in_attention = (
            isinstance(self.rotary, RotaryTables)
            and bool(self.rotary.fuses_into_attention)
            and isinstance(attention, RotaryFusingAttention)
            and bool(attention.fuses_rotary())
        )

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv_cache: KVCache) -> torch.Tensor:
        # x: [T, hidden]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.rotary_in_attention:
            out = self.attention.forward_with_rotary(positions, q, k, v, kv_cache, self.rotary.cos, self.rotary.sin)
        else:
            q, k = self.rotary(positions, q, k)
            out = self.attention.forward(q, k, v, kv_cache)  # [T, H, D]
        return self.o_proj(out.reshape(-1, self.q_size))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig, layers: Layers, parallel: ParallelState | None = None) -> None:
        super().__init__()
        if parallel is None:
            self.gate_up_proj = layers.linear(config.hidden_size, 2 * config.intermediate_size)
            self.down_proj = layers.linear(config.intermediate_size, config.hidden_size)
        else:
            self.gate_up_proj, self.down_proj = tp.mlp_projections(config, parallel, tp_matmul(layers))
        self.act = layers.silu_and_mul()
        # an activation that can apply itself inside the down projection's matmul (one kernel)
        self.fused_down = isinstance(self.act, FusingActivation) and bool(self.act.fuses_with(self.down_proj))
        self.row_parallel = parallel is not None

    @property
    def down_matmul(self) -> Any:
        return self.act.down if self.fused_down else self.down_proj.matmul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.gate_up_proj(x)
        if self.fused_down:
            if self.row_parallel:  # through the shard's forward, which may push its partial sum
                return self.down_proj(h, matmul=self.act.down)
            return self.act.down(h, self.down_proj.weight)
        return self.down_proj(self.act(h))


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        layers: Layers,
        attention: AttentionBackend,
        parallel: ParallelState | None = None,
        rope: Rope | None = None,
    ) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layers, attention, parallel, rope)
        self.mlp = LlamaMLP(config, layers, parallel)
        self.input_layernorm = layers.rms_norm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = layers.rms_norm(config.hidden_size, config.rms_norm_eps)
        # tensor parallel: o_proj and down_proj return partial sums, which the next residual add and
        # norm sum first (one all-reduce, fused with them where it can be)
        self.add_norm = add_norm_for(parallel)
        self.first_norm = first_norm if parallel is None else functools.partial(tp.reduce_norm, parallel)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None, kv_cache: KVCache
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:  # the first layer: x is the embedding (under tensor parallelism maybe still to be summed)
            x, residual = self.first_norm(x, self.input_layernorm)
        else:  # x is the previous layer's MLP output
            x, residual = self.add_norm(x, residual, self.input_layernorm)
        x = self.self_attn(positions, x, kv_cache)
        x, residual = self.add_norm(x, residual, self.post_attention_layernorm)
        return self.mlp(x), residual


def add_norm(x: torch.Tensor, residual: torch.Tensor, norm: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """norm(x + residual) and x + residual, at tp = 1 (the norm adds)."""
    return norm(x, residual)


def first_norm(x: torch.Tensor, norm: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """norm(x) and x: the first layer's input and the residual it starts, at tp = 1."""
    return norm(x), x


def add_norm_for(parallel: ParallelState | None) -> Any:
    """The residual add and norm after a layer's output: under tensor parallelism the output is a
    partial sum, all-reduced first (fused with them where it can: `tp.reduce_add_norm`)."""
    return add_norm if parallel is None else functools.partial(tp.reduce_add_norm, parallel)


class Llama(nn.Module):
    hf_architectures = ("LlamaForCausalLM",)
    presets = PRESETS

    def __init__(
        self, config: ModelConfig, layers: Layers, attention: AttentionBackend, parallel: ParallelState | None = None
    ) -> None:
        super().__init__()
        self.config = config
        self.parallel = parallel  # None: one rank (--tp 1)
        if parallel is None:
            self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        else:
            self.embed_tokens = tp.VocabParallelEmbedding(
                config.vocab_size, config.hidden_size, parallel, tp_matmul(layers)
            )
        rope = config.rope()
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, layers, attention, parallel, rope) for _ in range(config.num_layers)
        )
        self.norm = layers.rms_norm(config.hidden_size, config.rms_norm_eps)
        self.pushes = False  # whether one-token steps' partial sums go to the ranks' exchange, where it exists
        if parallel is not None:
            # a one-token step's partial sums may be pushed into the ranks' exchange by the GEMVs that
            # make them (infer.distributed.all_reduce.lamport), which takes them in pairs: every row-parallel layer
            # pushes, or none does
            pushes = all(
                pushes_partial_sums(layer.self_attn.o_proj.matmul) and pushes_partial_sums(layer.mlp.down_matmul)
                for layer in self.layers
            )
            for layer in self.layers:
                layer.self_attn.o_proj.push = layer.mlp.down_proj.push = pushes
            self.embed_tokens.push = self.pushes = pushes
        self.lm_head = None
        if not config.tie_word_embeddings:
            self.lm_head = (
                layers.linear(config.hidden_size, config.vocab_size)
                if parallel is None
                else tp.ParallelLMHead(config.vocab_size, config.hidden_size, parallel, tp_matmul(layers))
            )

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[KVCache],
        num_layers: int | None = None,  # run only the first layers (early exit, self-draft)
    ) -> torch.Tensor:  # [T, hidden], after the final norm
        x, residual = self.embed_tokens(input_ids), None
        for layer, kv_cache in zip(itertools.islice(self.layers, num_layers or len(self.layers)), kv_caches):
            x, residual = layer(positions, x, residual, kv_cache)
        x, _ = add_norm_for(self.parallel)(x, residual, self.norm)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [B, hidden] -> [B, vocab] float32
        if self.parallel is not None:  # each rank's vocabulary slice, gathered on rank 0
            return (self.embed_tokens if self.lm_head is None else self.lm_head).logits(hidden)
        if self.lm_head is not None:
            return self.lm_head(hidden).float()  # the layers hook's linear (one token: a weight-streaming GEMV)
        return (hidden @ self.embed_tokens.weight.t()).float()

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        """Copy HF-named tensors into the (fused) parameters; returns the parameter names loaded.
        Tensor parallel: the values may be safetensors slices, and each rank reads only its part."""
        weights = self._checked(weights)
        if self.parallel is not None:
            return tp.load_sharded(self, weights, self._target)
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for hf_name, tensor in weights:
            found = self._target(hf_name)
            if found is None or found[0] not in params:
                continue  # layers beyond an early-exit cut, or tensors this model does not use
            name, shard = found
            if shard is None:
                params[name].data.copy_(tensor)
            else:
                offset, size = self._shard_range(name.split(".")[-2], shard)
                params[name].data[offset : offset + size].copy_(tensor)
            loaded.add(name)
        return loaded

    def checkpoint_shape(self, name: str) -> tuple[int, ...] | None:
        """The full shape checkpoint tensor `name` must have (a fused parameter's piece: its rows; a
        tensor-parallel shard: the whole tensor), or None for one this model does not use."""
        found = self._target(name)
        if found is None:
            return None
        target, piece = found
        try:
            shape = list(self.get_parameter(target).shape)
        except AttributeError:  # layers beyond an early-exit cut, or tensors this model does not use
            return None
        shard = tp.shard_of(self, target) if self.parallel is not None else None
        if shard is not None:
            shape[shard.dim] = shard.full_sizes[piece or 0]
        elif piece is not None:
            shape[0] = self._shard_range(target.split(".")[-2], piece)[1]
        return tuple(shape)

    def _checked(self, weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        for name, tensor in weights:  # a tensor, or a safetensors slice (tensor parallel)
            shape = tensor.shape if isinstance(tensor, torch.Tensor) else tensor.get_shape()
            check_shape(name, shape, self.checkpoint_shape(name))
            yield name, tensor

    def _target(self, hf_name: str) -> tuple[str, int | None] | None:
        """The parameter an HF tensor fills and its shard of a fused one (q, k, v; gate, up), or None."""
        name = hf_name.removeprefix("model.")
        if "rotary_emb" in name or (name == "lm_head.weight" and self.lm_head is None):
            return None
        piece = next((p for p in _FUSED if f".{p}." in name), None)
        if piece is None:
            return name, None
        target, shard = _FUSED[piece]
        return name.replace(piece, target), shard

    def _shard_range(self, target: str, shard: int) -> tuple[int, int]:
        c = self.config
        if target == "qkv_proj":
            sizes = [c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.num_kv_heads * c.head_dim]
        else:
            sizes = [c.intermediate_size, c.intermediate_size]
        return sum(sizes[:shard]), sizes[shard]


@hookimpl
def infer_register_models(register) -> None:
    register("llama", Llama)
