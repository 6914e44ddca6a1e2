"""An example model plugin: `arcee`, for checkpoints of HF transformers' `ArceeForCausalLM` (Arcee's AFM
models): a Llama whose MLP is one up projection and a squared ReLU, where Llama has a gate and SwiGLU.

Built from the plugin API alone: the norms, rotary embedding and linear layers are the run's layers
(`Layers`: a layers plugin's fused kernels go in unasked), attention is the run's backend over the
paged KV cache. Under tensor parallelism (`parallel`, a `ModelParallel`) the embedding, the LM head
and the attention projections are split over the ranks with `parallel.layers`; their partial sums are
added up by the residual add and norm after them (`reduce_add_norm`). The MLP is not split: the API's
tensor-parallel layers have a column-parallel projection only inside attention's qkv and a gated MLP's
fused gate/up (`attention_projections`, `mlp_projections`), none for one ungated matrix, so rank 0
holds the whole MLP and computes it, and the other ranks add zeros. As a pipeline stage (`stage`, a
`PipelineStage`: --pp) it builds only its layers, under their own indices, and hands the next stage its
output and residual stream (`StageActivations`). Its entry point (pyproject.toml) makes infer run it for
any config.json that names `ArceeForCausalLM`; `pytest --infer-kit model=arcee` checks it against
transformers' own model, at tp 1, tp 2 and pp 2.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
import torch.nn.functional as F
from torch import nn

import infer
from infer.api import (
    AttentionBackend,
    KVCache,
    Layers,
    LinearMatmul,
    ModelParallel,
    PipelineStage,
    StageActivations,
)
from infer.api.config import ModelConfig
from infer.api.errors import ModelLoadError
from infer.api.rope import Rope
from infer.api.weights import check_shape

INFER_PLUGIN_API = ">=2.7,<3"  # pipeline stages came with 2.7
QKV = {"q_proj": 0, "k_proj": 1, "v_proj": 2}  # HF's projections -> their piece of the fused qkv_proj


def matmul_of(layers: Layers) -> Any:
    """What the tensor-parallel projections multiply with: the run's linear layer's matmul (a kernel)."""
    return layers.linear.matmul if isinstance(layers.linear, LinearMatmul) else F.linear


class Attention(nn.Module):
    def __init__(
        self, config: ModelConfig, layers: Layers, attention: AttentionBackend | None, parallel, rope: Rope
    ) -> None:
        super().__init__()
        heads = parallel.heads(config.num_heads, config.num_kv_heads) if parallel is not None else None
        self.num_heads = heads.num_heads if heads else config.num_heads  # this rank's
        self.num_kv_heads = heads.num_kv_heads if heads else config.num_kv_heads
        self.head_dim = config.head_dim
        self.sizes = [self.num_heads * self.head_dim, *[self.num_kv_heads * self.head_dim] * 2]  # q, k, v
        bias = bool(config.extra.get("attention_bias"))
        if parallel is None:
            self.qkv_proj = layers.linear(config.hidden_size, sum(self.sizes), bias=bias)
            self.o_proj = layers.linear(self.sizes[0], config.hidden_size, bias=bias)
        else:  # this rank's heads; o_proj's output is a partial sum
            self.qkv_proj, self.o_proj = parallel.layers.attention_projections(
                config, parallel, matmul_of(layers), bias, bias
            )
        self.rotary = layers.rotary_embedding(rope, config.max_position_embeddings)
        self.attention = attention

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv_cache: KVCache) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split(self.sizes, dim=-1)
        q, k = self.rotary(
            positions, q.view(-1, self.num_heads, self.head_dim), k.view(-1, self.num_kv_heads, self.head_dim)
        )
        out = self.attention.forward(q, k, v.view(-1, self.num_kv_heads, self.head_dim), kv_cache)
        return self.o_proj(out.reshape(-1, self.sizes[0]))


class ReluSquaredMLP(nn.Module):
    """down(relu(up(x))^2), whole on rank 0; under tensor parallelism the other ranks hold none of it and
    return zeros, so that the sum over the ranks the next norm takes is rank 0's output."""

    def __init__(self, config: ModelConfig, layers: Layers, parallel) -> None:
        super().__init__()
        self.idle = parallel is not None and parallel.rank != 0
        bias = bool(config.extra.get("mlp_bias"))
        if not self.idle:
            self.up_proj = layers.linear(config.hidden_size, config.intermediate_size, bias=bias)
            self.down_proj = layers.linear(config.intermediate_size, config.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.idle:
            return torch.zeros_like(x)
        return self.down_proj(torch.relu(self.up_proj(x)).square())


class DecoderLayer(nn.Module):
    """Pre-norm: x + attention(norm(x)), then x + mlp(norm(x)). It returns the MLP's output and the
    residual stream, which the next layer's norm (or the final norm) adds up and norms in one step."""

    def __init__(self, config: ModelConfig, layers: Layers, attention, parallel, rope: Rope) -> None:
        super().__init__()
        self.parallel = parallel
        self.self_attn = Attention(config, layers, attention, parallel, rope)
        self.mlp = ReluSquaredMLP(config, layers, parallel)
        self.input_layernorm = layers.rms_norm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = layers.rms_norm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions, x, residual, kv_cache):
        if residual is None:  # the first layer: x is the embedding
            x, residual = (self.input_layernorm(x), x) if self.parallel is None else self.first_norm(x)
        else:
            x, residual = add_norm(self.parallel, x, residual, self.input_layernorm)
        x = self.self_attn(positions, x, kv_cache)
        x, residual = add_norm(self.parallel, x, residual, self.post_attention_layernorm)
        return self.mlp(x), residual

    def first_norm(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.parallel.layers.reduce_norm(self.parallel, x, self.input_layernorm)


def add_norm(parallel, x: torch.Tensor, residual: torch.Tensor, norm: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """norm(x + residual) and x + residual; under tensor parallelism x is a partial sum, summed first."""
    if parallel is None:
        return norm(x, residual)
    return parallel.layers.reduce_add_norm(parallel, x, residual, norm)


class Arcee(nn.Module):
    hf_architectures = ("ArceeForCausalLM",)  # the config.json `architectures` this plugin runs
    # the model kit's tiny checkpoint uses YaRN RoPE, as AFM-4.5B does (the kit's default is plain RoPE)
    kit_config = {
        "ArceeForCausalLM": {
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        }
    }

    def __init__(
        self,
        config: ModelConfig,
        layers: Layers,
        attention: AttentionBackend | None,  # None: built on the meta device, for its shapes
        parallel: ModelParallel | None = None,  # None: one rank (--tp 1)
        stage: PipelineStage | None = None,  # None: every layer (--pp 1)
    ) -> None:
        super().__init__()
        act = config.extra.get("hidden_act") or "relu2"
        if act != "relu2":
            raise ModelLoadError(f"config.json of {config.name} asks for hidden_act {act!r}: arcee runs relu2 only")
        if layers.quantized_linear is not None:
            raise ModelLoadError("arcee runs unquantized weights only: drop --quantization")
        self.config, self.parallel, self.stage = config, parallel, stage
        first, last = stage is None or stage.is_first, stage is None or stage.is_last
        if not (first or (last and config.tie_word_embeddings)):  # a stage that neither embeds nor reads a tied head
            self.embed_tokens = None
        elif parallel is None:
            self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        else:
            tp = parallel.layers
            self.embed_tokens = tp.VocabParallelEmbedding(
                config.vocab_size, config.hidden_size, parallel, matmul_of(layers)
            )
        rope = config.rope()  # transformers' frequencies for the config's rope_parameters (YaRN on AFM)
        self.layers = nn.ModuleList(  # another stage's layers are placeholders, so that names keep their index
            DecoderLayer(config, layers, attention, parallel, rope) if stage is None or i in stage else nn.Identity()
            for i in range(config.num_layers)
        )
        self.norm = layers.rms_norm(config.hidden_size, config.rms_norm_eps) if last else None
        self.lm_head = None  # tied: the embedding's table
        if last and not config.tie_word_embeddings:
            self.lm_head = (
                layers.linear(config.hidden_size, config.vocab_size)
                if parallel is None
                else parallel.layers.ParallelLMHead(config.vocab_size, config.hidden_size, parallel, matmul_of(layers))
            )

    def forward(
        self,
        input_ids,
        positions,
        kv_caches: list[KVCache],  # the layers' that run here
        num_layers: int | None = None,
        carried: StageActivations | None = None,  # a pipeline stage after the first: what the stage before made
    ) -> torch.Tensor | StageActivations:
        if carried is None:
            x, residual = self.embed_tokens(input_ids), None
        else:
            x, residual = carried.hidden, carried.residual
        stage = self.stage
        start, end = (0, num_layers or len(self.layers)) if stage is None else (stage.start, stage.end)
        for layer, kv_cache in zip(self.layers[start:end], kv_caches):
            x, residual = layer(positions, x, residual, kv_cache)
        if stage is not None and not stage.is_last:
            return StageActivations(x, residual)
        return add_norm(self.parallel, x, residual, self.norm)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        if self.parallel is not None:  # each rank's slice of the vocabulary, gathered on rank 0
            return head.logits(hidden)
        return (head(hidden) if self.lm_head is not None else hidden @ head.weight.t()).float()

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        """HF-named tensors into the parameters (q, k, v into the fused qkv_proj); returns the names filled.
        Under tensor parallelism the values are safetensors slices, of which each rank reads its part."""
        if self.parallel is not None:
            return self.parallel.layers.load_sharded(self, weights, self.target)
        params, loaded = dict(self.named_parameters()), set()
        for hf_name, tensor in weights:
            found = self.target(hf_name)
            if found is None or found[0] not in params:
                continue  # the rotary tables, or layers past an early-exit cut
            name, piece = found
            rows = slice(None)
            if piece is not None:  # q, k or v: its rows of qkv_proj
                sizes = self.get_submodule(name.rsplit(".", 2)[0]).sizes
                rows = slice(sum(sizes[:piece]), sum(sizes[: piece + 1]))
            check_shape(hf_name, tensor.shape, params[name].data[rows].shape)
            params[name].data[rows].copy_(tensor)
            loaded.add(name)
        return loaded

    def target(self, hf_name: str) -> tuple[str, int | None] | None:
        """The parameter a checkpoint tensor fills, and its piece of a fused one (None: whole)."""
        name = hf_name.removeprefix("model.")
        if "rotary_emb" in name or (name == "lm_head.weight" and self.lm_head is None):
            return None
        for hf, piece in QKV.items():
            if f".{hf}." in name:
                return name.replace(hf, "qkv_proj"), piece
        return name, None


@infer.hookimpl
def infer_register_models(register) -> None:
    register("arcee", Arcee)
