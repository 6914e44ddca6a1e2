"""The decoder layer the built-in families share: attention, gated MLP, the pre-norm residual layer.

Q/K/V and gate/up are fused into one matmul each. What a family changes is a `Family` (biases,
per-head q/k norms, the MLP's activation, partial rotary, ...), or a layer class of its own built
from these parts (Gemma 2's sandwich norms). Given a tensor-parallel `parallel` state (`--tp N`),
the projections are the sharded ones of `infer.distributed.layers`: a row-parallel output is a
partial sum that the next residual add and norm all-reduce (fused with them where they can), unless
the family norms it first (`Family.partial_sums` false: the layer all-reduces it itself).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Mapping

import torch
from torch import nn

from infer.api import (
    AttentionBackend,
    FusingActivation,
    GatedLinear,
    KVCache,
    Layers,
    LinearMatmul,
    ModelParallel,
    QuantizingNorm,
    RotaryFusingAttention,
    RotaryTables,
    TakesQuantizedInput,
)
from infer.api.adapters import begin_adapter
from infer.api.config import ModelConfig
from infer.api.errors import ModelLoadError
from infer.api.rope import Rope

ACTIVATIONS = {"silu": "silu_and_mul", "gelu_pytorch_tanh": "gelu_and_mul"}  # HF hidden_act -> layer kind


@dataclass(frozen=True, slots=True)
class Family:
    """What a decoder family changes in the shared layers; each plugin reads it from its config."""

    qkv_bias: bool = False  # Qwen2: biases on q, k and v
    o_bias: bool = False  # attention_bias configs: on o_proj too
    qk_norm: bool = False  # Qwen3: an RMSNorm over each head of q and of k, before the rotary embedding
    activation: str = "silu"  # the MLP gate's HF hidden_act: silu (SwiGLU) or gelu_pytorch_tanh (GeGLU)
    partial_rotary: bool = False  # Phi-3: a partial_rotary_factor turns only the first dims of each head
    embedding_scale: bool = False  # Gemma: embeddings times sqrt(hidden_size), rounded to the model's dtype
    norm_offset: bool = False  # Gemma: a norm scales by 1 + w; the checkpoint's w is loaded as 1 + w
    logit_soft_cap: float | None = None  # Gemma 2: logits capped as cap * tanh(logits / cap)
    partial_sums: bool = True  # tp: row-parallel outputs are summed by the norm after them (False: at once)


def hf_activation(config: ModelConfig, key: str = "hidden_act", default: str = "silu") -> str:
    """The config's MLP activation (`extra[key]`), refused unless the layers hook has a kind for it."""
    act = str(config.extra.get(key) or default)
    if act not in ACTIVATIONS:
        raise ModelLoadError(
            f"config.json of {config.name or 'the model'} asks for {key} {act!r}, which {config.architecture} "
            f"does not implement here: use one of {', '.join(ACTIVATIONS)}"
        )
    return act


def tp_matmul(layers: Layers) -> Any:
    """The chosen linear layer's matmul for the tensor-parallel projections (F.linear when it has none)."""
    return layers.linear.matmul if isinstance(layers.linear, LinearMatmul) else torch.nn.functional.linear


def projection(layers: Layers) -> Any:
    """The linear the attention and MLP projections are built from: the quantized one if the run has it."""
    return layers.quantized_linear or layers.linear


LLAMA = Family()


