"""The served engine's warm-up leaves nothing behind: no request, no block, no counted step, and the
same greedy output for the first real request as an engine that was never warmed."""

from __future__ import annotations

from infer import LLM, SamplingParams
from infer.serve.warm_up import BATCHES, warm_up


def test_warm_up_leaves_the_engine_as_it_found_it(tiny_llama_dir):
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    prompt = {"prompt_token_ids": [3, 14, 15, 92, 65, 35]}
    cold = LLM(model=str(tiny_llama_dir), attention="torch", num_kv_blocks=64, max_model_len=256)
    warm = LLM(model=str(tiny_llama_dir), attention="torch", num_kv_blocks=64, max_model_len=256)
    try:
        expected = cold.generate([prompt], params)[0].outputs[0].token_ids
        engine = warm.engine
        seconds = warm_up(engine)
        assert seconds > 0
        assert engine.num_steps == 0 and not engine.has_unfinished() and not engine.requests
        assert engine.kv_usage().num_used_blocks == 0
        assert warm.generate([prompt], params)[0].outputs[0].token_ids == expected
    finally:
        cold.close()
        warm.close()


def test_warm_up_skips_prompts_longer_than_the_context(tiny_llama_dir):
    llm = LLM(model=str(tiny_llama_dir), attention="torch", num_kv_blocks=64, max_model_len=12)
    try:
        steps = []
        step = llm.engine.step
        llm.engine.step = lambda: steps.append(len(llm.engine.scheduler.running)) or step()
        warm_up(llm.engine)  # 16- and 13-token prompts do not fit 12 - 3: only the rest run
        assert steps and max(steps) <= len(BATCHES[0]) + len(BATCHES[2]) - 1
    finally:
        llm.close()
