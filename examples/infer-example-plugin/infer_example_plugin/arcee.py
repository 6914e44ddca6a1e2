"""An example model plugin: `arcee`, for checkpoints of HF transformers' `ArceeForCausalLM` (Arcee's AFM
models). Arcee is Llama with another MLP: one up projection and a squared ReLU, where Llama has a
gate and SwiGLU. So the plugin is infer's Llama with that MLP swapped into every layer; attention,
norms, RoPE, weight loading and tensor parallelism are Llama's. Its entry point (pyproject.toml) makes
infer run it for any config.json that names `ArceeForCausalLM`;
`pytest --infer-kit model=arcee` checks it against transformers' own model.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import infer
from infer.api.errors import ModelLoadError
from infer.distributed import layers as tp
from infer.models.shards import Shard
from infer.plugins.models.llama import Llama
from infer.plugins.models.transformer import Family, tp_matmul

INFER_PLUGIN_API = ">=1,<3"


class ReluSquaredMLP(nn.Module):
    """down(relu(up(x))^2). Under tensor parallelism a rank holds a slice of the width: up's rows and
    down's columns; down's output is then this rank's partial sum, which Llama's next norm adds up."""

    def __init__(self, config: Any, layers: Any, parallel: Any = None) -> None:
        super().__init__()
        width = config.intermediate_size
        if parallel is None:
            self.up_proj = layers.linear(config.hidden_size, width)
            self.down_proj = layers.linear(width, config.hidden_size)
        else:
            part, matmul = tp.split(width, parallel), tp_matmul(layers)
            self.up_proj = tp.ColumnParallelLinear(config.hidden_size, Shard(0, (width,), (part,)), matmul)
            self.down_proj = tp.RowParallelLinear(
                config.hidden_size, Shard(1, (width,), (part,)), parallel, matmul, reduce=False
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(torch.relu(self.up_proj(x)).square())


class Arcee(Llama):
    hf_architectures = ("ArceeForCausalLM",)  # the config.json `architectures` this plugin runs
    presets: dict[str, dict[str, Any]] = {}  # no named shapes (Llama's stay Llama's)
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

    def __init__(self, config: Any, layers: Any, attention: Any, parallel: Any = None) -> None:
        super().__init__(config, layers, attention, parallel)
        for layer in self.layers:
            layer.mlp = ReluSquaredMLP(config, layers, parallel)
        if parallel is not None:  # Llama's GPU fast path pushes every partial sum or none; this MLP pushes none
            for layer in self.layers:
                layer.self_attn.o_proj.push = False
            self.embed_tokens.push = self.pushes = False

    @classmethod
    def family(cls, config: Any) -> Family:
        """Llama's attention; the MLP is this plugin's own (ReLU squared, no gate)."""
        act = config.extra.get("hidden_act") or "relu2"
        if act != "relu2":
            raise ModelLoadError(f"config.json of {config.name} asks for hidden_act {act!r}: arcee runs relu2 only")
        bias = bool(config.extra.get("attention_bias"))
        return Family(qkv_bias=bias, o_bias=bias)

    def _target(self, hf_name: str) -> tuple[str, int | None] | None:
        """The parameter a checkpoint tensor fills: up_proj is whole here (Llama fuses it with the gate)."""
        if ".mlp.up_proj." in hf_name:
            return hf_name.removeprefix("model."), None
        return super()._target(hf_name)


@infer.hookimpl
def infer_register_models(register) -> None:
    register("arcee", Arcee)
