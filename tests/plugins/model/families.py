"""Tiny random checkpoints of each built-in family, written by transformers' own classes, and HF's
own model of each: the oracle the model plugins are held to.

Each config turns on what its family does differently: GQA everywhere, Llama's attention_bias, a
sliding window shorter than most prompts (every family that has one), Qwen2's QKV bias and tied
embeddings, Qwen3's per-head q/k norms and a head_dim wider than hidden / heads, Phi-3's fused
checkpoint, longrope (with an attention scaling) and partial rotary, Gemma 2's caps (small enough
to bite), its query_pre_attn_scalar and its alternating windows. Every weight is drawn larger than
HF's init (norm weights and biases too), so a norm applied in the wrong place or a dropped bias
changes the tokens.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import torch

from infer.plugins.model import gemma2, llama, mistral, phi3, qwen2, qwen3

PLUGINS = [llama, qwen2, qwen3, mistral, phi3, gemma2]  # registered explicitly: the tests need no install
WINDOW = 10
SHAPE: dict[str, Any] = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {  # name -> (transformers config class, its settings)
    "llama": ("LlamaConfig", dict(attention_bias=True)),  # biases on q, k, v and o: o_proj's is whole per rank
    "qwen2": (
        "Qwen2Config",
        dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1, tie_word_embeddings=True),
    ),
    "qwen3": (
        "Qwen3Config",
        dict(head_dim=32, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=2),
    ),
    "mistral": ("MistralConfig", dict(sliding_window=WINDOW)),
    "phi3": (
        "Phi3Config",
        dict(
            sliding_window=WINDOW,
            max_position_embeddings=512,
            original_max_position_embeddings=128,  # attention scaling sqrt(1 + ln 4 / ln 128)
            partial_rotary_factor=0.5,  # 8 of 16 dims turn
            rope_scaling=dict(type="longrope", short_factor=[1.0, 1.3, 1.9, 2.6], long_factor=[1.5, 2.5, 4.0, 8.0]),
        ),
    ),
    "gemma2": (
        "Gemma2Config",
        dict(
            head_dim=16,
            query_pre_attn_scalar=24,
            sliding_window=WINDOW,
            attn_logit_softcapping=2.0,
            final_logit_softcapping=3.0,
        ),
    ),
}
PROMPT_LENS = (4, 11, 17, 24, 13, 30, 40, 19)


def prompts() -> list[list[int]]:
    rng = random.Random(0)
    out = [[rng.randrange(3, SHAPE["vocab_size"]) for _ in range(n)] for n in PROMPT_LENS]
    out[6] = out[5] + out[6][:10]  # a shared prefix, for prefix caching
    return out


def hf_config(family: str, **changes: Any) -> Any:
    import transformers

    class_name, settings = FAMILIES[family]
    architectures = [class_name.removesuffix("Config") + "ForCausalLM"]
    config = getattr(transformers, class_name)(
        **{**SHAPE, **settings, **changes}, architectures=architectures, dtype="float32"
    )
    config._attn_implementation = "eager"  # soft caps and windows as HF's reference kernel applies them
    return config


def hf_model(config: Any, seed: int = 0) -> Any:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
            elif "norm" in name:
                p.uniform_(0.5, 1.5)
            else:  # biases
                p.normal_(0, 0.5)
    return model


@torch.no_grad()
def hf_logprobs(model: Any, prompt: list[int], continuation: list[int]) -> torch.Tensor:
    """HF's log-probabilities for each token of `continuation` after `prompt` ([len(continuation), V]),
    from one forward over the whole sequence without a cache: nothing but HF's own masks."""
    ids = torch.tensor([prompt + continuation])
    logits = model(ids, use_cache=False).logits[0, len(prompt) - 1 : -1]
    return logits.float().log_softmax(-1)


def check_against_hf(model: Any, prompt_ids: list[list[int]], outputs: list[Any], atol: float = 1e-4) -> None:
    """`outputs` (CompletionOutputs) are HF's greedy continuations: at every step the token is HF's
    argmax given the tokens before it (so HF's greedy loop would produce the same tokens), and its
    log-probability, where one was returned, is HF's within `atol`."""
    for i, (prompt, out) in enumerate(zip(prompt_ids, outputs)):
        logprobs = hf_logprobs(model, prompt, list(out.token_ids))
        hf_tokens = logprobs.argmax(-1).tolist()
        step = next((t for t, (a, b) in enumerate(zip(out.token_ids, hf_tokens)) if a != b), None)
        assert step is None, (
            f"prompt {i}: step {step} chose {out.token_ids[step]} where HF's argmax is {hf_tokens[step]} "
            f"(HF log-probabilities {logprobs[step, out.token_ids[step]]:.5f} vs {logprobs[step, hf_tokens[step]]:.5f})"
        )
        for t, (token, step_logprobs) in enumerate(zip(out.token_ids, out.logprobs or [])):
            ours, hf = step_logprobs[token], logprobs[t, token].item()
            assert abs(ours - hf) < atol, f"prompt {i}, step {t}: log-probability {ours:.6f}, HF's {hf:.6f}"


class Checkpoint:
    """A family's tiny checkpoint on disk and HF's model of it."""

    def __init__(self, family: str, folder: Path) -> None:
        self.family = family
        self.model = hf_model(hf_config(family))
        self.model.save_pretrained(folder)
        self.folder = folder
