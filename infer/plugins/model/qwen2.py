"""`qwen2`: Qwen2 and Qwen2.5 (Qwen2ForCausalLM).

Llama's decoder with biases on q, k and v (none on o_proj), tied or untied embeddings, and the
config's sliding window on the layers transformers marks `sliding_attention` (use_sliding_window,
from max_window_layers on; published checkpoints leave it off).
"""

from __future__ import annotations

from typing import Any

from infer.api.config import ModelConfig
from infer.api.hookspecs import hookimpl
from infer.plugins.model.decoder import DecoderModel
from infer.plugins.model.transformer import Family, hf_activation

PRESETS: dict[str, dict[str, Any]] = {
    "qwen2.5-7b": {  # Qwen2.5-7B-Instruct's config.json
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "vocab_size": 152064,
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "use_sliding_window": False,
        "sliding_window": 131072,
        "max_window_layers": 28,
        "tie_word_embeddings": False,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "torch_dtype": "bfloat16",
    },
}


class Qwen2(DecoderModel):
    hf_architectures = ("Qwen2ForCausalLM",)
    presets = PRESETS

    @classmethod
    def family(cls, config: ModelConfig) -> Family:
        return Family(qkv_bias=True, activation=hf_activation(config))


@hookimpl
def infer_register_models(register) -> None:
    register("qwen2", Qwen2)
