"""`--kv-cache-dtype fp8` through the whole engine, on a tiny random Llama (fp32 on the CPU).

The FP8 run follows the fp32-KV run's greedy tokens closely (figures printed, floors asserted); the
same budget holds twice the blocks of a bf16 cache; a checkpoint's calibrated KV scales are what its
cache is written and read with; swap, prefix caching and chunked prefill give the
FP8 run's own tokens exactly (a block's bytes are the same however it got there); a backend without
an FP8 KV cache is refused before any weight loads, naming the ones that have it.
"""

from __future__ import annotations

import pytest
import torch
from fp8_checkpoints import with_kv_scales  # tests/, on sys.path

import infer
from infer import SamplingParams
from infer.api import Capabilities
from infer.api.errors import IncompatiblePluginsError
from infer.api.kv_cache import FP8, FP8KVCache, quantize_fp8
from infer.llm import LLM
from infer.plugins.attention.torch_backend import TorchAttention
from infer.testing.agreement import forced_agreement, prefix_agreement

PROMPTS = [[(7 * i + 3 * j) % 200 + 3 for j in range(5 + i % 9)] for i in range(16)]
SHARED = list(range(30, 70))
KV_PROMPTS = [SHARED + [5, 6, 7], [10, 11], SHARED + [8], list(range(20, 60)), [3] * 17, SHARED + [100, 7, 200]]
GREEDY = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
KV_GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)  # within the tiny caches' 64 tokens


@pytest.fixture(scope="module")
def fp32_kv(tiny_llama_dir):
    return LLM(model=str(tiny_llama_dir), block_size=4)


@pytest.fixture(scope="module")
def fp8_kv(tiny_llama_dir):
    return LLM(model=str(tiny_llama_dir), block_size=4, kv_cache_dtype="fp8")


def test_greedy_agreement_with_the_fp32_cache(fp32_kv, fp8_kv):
    """A random model's next-token scores are close together, so 3 mantissa bits of K and V change
    some picks: measured 37% of each output before the first difference, 93% of steps forced."""
    reference = [o.outputs[0].token_ids for o in fp32_kv.generate(PROMPTS, GREEDY)]
    outputs = [o.outputs[0].token_ids for o in fp8_kv.generate(PROMPTS, GREEDY)]
    prefix, forced = prefix_agreement(reference, outputs), forced_agreement(fp8_kv, PROMPTS, reference)
    print(
        f"tiny llama, fp8 KV against fp32 KV: {prefix:.1%} of tokens before the first difference, {forced:.1%} forced"
    )
    assert forced >= 0.85 and prefix >= 0.25
    assert outputs != reference  # the cache is quantized: a run equal to fp32's would prove nothing


def test_the_cache_is_fp8_and_the_budget_holds_twice_bf16s_blocks(tiny_llama_dir, fp8_kv):
    caches = fp8_kv.engine.parts.runners[0].kv_caches
    assert len(caches) == 3 and all(isinstance(c, FP8KVCache) and c[0].dtype == c[1].dtype == FP8 for c in caches)
    assert all((c.k_scale, c.v_scale) == (1.0, 1.0) for c in caches)
    # 3 layers x 2 KV heads x 16 dims x 4 tokens x (K, V): 1536 bytes a block in bf16
    budget = dict(kv_cache_memory_gib=1536 * 500 / 2**30, block_size=4)
    blocks = {
        kv: LLM(model=str(tiny_llama_dir), dtype=dtype, kv_cache_dtype=kv, **budget).engine.parts.describe["kv_blocks"]
        for kv, dtype in (("auto", "bfloat16"), ("fp8", "bfloat16"))
    }
    assert blocks == {"auto": 500, "fp8": 1000}


KV_CONFIGS = {
    "prefix caching": dict(),
    "no prefix caching, chunked": dict(enable_prefix_caching=False, max_num_batched_tokens=7),
    "swap, tiny KV": dict(num_kv_blocks=16, max_model_len=64, preemption_mode="swap"),
    "recompute, tiny KV": dict(num_kv_blocks=16, max_model_len=64),
}


@pytest.fixture(scope="module")
def fp8_reference(tiny_llama_dir):
    llm = LLM(model=str(tiny_llama_dir), block_size=4, enable_prefix_caching=False, kv_cache_dtype="fp8")
    return [o.outputs[0].token_ids for o in llm.generate(KV_PROMPTS, KV_GREEDY)]


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
@pytest.mark.parametrize("name", list(KV_CONFIGS), ids=list(KV_CONFIGS))
def test_kv_management_keeps_the_fp8_runs_tokens(tiny_llama_dir, fp8_reference, name):
    llm = LLM(model=str(tiny_llama_dir), block_size=4, kv_cache_dtype="fp8", **KV_CONFIGS[name])
    for _ in range(2):  # the second round finds the first round's prompts cached
        assert [o.outputs[0].token_ids for o in llm.generate(KV_PROMPTS, KV_GREEDY)] == fp8_reference
    stats, usage = llm.engine.stats(), llm.engine.kv_usage()
    assert usage.num_used_blocks == 0 and usage.num_swapped_blocks == 0
    if llm.config.enable_prefix_caching:
        assert usage.prefix_hit_rate > 0.3, usage
    if "swap" in name:
        assert stats["preemptions_swap"] > 0
    if "recompute" in name:
        assert stats["preemptions"] > 0


