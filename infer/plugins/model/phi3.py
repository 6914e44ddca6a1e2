"""`phi3`: Phi-3 and Phi-4-mini (Phi3ForCausalLM).

Llama's decoder with the checkpoint's projections already fused (`qkv_proj`, `gate_up_proj`: split
here into the pieces the shared loader maps, so a tensor-parallel rank still reads its slices),
RoPE of the config's type (longrope: short factors and its attention scaling, as transformers
computes them; the context stays within original_max_position_embeddings, see infer.api.rope),
partial rotary (`partial_rotary_factor`), and every layer within the config's sliding_window.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Iterator

import torch

from infer.api.config import ModelConfig
from infer.api.hookspecs import hookimpl
from infer.api.weights import check_shape
from infer.plugins.model.decoder import DecoderModel
from infer.plugins.model.transformer import Family, hf_activation

PRESETS: dict[str, dict[str, Any]] = {
    "phi3-mini": {  # Phi-3-mini-4k-instruct's config.json
        "architectures": ["Phi3ForCausalLM"],
        "model_type": "phi3",
        "vocab_size": 32064,
        "hidden_size": 3072,
        "intermediate_size": 8192,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "max_position_embeddings": 4096,
        "original_max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "sliding_window": 2047,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 32000,
        "pad_token_id": 32000,
        "torch_dtype": "bfloat16",
    },
}

SPLIT = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}  # fused -> HF pieces


class Phi3(DecoderModel):
    hf_architectures = ("Phi3ForCausalLM",)
    presets = PRESETS

    @classmethod
    def family(cls, config: ModelConfig) -> Family:
        return Family(partial_rotary=True, activation=hf_activation(config))

    def checkpoint_tensors(self, weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        """qkv_proj and gate_up_proj as their q, k, v and gate, up rows (views of a tensor; a
        safetensors slice reads just those rows)."""
        for name, tensor in weights:
            fused = name.split(".")[-2]
            if fused not in SPLIT or not name.endswith((".weight", ".weight_scale")):
                yield name, tensor
                continue
            pieces = [self._shard_range(fused, i) for i in range(len(SPLIT[fused]))]
            if name.endswith(".weight_scale"):  # an FP8 checkpoint's: per tensor (each piece's) or per row
                shape = tensor.shape if isinstance(tensor, torch.Tensor) else tensor.get_shape()
                per_row = math.prod(shape) > 1
                for piece, (start, size) in zip(SPLIT[fused], pieces):
                    yield name.replace(fused, piece), tensor[start : start + size] if per_row else tensor
                continue
            shape = tensor.shape if isinstance(tensor, torch.Tensor) else tensor.get_shape()
            check_shape(name, shape, (sum(size for _, size in pieces), self.config.hidden_size))
            for piece, (start, size) in zip(SPLIT[fused], pieces):
                yield name.replace(fused, piece), tensor[start : start + size]


@hookimpl
def infer_register_models(register) -> None:
    register("phi3", Phi3)