class Attention(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        layers: Layers,
        attention: AttentionBackend,
        parallel: ModelParallel | None = None,
        rope: Rope | None = None,  # default: config.rope(); the model computes it once for all layers
        family: Family = LLAMA,
        window: int | None = None,  # sliding window of this layer (tokens), None: the whole context
    ) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        if parallel is not None:  # this rank's heads
            heads = parallel.heads(config.num_heads, config.num_kv_heads)
            self.num_heads, self.num_kv_heads = heads.num_heads, heads.num_kv_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        if parallel is None:
            linear = projection(layers)
            self.qkv_proj = linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=family.qkv_bias)
            self.o_proj = linear(self.q_size, config.hidden_size, bias=family.o_bias)
        else:
            self.qkv_proj, self.o_proj = parallel.layers.attention_projections(
                config,
                parallel,
                tp_matmul(layers),
                family.qkv_bias,
                family.o_bias,
                reduce=not family.partial_sums,
                quantized=layers.quantized_linear,
            )
        rope = rope or config.rope()
        self.rotary_dim = rope.rotary_dim
        if self.rotary_dim != self.head_dim and not family.partial_rotary:
            raise ModelLoadError(
                f"config.json of {config.name or 'the model'}: its RoPE rotates {self.rotary_dim} of "
                f"{self.head_dim} head dims (partial_rotary_factor), which {config.architecture} does not: "
                f"drop partial_rotary_factor"
            )
        self.rotary = layers.rotary_embedding(rope, config.max_position_embeddings)
        self.q_norm = self.k_norm = None
        if family.qk_norm:
            self.q_norm = layers.rms_norm(self.head_dim, config.rms_norm_eps)
            self.k_norm = layers.rms_norm(self.head_dim, config.rms_norm_eps)
        self.attention = attention
        self.qkv_adapter = self.o_adapter = None  # adapters' layers (`attach_adapters`): y = layer(x, y)
        self.window = {} if window is None else {"window": window}  # only a windowed layer passes window=
        # a rotary layer that lends its tables to a backend whose cache write can rotate q and k
        self.rotary_in_attention = (
            self.rotary_dim == self.head_dim
            and isinstance(self.rotary, RotaryTables)
            and bool(self.rotary.fuses_into_attention)
            and isinstance(attention, RotaryFusingAttention)
            and bool(attention.fuses_rotary())
        )

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv_cache: KVCache) -> torch.Tensor:
        # x: [T, hidden]
        if self.qkv_adapter is not None:
            begin_adapter(self.qkv_adapter, x)
            qkv = self.qkv_adapter(x, self.qkv_proj(x))
        else:
            qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:  # per head: [T * H, D] rows for the norm layer
            q = self.q_norm(q.reshape(-1, self.head_dim)).view(-1, self.num_heads, self.head_dim)
            k = self.k_norm(k.reshape(-1, self.head_dim)).view(-1, self.num_kv_heads, self.head_dim)
        if self.rotary_in_attention:
            out = self.attention.forward_with_rotary(
                positions, q, k, v, kv_cache, self.rotary.cos, self.rotary.sin, **self.window
            )
        else:
            q, k = self.rotate(positions, q, k)
            out = self.attention.forward(q, k, v, kv_cache, **self.window)  # [T, H, D]
        out = out.reshape(-1, self.q_size)
        if self.o_adapter is not None:
            begin_adapter(self.o_adapter, out)
            return self.o_adapter(out, self.o_proj(out))
        return self.o_proj(out)

    def rotate(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.rotary_dim == self.head_dim:
            return self.rotary(positions, q, k)
        r = self.rotary_dim  # partial rotary: the first r dims of each head turn, the rest pass through
        q_rot, k_rot = self.rotary(positions, q[..., :r].contiguous(), k[..., :r].contiguous())
        return torch.cat((q_rot, q[..., r:]), dim=-1), torch.cat((k_rot, k[..., r:]), dim=-1)


class MLP(nn.Module):
    def __init__(
        self,
        config: Any,  # hidden_size, intermediate_size
        layers: Layers,
        parallel: ModelParallel | None = None,
        activation: str = "silu",
        reduce: bool = False,  # tp: all-reduce down_proj's output here (else the next norm sums it)
    ) -> None:
        super().__init__()
        if parallel is None:
            self.gate_up_proj = projection(layers)(config.hidden_size, 2 * config.intermediate_size)
            self.down_proj = projection(layers)(config.intermediate_size, config.hidden_size)
        else:
            self.gate_up_proj, self.down_proj = parallel.layers.mlp_projections(
                config, parallel, tp_matmul(layers), reduce, layers.quantized_linear
            )
        kind = ACTIVATIONS[activation]
        act = {"silu_and_mul": layers.silu_and_mul, "gelu_and_mul": layers.gelu_and_mul}[kind]
        if act is None:
            raise ModelLoadError(f"the model's MLP needs a {kind} layer and the layers given have none: add one")
        self.act = act()
        # an activation that can apply itself inside the down projection's matmul (one kernel), or a
        # projection that applies it to its input itself (a quantized one, as it quantizes it: `gated`)
        self.fused_down = isinstance(self.act, FusingActivation) and bool(self.act.fuses_with(self.down_proj))
        self.gated_down = isinstance(self.down_proj, GatedLinear) and self.down_proj.fuses_activation == kind
        self.row_parallel = parallel is not None
        self.gate_up_adapter = self.down_adapter = None  # adapters' layers (`attach_adapters`)

    def attach_adapters(self, gate_up: Any, down: Any) -> None:
        """Adapters' layers after gate_up_proj and down_proj: down's needs the activation's output, so
        the activation no longer runs inside down_proj's matmul."""
        self.gate_up_adapter, self.down_adapter = gate_up, down
        self.fused_down = self.gated_down = False

    @property
    def down_matmul(self) -> Any:
        return self.act.down if self.fused_down else self.down_proj.matmul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_adapter is not None:
            begin_adapter(self.gate_up_adapter, x)
            h = self.gate_up_adapter(x, self.gate_up_proj(x))
        else:
            h = self.gate_up_proj(x)
        if self.down_adapter is not None:
            a = self.act(h)
            begin_adapter(self.down_adapter, a)
            return self.down_adapter(a, self.down_proj(a))
        if self.gated_down:
            return self.down_proj.gated(h)
        if self.fused_down:
            if self.row_parallel:  # through the shard's forward, which may push its partial sum
                return self.down_proj(h, matmul=self.act.down)
            return self.act.down(h, self.down_proj.weight)
        return self.down_proj(self.act(h))


class DecoderLayer(nn.Module):
    """Pre-norm: x + attention(norm(x)), then x + mlp(norm(x)). It returns the MLP's output and the
    residual stream, which the next layer (or the final norm) adds and norms in one step."""

    def __init__(
        self,
        config: ModelConfig,
        layers: Layers,
        attention: AttentionBackend,
        parallel: ModelParallel | None = None,
        rope: Rope | None = None,
        family: Family = LLAMA,
        window: int | None = None,
    ) -> None:
        super().__init__()
        self.self_attn = Attention(config, layers, attention, parallel, rope, family, window)
        self.mlp = MLP(config, layers, parallel, family.activation, reduce=not family.partial_sums)
        self.input_layernorm = layers.rms_norm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = layers.rms_norm(config.hidden_size, config.rms_norm_eps)
        # tensor parallel: o_proj and down_proj return partial sums, which the next residual add and
        # norm sum first (one all-reduce, fused with them where it can be)
        quantize_inputs(self.input_layernorm, self.self_attn.qkv_proj)
        quantize_inputs(self.post_attention_layernorm, self.mlp.gate_up_proj)
        summing = parallel if family.partial_sums else None
        self.add_norm = add_norm_for(summing)
        self.first_norm = first_norm if summing is None else functools.partial(summing.layers.reduce_norm, summing)

    def attach_adapters(self, layers: Mapping[str, Any], prefix: str) -> None:
        """This layer's adapters' layers, by module name under `prefix` ("layers.3."): each projection's
        input must reach them unquantized, so no norm stores its output in FP8 any more."""
        attn, mlp = self.self_attn, self.mlp
        attn.qkv_adapter = layers.get(prefix + "self_attn.qkv_proj")
        attn.o_adapter = layers.get(prefix + "self_attn.o_proj")
        mlp.attach_adapters(layers.get(prefix + "mlp.gate_up_proj"), layers.get(prefix + "mlp.down_proj"))
        for norm in self.modules():
            if isinstance(norm, QuantizingNorm):
                norm.quantize_output = False

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


def quantize_inputs(norm: nn.Module, projection: nn.Module) -> None:
    """Let a norm that can store its output quantized (`QuantizingNorm`) do so for a projection that
    takes quantized input (`TakesQuantizedInput`: an FP8 linear)."""
    quantized = isinstance(projection, TakesQuantizedInput) and projection.takes_quantized_input
    if quantized and isinstance(norm, QuantizingNorm):
        norm.quantize_output = True


def add_norm(x: torch.Tensor, residual: torch.Tensor, norm: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """norm(x + residual) and x + residual, at tp = 1 (the norm adds)."""
    return norm(x, residual)


def first_norm(x: torch.Tensor, norm: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """norm(x) and x: the first layer's input and the residual it starts, at tp = 1."""
    return norm(x), x


def add_norm_for(parallel: ModelParallel | None) -> Any:
    """The residual add and norm after a layer's output: under tensor parallelism the output is a
    partial sum, all-reduced first (fused with them where it can: `reduce_add_norm`)."""
    return add_norm if parallel is None else functools.partial(parallel.layers.reduce_add_norm, parallel)