class NoFp8Attention(TorchAttention):  # the reference kernels, declaring no FP8 KV cache
    capabilities = Capabilities()


class Plugin:
    @staticmethod
    @infer.hookimpl
    def infer_register_attention_backends(register):
        register("no-fp8", NoFp8Attention)


@pytest.mark.parametrize("flags", [dict(attention="no-fp8"), dict(attention="torch", prefill_attention="no-fp8")])
def test_a_backend_without_an_fp8_cache_is_refused_before_the_model_is_read(flags):
    flag = "--prefill-attention" if "prefill_attention" in flags else "--attention"
    # a model that does not exist: the refusal comes first, before the model is even looked for
    with pytest.raises(IncompatiblePluginsError) as refused:
        LLM(model="/no/such/model", plugins=[Plugin], kv_cache_dtype="fp8", device="cpu", **flags)
    message = str(refused.value)
    assert message.startswith(f"--kv-cache-dtype fp8 needs an attention backend with an FP8 KV cache and {flag} no-fp8")
    able = message.split("one that has it (")[1].split(")")[0].split(", ")
    assert "torch" in able and "no-fp8" not in able  # test_doctor.py checks the whole list
    assert message.endswith("or --kv-cache-dtype auto") and "\n" not in message


CALIBRATED = [(0.37, 0.011), (2.5, 0.4), (1.0, 0.75)]  # (k_scale, v_scale) of the 3 layers


@pytest.fixture(scope="module")
def calibrated_dir(tiny_llama_dir, tmp_path_factory):
    """The tiny Llama saved with calibrated KV scales, as llm-compressor's kv_cache_scheme stores them."""
    return with_kv_scales(tiny_llama_dir, tmp_path_factory.mktemp("kv-scales") / "model", CALIBRATED)


def test_a_checkpoints_calibrated_kv_scales_are_what_its_cache_is_written_with(calibrated_dir):
    """Each layer's cache holds its K and V quantized with the checkpoint's scales: after one prompt's
    prefill, layer 0's bytes (whose K and V depend on no attention) are exactly the fp32 cache's values
    quantized with them. A cache in the model's dtype ignores the scales (the same tokens as without)."""
    kwargs = dict(block_size=4, num_kv_blocks=64, max_model_len=64)
    fp32 = LLM(model=str(calibrated_dir), **kwargs)
    fp8 = LLM(model=str(calibrated_dir), kv_cache_dtype="fp8", **kwargs)
    caches = fp8.engine.parts.runners[0].kv_caches
    assert [(c.k_scale, c.v_scale) for c in caches] == [pytest.approx(s) for s in CALIBRATED]
    once = SamplingParams(max_tokens=1, temperature=0)
    for llm in (fp32, fp8):
        llm.generate([PROMPTS[5]], once)
    (k32, v32), (k8, v8) = fp32.engine.parts.runners[0].kv_caches[0], caches[0]
    assert k32.abs().amax() > 0  # the prompt was written
    assert torch.equal(k8.view(torch.uint8), quantize_fp8(k32, caches[0].k_scale).view(torch.uint8))
    assert torch.equal(v8.view(torch.uint8), quantize_fp8(v32, caches[0].v_scale).view(torch.uint8))


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
def test_a_calibrated_checkpoint_runs_as_its_scales_say(tiny_llama_dir, calibrated_dir, fp32_kv):
    """The scales change nothing in the weights (an fp32 cache gives the tokens of the checkpoint without
    them), and an FP8 cache read with them still follows the fp32 cache's greedy tokens."""
    plain = LLM(model=str(calibrated_dir), block_size=4)
    reference = [o.outputs[0].token_ids for o in fp32_kv.generate(PROMPTS, GREEDY)]
    assert [o.outputs[0].token_ids for o in plain.generate(PROMPTS, GREEDY)] == reference
    fp8 = LLM(model=str(calibrated_dir), block_size=4, kv_cache_dtype="fp8")
    outputs = [o.outputs[0].token_ids for o in fp8.generate(PROMPTS, GREEDY)]
    prefix, forced = prefix_agreement(reference, outputs), forced_agreement(fp8, PROMPTS, reference)
    print(f"tiny llama, fp8 KV with calibrated scales: {prefix:.1%} before the first difference, {forced:.1%} forced")
    assert forced >= 0.85 and prefix >= 0.25


@pytest.mark.parametrize("draft", ["model", "self"])
def test_a_draft_reads_its_cache_with_its_own_checkpoints_scales(tiny_llama_dir, calibrated_dir, draft):
    """A draft model's cache takes its checkpoint's scales (none here: 1.0), a self-draft's (the target's
    first layers) is the target's own cache."""
    extra = dict(draft=str(tiny_llama_dir)) if draft == "model" else dict(draft="self", exit_layer=2)
    llm = LLM(model=str(calibrated_dir), block_size=4, kv_cache_dtype="fp8", decoding="speculative", **extra)
    target, drafter = llm.engine.parts.runners[:2]
    assert [(c.k_scale, c.v_scale) for c in target.kv_caches] == [pytest.approx(s) for s in CALIBRATED]
    if draft == "model":
        assert [(c.k_scale, c.v_scale) for c in drafter.kv_caches] == [(1.0, 1.0)] * 3
    else:
        assert drafter.kv_caches is target.kv_caches and drafter.kv_scales == target.kv_scales
    assert llm.generate([PROMPTS[3]], KV_GREEDY)[0].outputs[0].token_ids  # and it runs
