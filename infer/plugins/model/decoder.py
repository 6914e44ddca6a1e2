"""A decoder-only causal LM: embedding, the decoder layers, final norm, LM head; loading from HF names.

Each built-in family is a subclass that names its HF architectures, its presets, its `Family` (and,
where its layer differs, its `layer_class`). `load_weights` maps HF checkpoint names onto the fused
parameters (q, k, v -> qkv_proj; gate, up -> gate_up_proj), biases alike; a family whose checkpoint
names differ turns them into these first (`checkpoint_tensors`). Under tensor parallelism each rank
loads only its slices; a pipeline stage (`stage=`) builds and loads only its layers, keeping their
indices (the others are empty placeholders), with the embedding on the first stage and the final norm
and LM head on the last (a tied head: the embedding there too).
"""

from __future__ import annotations

import itertools
from dataclasses import replace
from typing import Any, Iterable, Iterator, Mapping

import torch
from torch import nn

from infer.api import (
    AttentionBackend,
    KVCache,
    Layers,
    ModelParallel,
    PipelineStage,
    QuantizedLinear,
    StageActivations,
    pushes_partial_sums,
)
from infer.api.adapters import AdapterTarget
from infer.api.config import ModelConfig
from infer.api.weights import check_shape, check_unscaled
from infer.plugins.model.transformer import LLAMA, DecoderLayer, Family, add_norm_for, tp_matmul

