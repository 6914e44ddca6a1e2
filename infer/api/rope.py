"""The rotary embedding a model applies, computed by transformers' own RoPE initialisation.

`Rope` is what a rotary layer is built from: Neox-style (rotate halves) angles position * inv_freq,
with cos and sin multiplied by `attention_scaling` (yarn's and longrope's mscale; 1 otherwise).
Frequencies come from `transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS` for the config's
`rope_parameters`, so every RoPE type transformers knows for Llama gives HF's numbers. With a
`partial_rotary_factor` below 1 (Phi-3 and Phi-4 configs) only the first `rotary_dim` dims of each
head turn, as transformers' `apply_rotary_pos_emb` does when cos is narrower than the head.

A KV cache holds keys already rotated, so the frequencies must not change with the sequence's
length. `dynamic` (NTK) and `longrope` change them in HF past a threshold: below it they are
fixed (dynamic: the default frequencies up to max_position_embeddings; longrope: the short factors
up to original_max_position_embeddings), so the context is capped there (`rope_context_limit`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch

from infer.api.errors import ModelLoadError, one_line

# the RoPE types transformers' Llama accepts (LlamaRotaryEmbedding: "default" or ROPE_INIT_FUNCTIONS)
LLAMA_ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")


@dataclass(frozen=True, slots=True)
class Rope:
    """What a rotary layer needs: cos/sin tables are cos(p * inv_freq) * attention_scaling."""

    inv_freq: tuple[float, ...]  # [rotary_dim / 2], the float32 values transformers computes
    attention_scaling: float = 1.0  # multiplies cos and sin (yarn, longrope)
    rope_type: str = "default"

    @classmethod
    def default(cls, head_dim: int, theta: float) -> "Rope":
        """Plain RoPE with base `theta`, as transformers computes it (tests, shapes without a config)."""
        return rope_for(dict(rope_type="default", rope_theta=theta), head_dim, head_dim, 1, 2048)

    @property
    def rotary_dim(self) -> int:
        """The dims of each head it turns: head_dim, or fewer under a partial_rotary_factor."""
        return 2 * len(self.inv_freq)

    def tables(self, max_position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin, [max_position, rotary_dim / 2] float32 (angles in float64, then rounded once)."""
        inv_freq = torch.tensor(self.inv_freq, dtype=torch.float64)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float64), inv_freq)
        return (freqs.cos() * self.attention_scaling).float(), (freqs.sin() * self.attention_scaling).float()


def rope_for(
    rope_parameters: Mapping[str, Any],
    head_dim: int,
    hidden_size: int,
    num_heads: int,
    max_position_embeddings: int,
    source: str = "config.json",
) -> Rope:
    """transformers' inv_freq and attention scaling for these `rope_parameters` (its standardised dict:
    rope_type, rope_theta and the type's own keys). Refuses, by name, a type Llama does not know."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    kind = rope_parameters.get("rope_type", rope_parameters.get("type", "default"))
    if kind not in LLAMA_ROPE_TYPES:
        raise ModelLoadError(
            f"{source} asks for rope_type {kind!r}, which transformers does not know for Llama: "
            f"use one of {', '.join(LLAMA_ROPE_TYPES)} in its rope_parameters"
        )
    # the dims that turn: the scaled types read partial_rotary_factor themselves; Llama's default
    # computation does not, so it is given the rotary width as its head_dim (as Phi-3's computes it)
    rotary_dim = int(head_dim * float(rope_parameters.get("partial_rotary_factor") or 1.0))
    try:
        hf = LlamaConfig(
            hidden_size=hidden_size,
            num_attention_heads=num_heads,
            head_dim=rotary_dim if kind == "default" else head_dim,
            max_position_embeddings=max_position_embeddings,
            rope_parameters=dict(rope_parameters),
        )
        init = LlamaRotaryEmbedding.compute_default_rope_parameters if kind == "default" else ROPE_INIT_FUNCTIONS[kind]
        with torch.device("cpu"):  # not the meta or CUDA device a model may be built under
            inv_freq, scaling = init(hf)
    except (KeyError, TypeError, ValueError, RuntimeError) as exc:
        raise ModelLoadError(
            f"{source}'s rope_parameters ({kind}) are incomplete or wrong ({one_line(exc)}): "
            f"fix them as transformers' RopeParameters documents"
        ) from exc
    if rotary_dim % 2 or not 0 < rotary_dim <= head_dim or inv_freq.numel() != rotary_dim // 2:
        raise ModelLoadError(  # an odd or empty partial width, or longrope factors of another length
            f"{source}'s {kind} RoPE rotates {2 * inv_freq.numel()} dims where partial_rotary_factor makes "
            f"{rotary_dim} of {head_dim}: give an even width and {max(rotary_dim, 2) // 2} factors per list"
        )
    return Rope(tuple(inv_freq.float().tolist()), float(scaling), kind)


def rope_context_limit(rope_parameters: Mapping[str, Any], max_position_embeddings: int) -> tuple[int, str]:
    """The longest context the rotary tables are exact for, and why it is no longer."""
    kind = rope_parameters.get("rope_type", "default")
    if kind == "longrope":
        original = int(rope_parameters.get("original_max_position_embeddings") or max_position_embeddings)
        if original < max_position_embeddings:
            return original, (
                f"longrope switches to its long factors past original_max_position_embeddings "
                f"({original}), which a cache of already-rotated keys cannot follow"
            )
    if kind == "dynamic":
        return max_position_embeddings, (
            f"dynamic RoPE rescales its frequencies past max_position_embeddings "
            f"({max_position_embeddings}), which a cache of already-rotated keys cannot follow"
        )
    return max_position_embeddings, f"max_position_embeddings is {max_position_embeddings}"
