"""`qwen3`: Qwen3 (Qwen3ForCausalLM).

Llama's decoder with an RMSNorm over each head of q and of k before the rotary embedding, an
explicit head_dim (wider than hidden_size / heads in the small sizes), no QKV bias (unless the
config's attention_bias asks, then on o_proj too), and the config's sliding window where
transformers marks layers `sliding_attention`.
"""

from __future__ import annotations

from typing import Any

from infer.api.config import ModelConfig
from infer.api.hookspecs import hookimpl
from infer.plugins.model.decoder import DecoderModel
from infer.plugins.model.transformer import Family, hf_activation

PRESETS: dict[str, dict[str, Any]] = {
    "qwen3-8b": {  # Qwen3-8B's config.json
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": 151936,
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "attention_bias": False,
        "use_sliding_window": False,
        "max_window_layers": 36,
        "tie_word_embeddings": False,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "torch_dtype": "bfloat16",
    },
}


class Qwen3(DecoderModel):
    hf_architectures = ("Qwen3ForCausalLM",)
    presets = PRESETS

    @classmethod
    def family(cls, config: ModelConfig) -> Family:
        bias = bool(config.extra.get("attention_bias"))
        return Family(qkv_bias=bias, o_bias=bias, qk_norm=True, activation=hf_activation(config))


@hookimpl
def infer_register_models(register) -> None:
    register("qwen3", Qwen3)