FUSED = {  # HF name piece -> (our name piece, shard index)
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class DecoderModel(nn.Module):
    hf_architectures: tuple[str, ...] = ()
    presets: dict[str, dict[str, Any]] = {}
    layer_class: type[nn.Module] = DecoderLayer

    @classmethod
    def family(cls, config: ModelConfig) -> Family:
        """What this family changes in the shared layers, read from `config` (refusing what it cannot run)."""
        return LLAMA

    def __init__(
        self,
        config: ModelConfig,
        layers: Layers,
        attention: AttentionBackend,
        parallel: ModelParallel | None = None,
        stage: PipelineStage | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.parallel = parallel  # None: one rank (--tp 1)
        self.stage = stage  # None: every layer (--pp 1)
        first, last = stage is None or stage.is_first, stage is None or stage.is_last
        family = self.family(config)
        self.logit_soft_cap = family.logit_soft_cap
        self.norm_offset = family.norm_offset
        if not (first or (last and config.tie_word_embeddings)):  # a middle stage, or a last one with its own head
            self.embed_tokens = None
        elif parallel is None:
            self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        else:
            self.embed_tokens = parallel.layers.VocabParallelEmbedding(
                config.vocab_size, config.hidden_size, parallel, tp_matmul(layers)
            )
        scale = None
        if family.embedding_scale:  # sqrt(hidden) rounded to float32, then to the model's dtype, as HF does
            scale = torch.tensor(config.hidden_size**0.5, dtype=torch.float32).to(torch.get_default_dtype())
        self.register_buffer("embed_scale", scale, persistent=False)
        rope = config.rope()
        windows = config.layer_windows or (None,) * config.num_layers
        self.layers = nn.ModuleList(
            self.layer_class(config, layers, attention, parallel, rope, family, windows[i])
            if stage is None or i in stage
            else nn.Identity()  # another stage's: the index (and the checkpoint names) stay
            for i in range(config.num_layers)
        )
        self.norm = layers.rms_norm(config.hidden_size, config.rms_norm_eps) if last else None
        self.final_add_norm = add_norm_for(parallel if family.partial_sums else None)
        self.pushes = False  # whether one-token steps' partial sums go to the ranks' exchange, where it exists
        if parallel is not None:
            self._choose_pushes(family)
        self.lm_head = None
        if last and not config.tie_word_embeddings:
            self.lm_head = (
                layers.linear(config.hidden_size, config.vocab_size)
                if parallel is None
                else parallel.layers.ParallelLMHead(config.vocab_size, config.hidden_size, parallel, tp_matmul(layers))
            )

    def _choose_pushes(self, family: Family) -> None:
        # a one-token step's partial sums may be pushed into the ranks' exchange by the GEMVs that
        # make them (infer.distributed.all_reduce.lamport), which takes them in pairs: every row-parallel
        # layer pushes, or none does; none where a layer norms or biases its output before the sum
        assert self.parallel is not None
        tp = self.parallel.layers
        own = self.own_layers()
        pushes = family.partial_sums and all(
            isinstance(layer.self_attn.o_proj, tp.RowParallelLinear)  # not a quantized shard
            and isinstance(layer.mlp.down_proj, tp.RowParallelLinear)
            and layer.self_attn.o_proj.bias is None
            and pushes_partial_sums(layer.self_attn.o_proj.matmul)
            and pushes_partial_sums(layer.mlp.down_matmul)
            for layer in own
        )
        for layer in own:
            layer.self_attn.o_proj.push = layer.mlp.down_proj.push = pushes
        if self.embed_tokens is not None:
            self.embed_tokens.push = pushes
        self.pushes = pushes

    def own_layers(self) -> list[nn.Module]:
        """The layers this process holds: all of them, or its pipeline stage's."""
        stage = self.stage
        return list(self.layers) if stage is None else list(self.layers)[stage.start : stage.end]

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[KVCache],  # one per layer that runs (on a pipeline stage: its layers')
        num_layers: int | None = None,  # run only the first layers (early exit, self-draft)
        carried: StageActivations | None = None,  # a pipeline stage after the first: the stage before's
    ) -> torch.Tensor | StageActivations:  # [T, hidden] after the final norm; a stage before the last: its output
        stage = self.stage
        if carried is None:
            assert self.embed_tokens is not None, "the first pipeline stage embeds"
            x, residual = self.embed_tokens(input_ids), None
            if self.embed_scale is not None:
                x = x * self.embed_scale
        else:
            x, residual = carried.hidden, carried.residual
        start, end = (0, num_layers or len(self.layers)) if stage is None else (stage.start, stage.end)
        for layer, kv_cache in zip(itertools.islice(self.layers, start, end), kv_caches):
            x, residual = layer(positions, x, residual, kv_cache)
        if stage is not None and not stage.is_last:
            assert residual is not None, "a stage holds at least one layer"
            return StageActivations(x, residual)
        x, _ = self.final_add_norm(x, residual, self.norm)
        return x

    def adapter_targets(self) -> list[AdapterTarget]:
        """`AdaptableModel`: every layer's four projections, with the HF pieces they fuse and this
        rank's part of each under tensor parallelism."""
        c = self.config
        q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        projections = (  # our name, HF pieces, input features, each piece's output rows
            ("self_attn.qkv_proj", ("q_proj", "k_proj", "v_proj"), c.hidden_size, (q, kv, kv)),
            ("self_attn.o_proj", ("o_proj",), q, (c.hidden_size,)),
            ("mlp.gate_up_proj", ("gate_proj", "up_proj"), c.hidden_size, (c.intermediate_size,) * 2),
            ("mlp.down_proj", ("down_proj",), c.intermediate_size, (c.hidden_size,)),
        )
        # checkpoints that fuse the pieces themselves (Phi-3) name the fused module in their adapters
        aliases = {
            "self_attn.qkv_proj": (("qkv_proj", ("q_proj", "k_proj", "v_proj")),),
            "mlp.gate_up_proj": (("gate_up_proj", ("gate_proj", "up_proj")),),
        }
        targets = []
        for i in range(len(self.layers)):
            for name, pieces, in_features, out_features in projections:
                module = f"layers.{i}.{name}"
                target = AdapterTarget(module, i, pieces, in_features, out_features, aliases=aliases.get(name, ()))
                shard = self.parallel.layers.shard_of(self, f"{module}.weight") if self.parallel is not None else None
                if shard is not None and shard.dim == 0:
                    target = replace(target, split="column", out_slices=tuple(shard.ranges))
                elif shard is not None:
                    summed = bool(getattr(self.get_submodule(module), "reduce", False))
                    target = replace(target, split="row", in_slice=shard.ranges[0], summed=summed)
                targets.append(target)
        return targets

    def attach_adapters(self, layers: Mapping[str, Any]) -> None:
        """`AdaptableModel`: each layer calls its projections' adapters' layers. Partial sums are no
        longer pushed by the GEMVs that make them: an adapter's delta joins them after the matmul."""
        for i, layer in enumerate(self.layers):
            layer.attach_adapters(layers, f"layers.{i}.")
        if self.pushes:
            for layer in self.own_layers():
                layer.self_attn.o_proj.push = layer.mlp.down_proj.push = False
            self.embed_tokens.push = self.pushes = False

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [B, hidden] -> [B, vocab] float32
        if self.parallel is not None:  # each rank's vocabulary slice, gathered on rank 0
            logits = (self.embed_tokens if self.lm_head is None else self.lm_head).logits(hidden)
        elif self.lm_head is not None:
            logits = self.lm_head(hidden).float()  # the layers hook's linear (one token: a weight-streaming GEMV)
        else:
            assert self.embed_tokens is not None, "a tied head: the last stage holds the embedding"
            logits = (hidden @ self.embed_tokens.weight.t()).float()
        if self.logit_soft_cap is not None:
            logits = torch.tanh(logits / self.logit_soft_cap) * self.logit_soft_cap
        return logits

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        """Copy HF-named tensors into the (fused) parameters; returns the parameter names loaded.
        Tensor parallel: the values may be safetensors slices, and each rank reads only its part."""
        weights = self._checked(self.checkpoint_tensors(weights))
        if self.parallel is not None:
            loaded = self.parallel.layers.load_sharded(self, weights, self._target)
        else:
            loaded = self._load_whole(weights)
        if self.norm_offset:  # the checkpoint holds w of norms that scale by 1 + w
            with torch.no_grad():
                for name in loaded:
                    if name.endswith("norm.weight"):
                        self.get_parameter(name).add_(1.0)
        return loaded

    def _load_whole(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for hf_name, tensor in weights:
            found = self._target(hf_name)
            if found is None:
                continue  # tensors this model does not use
            name, shard = found
            owner, _, attr = name.rpartition(".")
            module = self._quantized(owner)
            if module is not None:  # it stores the rows in its own form (and their scales), under its own names
                weight = params.get(f"{owner}.weight")  # a layer without one says its rows (2.4: out_features)
                rows = weight.shape[0] if weight is not None else module.out_features
                offset, size = (0, rows) if shard is None else self._shard_range(owner, shard)
                loaded.update(f"{owner}.{p}" for p in module.load_rows(attr, offset, size, tensor))
                continue
            if name not in params:
                continue  # layers beyond an early-exit cut, or tensors this model does not use
            offset, size = (0, params[name].shape[0]) if shard is None else self._shard_range(owner, shard)
            params[name].data[offset : offset + size].copy_(check_unscaled(hf_name, tensor, params[name]))
            loaded.add(name)
        return loaded

    def _quantized(self, owner: str) -> Any:
        """The `QuantizedLinear` named `owner`, or None (another module, or a layer past an early-exit cut)."""
        try:
            module = self.get_submodule(owner)
        except AttributeError:
            return None
        return module if isinstance(module, QuantizedLinear) else None

    def checkpoint_tensors(self, weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        """The checkpoint's (name, tensor) pairs under the Llama-style HF names `load_weights` maps."""
        return iter(weights)

    def checkpoint_shape(self, name: str) -> tuple[int, ...] | None:
        """The full shape checkpoint tensor `name` must have (a fused parameter's piece: its rows; a
        tensor-parallel shard: the whole tensor), or None for one this model does not use."""
        found = self._target(name)
        if found is None:
            return None
        target, piece = found
        owner, _, attr = target.rpartition(".")
        quantized = self._quantized(owner)
        if quantized is not None and attr != "weight":
            return None  # a scale, or packed values: the layer reads its own layout's shapes
        try:
            shape = list(self.get_parameter(target).shape)
        except AttributeError:  # layers beyond an early-exit cut, or tensors this model does not use
            if quantized is None:
                return None
            shape = [quantized.out_features, quantized.in_features]  # a model-dtype weight it quantizes
        shard = self.parallel.layers.shard_of(self, target) if self.parallel is not None else None
        if shard is not None:
            shape[shard.dim] = shard.full_sizes[piece or 0]
        elif piece is not None:
            shape[0] = self._shard_range(owner, piece)[1]
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
        piece = next((p for p in FUSED if f".{p}." in name), None)
        if piece is None:
            return name, None
        target, shard = FUSED[piece]
        return name.replace(piece, target), shard

    def _shard_range(self, module: str, shard: int) -> tuple[int, int]:
        """Rows of piece `shard` in the fused projection `module` (its name, or its last part)."""
        c = self.config
        if module.endswith("qkv_proj"):
            sizes = [c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.num_kv_heads * c.head_dim]
        else:
            sizes = [c.intermediate_size, c.intermediate_size]
        return sum(sizes[:shard]), sizes[shard]
