"""`mistral`: Mistral (MistralForCausalLM).

Llama's decoder; every layer attends within the config's sliding_window when it has one (v0.1:
4096 tokens), which needs an attention backend with the sliding-window ability once the context
is longer than the window.
"""

from __future__ import annotations

from typing import Any

from infer.api.config import ModelConfig
from infer.api.hookspecs import hookimpl
from infer.plugins.model.decoder import DecoderModel
from infer.plugins.model.transformer import Family, hf_activation

PRESETS: dict[str, dict[str, Any]] = {
    "mistral-7b": {  # Mistral-7B-v0.1's config.json
        "architectures": ["MistralForCausalLM"],
        "model_type": "mistral",
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "sliding_window": 4096,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "bfloat16",
    },
}


class Mistral(DecoderModel):
    hf_architectures = ("MistralForCausalLM",)
    presets = PRESETS

    @classmethod
    def family(cls, config: ModelConfig) -> Family:
        return Family(activation=hf_activation(config))


@hookimpl
def infer_register_models(register) -> None:
    register("mistral", Mistral)
