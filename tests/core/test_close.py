"""close() gives the engine's memory back at once, whoever still holds the engine, and nothing keeps
a closed engine alive."""

from __future__ import annotations

import gc
import weakref

import pytest

from infer import LLM, SamplingParams
from infer.api.errors import RequestError


def _storage_bytes(llm: LLM) -> int:
    total = 0
    for runner in llm.engine.parts.runners:
        total += sum(t.untyped_storage().nbytes() for t in (*runner.model.parameters(), *runner.model.buffers()))
        total += sum(t.untyped_storage().nbytes() for layer in runner.kv_caches for t in layer)
    return total


@pytest.mark.parametrize("options", [{}, {"decoding": "speculative", "draft": "self", "exit_layer": 1}])
def test_close_frees_weights_and_cache_while_still_referenced(tiny_llama_dir, options):
    llm = LLM(model=str(tiny_llama_dir), attention="torch", num_kv_blocks=32, max_model_len=256, **options)
    kv = [t for layer in llm.engine.parts.runners[0].kv_caches for t in layer]
    first = llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0]
    assert len(first.outputs[0].token_ids) == 6 and _storage_bytes(llm) > 0
    llm.close()
    assert _storage_bytes(llm) == 0 and all(t.untyped_storage().nbytes() == 0 for t in kv)
    llm.close()  # idempotent
    with pytest.raises(RequestError, match="closed"):
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2))


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
def test_closed_engine_is_collected(tiny_llama_dir):
    llm = LLM(model=str(tiny_llama_dir), attention="torch", num_kv_blocks=32, max_model_len=256)
    llm.generate(["ab", [3, 4, 5]], SamplingParams(max_tokens=4, temperature=0.7, seed=1))
    engine = weakref.ref(llm.engine)
    llm.close()
    del llm
    gc.collect()
    assert engine() is None
