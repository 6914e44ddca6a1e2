"""Decoder losslessness: greedy tokens identical to `autoregressive` on a tiny random Llama.

The target has three layers; the draft (for decoders that need one) is the target's first layer
with its embedding, final norm and LM head, so its proposals are accepted often but not always.
Each check runs with a roomy KV cache and with one so small that requests are preempted.
"""

from __future__ import annotations

import functools
import random
from pathlib import Path
from typing import Any, Sequence

import torch

from infer.api.request import SamplingParams

TINY_LLAMA: dict[str, Any] = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)
PROMPT_LENS = (3, 9, 17, 24, 5, 12)
MAX_TOKENS = 16
SETTINGS: dict[str, dict[str, Any]] = {
    "roomy KV cache": {},
    "KV cache of 14 blocks of 4 tokens (requests preempted)": dict(
        num_kv_blocks=14, block_size=4, max_model_len=52, max_num_seqs=4
    ),
}


def write_tiny_llamas(folder: Path, seed: int = 0) -> tuple[Path, Path]:
    """Save the target and its one-layer draft as HF folders; returns (target, draft)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    target = LlamaForCausalLM(LlamaConfig(**TINY_LLAMA))
    with torch.no_grad():  # larger than the default init, so greedy paths are not near-ties
        for p in target.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
    draft = LlamaForCausalLM(LlamaConfig(**{**TINY_LLAMA, "num_hidden_layers": 1}))
    draft.load_state_dict(target.state_dict(), strict=False)  # layer 0, embedding, norm, head
    paths = folder / "target", folder / "draft"
    for model, path in zip((target, draft), paths):
        model.save_pretrained(path)
    return paths


def prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, TINY_LLAMA["vocab_size"]) for _ in range(n)] for n in PROMPT_LENS]


def generate(
    target: Path, device: torch.device, decoding: str, draft: Path | None, plugins: Sequence[Any] = (), **options: Any
) -> list[list[int]]:
    from infer.llm import LLM

    llm = LLM(
        model=str(target),
        plugins=plugins,
        device=device.type,
        dtype="float32",
        decoding=decoding,
        draft=str(draft) if draft else None,
        **options,
    )
    try:
        outs = llm.generate(prompts(), SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    finally:
        llm.close()
    for i, o in enumerate(outs):
        if o.error:
            raise AssertionError(f"decoding {decoding}: prompt {i} was rejected: {o.error}")
    return [list(o.outputs[0].token_ids) for o in outs]


@functools.lru_cache(maxsize=8)
def reference(target: Path, device: torch.device, setting: str) -> tuple[tuple[int, ...], ...]:
    return tuple(map(tuple, generate(target, device, "autoregressive", None, **SETTINGS[setting])))


def check_lossless(
    name: str,
    needs_draft: bool,
    target: Path,
    draft: Path,
    device: torch.device,
    setting: str,
    plugins: Sequence[Any] = (),
) -> None:
    """`plugins`: inline plugins that provide `name` when it is not installed."""
    expected = [list(t) for t in reference(target, device, setting)]
    got = generate(target, device, name, draft if needs_draft else None, plugins, **SETTINGS[setting])
    where = (
        f"decoder {name}: greedy decoding of a tiny random Llama ({TINY_LLAMA['num_hidden_layers']} layers"
        f"{', one-layer draft' if needs_draft else ''}; {setting})"
    )
    for i, (want, have) in enumerate(zip(expected, got)):
        if have == want:
            continue
        if len(have) != len(want):
            raise AssertionError(
                f"{where}: prompt {i} got {len(have)} tokens, autoregressive {len(want)} "
                f"(max_tokens={MAX_TOKENS}, EOS ignored): a decoder must stop exactly at max_tokens"
            )
        t = next(j for j, (a, b) in enumerate(zip(have, want)) if a != b)
        raise AssertionError(
            f"{where}: prompt {i} (of {len(expected)}, {PROMPT_LENS[i]} tokens) differs from autoregressive at output "
            f"token {t}: {have[t]} instead of {want[t]} (autoregressive {want[: t + 1]}, {name} {have[: t + 1]}); "
            f"a lossless decoder keeps exactly the target's greedy tokens: check the acceptance rule, the bonus token "
            f"and that the KV of rejected tokens is rolled back (StepResult.num_computed)"
        )
