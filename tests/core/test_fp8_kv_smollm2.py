"""`--kv-cache-dtype fp8` on the real SmolLM2-135M-Instruct (fp32 weights, CPU): how closely its greedy
tokens follow the fp32 cache's, printed and held to a floor.

e4m3 keeps 3 mantissa bits: SmolLM2's K and V come back 2.6% off (RMS, any layer; a per-layer scale
changes nothing here, as no value leaves e4m3's range), and a 135M model has close calls. Measured:
95% of next tokens agree given the same prefix, and 55% of each 32-token output comes before the
first difference (for scale: bf16 weights, against fp32, keep 79%).
"""

from __future__ import annotations

import pytest

from infer import SamplingParams
from infer.llm import LLM
from infer.testing.agreement import forced_agreement, prefix_agreement

pytestmark = pytest.mark.slow  # about 15 s on two CPU cores

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "In 1969, the first humans to walk on the Moon were",
    "<|im_start|>user\nWhat is 12 times 7?<|im_end|>\n<|im_start|>assistant\n",
    "Water boils at",
    "The quick brown fox",
    "import numpy as np\n",
    "My favourite recipe for pancakes",
    "The theory of relativity says",
    "List three fruits:",
    "Dear John,\nI am writing to",
    "The largest planet in the solar system is",
    "SELECT * FROM users WHERE",
    "Photosynthesis is the process",
]
GREEDY = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)


def test_greedy_agreement_with_the_fp32_cache(smollm2_dir):
    fp32 = LLM(model=str(smollm2_dir), dtype="float32")
    reference = [o.outputs[0].token_ids for o in fp32.generate(PROMPTS, GREEDY)]
    fp8 = LLM(model=str(smollm2_dir), dtype="float32", kv_cache_dtype="fp8")
    outputs = [o.outputs[0].token_ids for o in fp8.generate(PROMPTS, GREEDY)]
    prefix = prefix_agreement(reference, outputs)
    forced = forced_agreement(fp8, [fp32.engine.tokenize(p)[1] for p in PROMPTS], reference)
    print(
        f"smollm2-135m, fp8 KV against fp32 KV: {prefix:.1%} of tokens before the first difference, {forced:.1%} forced"
    )
    assert forced >= 0.92 and prefix >= 0.45
