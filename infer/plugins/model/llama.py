"""`llama`: the Llama-2 / Llama-3 architecture (and SmolLM2, which shares it).

RMSNorm, rotary embeddings as transformers computes them for the config's rope_parameters,
grouped-query attention over the paged KV cache, SwiGLU, tied or untied embeddings: the shared
decoder (`decoder.py`, `transformer.py`) as it is, with biases where the config's attention_bias asks.
"""

from __future__ import annotations

from typing import Any

from infer.api.config import ModelConfig
from infer.api.errors import ModelLoadError
from infer.api.hookspecs import hookimpl
from infer.plugins.model.decoder import DecoderModel
from infer.plugins.model.transformer import Family, hf_activation

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


class Llama(DecoderModel):
    hf_architectures = ("LlamaForCausalLM",)
    presets = PRESETS

    @classmethod
    def family(cls, config: ModelConfig) -> Family:
        if config.extra.get("mlp_bias"):
            raise ModelLoadError(
                f"config.json of {config.name or 'the model'} sets mlp_bias, which the llama plugin does not "
                f"implement: use a checkpoint without MLP biases"
            )
        bias = bool(config.extra.get("attention_bias"))
        return Family(qkv_bias=bias, o_bias=bias, activation=hf_activation(config))


@hookimpl
def infer_register_models(register) -> None:
    register("llama", Llama)
