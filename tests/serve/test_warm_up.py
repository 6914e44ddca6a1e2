"""The served engine's warm-up leaves nothing behind: no request, no block, no counted step or prefix
lookup, and the same greedy output for the first real request as an engine that was never warmed."""

from __future__ import annotations

from infer import LLM, SamplingParams
from infer.serve.warm_up import BATCHES, warm_up


def test_warm_up_leaves_the_engine_as_it_found_it(tiny_llama_dir):
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    prompt = {"prompt_token_ids": [3, 14, 15, 92, 65, 35]}
    opts = dict(attention="torch", num_kv_blocks=64, max_model_len=256, enable_prefix_caching=True)
    cold = LLM(model=str(tiny_llama_dir), **opts)
    warm = LLM(model=str(tiny_llama_dir), **opts)
    try:
        expected = cold.generate([prompt], params)[0].outputs[0].token_ids
        engine = warm.engine
        seconds = warm_up(engine)
        assert seconds > 0
        assert engine.num_steps == 0 and not engine.has_unfinished() and not engine.requests
        usage = engine.kv_usage()
        assert usage.num_used_blocks == 0
        assert usage.prefix_query_tokens == usage.prefix_hit_tokens == 0  # /metrics starts from the first request
        assert warm.generate([prompt], params)[0].outputs[0].token_ids == expected
    finally:
        cold.close()
        warm.close()


def test_warm_up_skips_prompts_longer_than_the_context(tiny_llama_dir):
    llm = LLM(model=str(tiny_llama_dir), attention="torch", num_kv_blocks=64, max_model_len=12)
    try:
        sent = []
        generate = llm.engine.generate
        llm.engine.generate = lambda prompts, params: (
            sent.append([len(p["prompt_token_ids"]) for p in prompts]) or (generate(prompts, params))
        )
        warm_up(llm.engine)  # 16- and 13-token prompts do not fit 12 - 3 tokens
        assert sent == [[5], [7, 9]]
        assert BATCHES == ([5], [16] * 16, [7, 9, 13])  # what the expectation above was written for
    finally:
        llm.close()
