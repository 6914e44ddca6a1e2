"""How closely a lossy engine (an FP8 KV cache, quantized weights) follows a reference engine's greedy
tokens, in two figures:

- `prefix_agreement`: the share of each output generated before the first token that differs,
  averaged over prompts. One early near-tie sends the rest of an output elsewhere, so it compounds
  every step's error and depends on the output length.
- `forced_agreement`: each step on its own: the lossy engine is given every prefix of the reference
  outputs (prompt + reference[:i]) and picks one token, which is compared with reference[i].
"""

from __future__ import annotations

from typing import Any, Sequence

from infer.inputs.sampling import SamplingParams


def prefix_agreement(reference: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]]) -> float:
    shares = []
    for ref, out in zip(reference, outputs, strict=True):
        same = next((i for i, (a, b) in enumerate(zip(ref, out)) if a != b), min(len(ref), len(out)))
        shares.append(same / len(ref))
    return sum(shares) / len(shares)


def forced_agreement(llm: Any, prompt_ids: Sequence[list[int]], reference: Sequence[list[int]]) -> float:
    """`llm` (an `infer.LLM`) picks the next token greedily after every prefix of each reference output."""
    forced = [{"prompt_token_ids": p + ref[:i]} for p, ref in zip(prompt_ids, reference) for i in range(len(ref))]
    picked = [o.outputs[0].token_ids[0] for o in llm.generate(forced, SamplingParams(max_tokens=1, temperature=0))]
    expected = [t for ref in reference for t in ref]
    return sum(a == b for a, b in zip(picked, expected)) / len(expected)
