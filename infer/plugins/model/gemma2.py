"""`gemma2`: Gemma 2 (Gemma2ForCausalLM).

What differs from Llama: embeddings scaled by sqrt(hidden_size) (rounded to the model's dtype, as
HF does); RMSNorms that scale by 1 + w (the checkpoint's w is loaded as 1 + w, so the shared norm
layers, fused ones too, serve them: exact in float32; in 16-bit dtypes 1 + w is rounded once more
than HF rounds it); a norm after attention and after the MLP as well as before each; GeGLU (GELU's
tanh approximation); the attention scale query_pre_attn_scalar ** -0.5; attention scores and final
logits soft-capped; every other layer (the even ones) within the sliding window. Under tensor
parallelism the post norms need whole sums, so o_proj and down_proj all-reduce their own outputs.
"""

from __future__ import annotations

from typing import Any

import torch

from infer.api import KVCache, QuantizingNorm
from infer.api.config import ModelConfig
from infer.api.hookspecs import hookimpl
from infer.plugins.model.decoder import DecoderModel
from infer.plugins.model.transformer import DecoderLayer, Family, hf_activation, quantize_inputs

PRESETS: dict[str, dict[str, Any]] = {
    "gemma2-9b": {  # gemma-2-9b's config.json (its sizes; served in bfloat16)
        "architectures": ["Gemma2ForCausalLM"],
        "model_type": "gemma2",
        "vocab_size": 256000,
        "hidden_size": 3584,
        "intermediate_size": 14336,
        "num_hidden_layers": 42,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 256,
        "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "query_pre_attn_scalar": 256,
        "sliding_window": 4096,
        "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0,
        "tie_word_embeddings": True,
        "bos_token_id": 2,
        "eos_token_id": 1,
        "pad_token_id": 0,
        "torch_dtype": "bfloat16",
    },
}


class Gemma2DecoderLayer(DecoderLayer):
    """x + post_norm(attention(norm(x))), then x + post_ff_norm(mlp(pre_ff_norm(x)))."""

    def __init__(self, config: ModelConfig, layers: Any, *args: Any) -> None:
        super().__init__(config, layers, *args)
        self.pre_feedforward_layernorm = layers.rms_norm(config.hidden_size, config.rms_norm_eps)
        self.post_feedforward_layernorm = layers.rms_norm(config.hidden_size, config.rms_norm_eps)
        # the MLP's input comes from the pre-feedforward norm; the post-attention one norms a layer output
        if isinstance(self.post_attention_layernorm, QuantizingNorm):
            self.post_attention_layernorm.quantize_output = False
        quantize_inputs(self.pre_feedforward_layernorm, self.mlp.gate_up_proj)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None, kv_cache: KVCache
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:  # the first layer: x is the scaled embedding
            x, residual = self.first_norm(x, self.input_layernorm)
        else:  # x is the previous layer's normed MLP output
            x, residual = self.add_norm(x, residual, self.input_layernorm)
        x = self.post_attention_layernorm(self.self_attn(positions, x, kv_cache))
        x, residual = self.add_norm(x, residual, self.pre_feedforward_layernorm)
        return self.post_feedforward_layernorm(self.mlp(x)), residual


class Gemma2(DecoderModel):
    hf_architectures = ("Gemma2ForCausalLM",)
    presets = PRESETS
    layer_class = Gemma2DecoderLayer

    @classmethod
    def family(cls, config: ModelConfig) -> Family:
        bias = bool(config.extra.get("attention_bias"))
        cap = config.extra.get("final_logit_softcapping")
        return Family(
            qkv_bias=bias,
            o_bias=bias,
            activation=hf_activation(config, "hidden_activation", "gelu_pytorch_tanh"),
            embedding_scale=True,
            norm_offset=True,
            logit_soft_cap=float(cap) if cap is not None else None,
            partial_sums=False,
        )


@hookimpl
def infer_register_models(register) -> None:
    register("gemma2", Gemma2)
