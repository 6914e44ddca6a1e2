"""How closely a lossy engine (an FP8 KV cache, quantized weights) follows a reference engine's greedy
tokens, in two figures:

- `prefix_agreement`: the share of each output generated before the first token that differs,
  averaged over prompts. One early near-tie sends the rest of an output elsewhere, so it compounds
  every step's error and depends on the output length.
- `forced_agreement`: each step on its own: the lossy engine is given every prefix of the reference
  outputs (prompt + reference[:i]) and picks one token, which is compared with reference[i]. The
  prefixes of one output are one prefill, scored row by row (`SamplingParams.prompt_logprobs`).
"""

from __future__ import annotations

from typing import Any, Sequence

from infer.api.errors import RequestError
from infer.api.params import SamplingParams


def prefix_agreement(reference: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]]) -> float:
    shares = []
    for ref, out in zip(reference, outputs, strict=True):
        same = next((i for i, (a, b) in enumerate(zip(ref, out)) if a != b), min(len(ref), len(out)))
        shares.append(same / len(ref))
    return sum(shares) / len(shares)


def forced_agreement(llm: Any, prompt_ids: Sequence[list[int]], reference: Sequence[list[int]]) -> float:
    """`llm` (an `infer.LLM` or `Engine`) picks the next token greedily after every prefix of each reference
    output. One request per prompt computes them all: prompt + reference[:-1], whose prompt logprobs (top 1)
    give the picks after every prefix but the whole, and whose greedy token is the last pick."""
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1)
    forced = [{"prompt_token_ids": p + ref[:-1]} for p, ref in zip(prompt_ids, reference, strict=True) if ref]
    outputs = iter(llm.generate(forced, params))
    agree = total = 0
    for p, ref in zip(prompt_ids, reference):
        if not ref:
            continue
        out = next(outputs)
        if out.error is not None:
            raise RequestError(f"forced decoding of {p[:8]}...: {out.error}")
        # prompt_logprobs[j]: token j's score and the top one, given tokens < j; max keeps the top one on a tie
        picked = [max(scores, key=scores.get) for scores in out.prompt_logprobs[len(p) :]]
        picked.append(out.outputs[0].token_ids[0])
        agree += sum(a == b for a, b in zip(picked, ref, strict=True))
        total += len(ref)
    return agree / total
