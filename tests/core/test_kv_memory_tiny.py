"""Shared, cached and swapped KV memory through the whole engine, on a tiny random Llama.

Greedy tokens never depend on how the KV memory is managed; an aborted request gives back every
block, device and CPU; `infer run` reports prefix hits, preemptions by kind, KV utilisation and
the blocks sharing saved.
"""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from infer import SamplingParams
from infer.cli.main import cli
from infer.llm import LLM

SHARED = list(range(30, 70))  # a 40-token "system prompt"
PROMPTS = [SHARED + [5, 6, 7], [10, 11], SHARED + [8], list(range(20, 60)), [3] * 17, SHARED + [100, 7, 200]]
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    llm = LLM(model=str(tiny_llama_dir), block_size=4, enable_prefix_caching=False)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]


KV_CONFIGS = {
    "prefix caching": dict(),
    "prefix caching, chunked": dict(max_num_batched_tokens=7),
    "no prefix caching, chunked": dict(enable_prefix_caching=False, max_num_batched_tokens=7),
    # a fixed cache holds one request of max_model_len (16 blocks of 4 tokens: 64)
    "swap, tiny KV": dict(num_kv_blocks=16, max_model_len=64, preemption_mode="swap"),
    "swap, tiny KV, tiny CPU pool": dict(
        num_kv_blocks=16, max_model_len=64, preemption_mode="swap", swap_space_gib=12 * 2**-20
    ),
    "recompute, tiny KV": dict(num_kv_blocks=16, max_model_len=64),
    "contiguous": dict(
        kv_allocator="contiguous", num_kv_blocks=24, max_model_len=96
    ),  # reserves whole lengths: never preempts
}


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
@pytest.mark.parametrize("name", list(KV_CONFIGS), ids=list(KV_CONFIGS))
def test_greedy_tokens_do_not_depend_on_kv_management(tiny_llama_dir, reference, name):
    llm = LLM(model=str(tiny_llama_dir), block_size=4, **KV_CONFIGS[name])
    for _ in range(2):  # the second round finds the first round's prompts cached
        outs = llm.generate(PROMPTS, GREEDY)
        assert [o.outputs[0].token_ids for o in outs] == reference
        assert all(o.outputs[0].finish_reason == "length" for o in outs)
    stats, usage = llm.engine.stats(), llm.engine.kv_usage()
    assert usage.num_used_blocks == 0 and usage.num_swapped_blocks == 0
    if llm.config.enable_prefix_caching:
        assert usage.prefix_hit_rate > 0.3, usage
    if "tiny KV" in name:
        assert stats["preemptions"] > 0
    if "swap" in name:
        assert stats["preemptions_swap"] > 0
    if "tiny CPU pool" in name:
        assert stats["preemptions_recompute"] > 0, "a full CPU pool falls back to recompute"


def test_abort_frees_device_and_cpu_blocks(tiny_llama_dir):
    llm = LLM(model=str(tiny_llama_dir), block_size=4, num_kv_blocks=20, max_model_len=80, preemption_mode="swap")
    engine = llm.engine
    ids = [engine.add_request(p, SamplingParams(max_tokens=60, temperature=0, ignore_eos=True, n=2)) for p in PROMPTS]
    for _ in range(40):
        engine.step()
        if engine.kv_usage().num_swapped_blocks:
            break
    assert engine.kv_usage().num_swapped_blocks > 0 and engine.kv_usage().num_used_blocks > 0
    for rid in ids:
        engine.abort(rid)
    while engine.has_unfinished():
        engine.step()
    usage = engine.kv_usage()
    assert usage.num_used_blocks == 0 and usage.num_swapped_blocks == 0 and not engine.scheduler.allocator.owners
    assert engine.scheduler.allocator.num_free_blocks() == 20  # cached blocks stay cached, but count as free


def test_parallel_samples_are_seeded_and_share_their_prompt(tiny_llama_dir):
    llm = LLM(model=str(tiny_llama_dir), block_size=4)
    params = SamplingParams(n=4, max_tokens=10, temperature=1.0, seed=7, ignore_eos=True)
    alone = llm.generate([PROMPTS[0]], params)[0]
    engine = llm.engine
    rid = engine.add_request(PROMPTS[0], params)
    for p in PROMPTS[1:]:
        engine.add_request(p, GREEDY)
    saved, results = 0, {}
    while engine.has_unfinished():
        results.update({o.request_id: o for o in engine.step()})
        saved = max(saved, engine.kv_usage().num_saved_blocks)
    batched = results[rid]
    assert [c.token_ids for c in batched.outputs] == [c.token_ids for c in alone.outputs], (
        "seeded samples depend on the batch"
    )
    assert len({tuple(c.token_ids) for c in alone.outputs}) > 1
    assert saved >= 3 * ((len(PROMPTS[0]) - 1) // 4), "three samples share the parent's full prompt blocks"


def test_run_report_has_the_kv_columns(tiny_llama_dir, tmp_path):
    data = tmp_path / "prompts.json"
    data.write_text(json.dumps([SHARED + [1, 2], SHARED + [3], list(range(5, 25))]))
    out = tmp_path / "run.json"
    args = [
        "run",
        "--model",
        str(tiny_llama_dir),
        "--no-progress",
        "--show",
        "0",
        "--dataset",
        str(data),
        "--max-tokens",
        "6",
        "--block-size",
        "4",
        "--n",
        "2",
        "--max-num-seqs",
        "2",
        "--preemption-mode",
        "swap",
        "--json-out",
        str(out),
    ]
    result = CliRunner().invoke(cli, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    for column in ("KV util", "prefix hit", "preempt swap/recomp", "shared blk"):
        assert column in result.output
    (record,) = json.loads(out.read_text())["records"]
    assert 0 < record["kv_utilisation"] <= 1 and record["prefix_hit_rate"] > 0 and record["blocks_saved_by_sharing"] > 0
    assert record["preemptions"] == record["preemptions_swap"] + record["preemptions_recompute"]
    assert record["output_tokens"] == 3 * 2 * 6


def test_beam_search_through_the_cli(tiny_llama_dir, tmp_path):
    out = tmp_path / "run.json"
    args = [
        "run",
        "--model",
        str(tiny_llama_dir),
        "--no-progress",
        "--show",
        "0",
        "--dataset",
        "random-256x256",
        "--num-prompts",
        "2",
        "--max-tokens",
        "5",
        "--beam-width",
        "3",
        "--n",
        "2",
        "--json-out",
        str(out),
    ]
    result = CliRunner().invoke(cli, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    (record,) = json.loads(out.read_text())["records"]
    assert record["output_tokens"] == 2 * 2 * 5 and record["blocks_saved_by_sharing"] > 0
