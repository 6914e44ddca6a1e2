"""A served engine's first steps, taken before the server reports ready.

The first prefill of a shape compiles its kernels (Triton specializes on sizes equal to 1 and on
multiples of 16); in a server that compile would land on the first users' requests (seen on an H100
with llama3-8b: a 0.6 s step while 600 requests waited). A few token-id prompts of such sizes, run to
three tokens each, take those compiles at startup; the counters are reset after them.
"""

from __future__ import annotations

import time

from infer.api.request import SamplingParams
from infer.core.engine import Engine

# prompt lengths, one batch each: one short prompt; sixteen of sixteen tokens; a few of odd lengths
BATCHES = ([5], [16] * 16, [7, 9, 13])


def warm_up(engine: Engine, max_tokens: int = 3) -> float:
    """Run the warm-up batches (prompts that fit the engine's context); returns the seconds it took."""
    started = time.perf_counter()
    limit = engine.parts.max_model_len - max_tokens
    token = min(engine.parts.vocab_size - 1, 100)  # any id the model has
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for lengths in BATCHES:
        prompts = [{"prompt_token_ids": [token] * n} for n in lengths if n <= limit]
        if prompts:
            engine.generate(prompts, params)
    engine.reset_stats()
    return time.perf_counter() - started
