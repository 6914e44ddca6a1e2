"""Tensor parallelism on two GPUs (NCCL, ranks spawned by the engine, rank i on cuda:i): tp = 2 against
tp = 1 for each attention backend, with and without CUDA graphs (each rank replays its own).

A small Llama shape with dummy weights (the same model at any tp): fp32 greedy tokens identical and
logprobs close; bf16 compared by agreement and first-token logprobs.
"""

from __future__ import annotations

import json
import random

import pytest
import torch

from infer import SamplingParams
from infer.api.errors import WorkerError
from infer.llm import LLM

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")]

rng = random.Random(0)
PROMPTS = [[rng.randrange(10, 1000) for _ in range(n)] for n in (1, 7, 16, 33, 200, 64)]
PARAMS = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=2)  # top 2: the first token's margin
SHAPE = dict(
    architectures=["LlamaForCausalLM"],
    vocab_size=1024,
    hidden_size=512,
    intermediate_size=1024,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)


@pytest.fixture(scope="module")
def shape_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tp-shape")
    (folder / "config.json").write_text(json.dumps(SHAPE))
    return folder


_TP1: dict = {}  # tp = 1 references, shared by the tests that compare against the same options


def reference(folder, **options):
    key = tuple(sorted(options.items()))
    if key not in _TP1:
        _TP1[key] = generate(folder, 1, **options)
    return _TP1[key]


PUSHES: dict = {}  # the last tp > 1 engine's partial sums pushed by its GEMVs (rank 0), when it could


def generate(folder, tp, prompts=None, **options):
    """Greedy tokens, their logprobs and margins for PROMPTS in one batch, or for `prompts` one at a
    time (one-token decode steps)."""
    from infer.distributed.all_reduce import flashinfer_fused as flashinfer_all_reduce
    from infer.distributed.all_reduce import symm_mem as symmetric_memory

    # auto takes FlashInfer's all-reduce where it can run; else symmetric memory, on these GPUs for
    # the first tp engine of this process only (torch numbers a process's rendezvous, which later
    # engines' fresh ranks could not match)
    flashinfer = flashinfer_all_reduce.unavailable_reason(torch.device("cuda", 0), tp, torch.bfloat16) is None
    first = symmetric_memory._rendezvous_done == 0
    with LLM(model=str(folder), load_format="dummy", tensor_parallel_size=tp, max_num_seqs=16, **options) as llm:
        if tp > 1:
            line = llm.engine.parts.describe["all_reduce"]
            dtype = llm.engine.parts.config.dtype
            if "all_reduce" in options:
                assert line.startswith(options["all_reduce"]), line
            elif flashinfer and dtype in ("bfloat16", "float16"):
                assert line.startswith("flashinfer"), line
            elif first and dtype != "float16":
                assert line.startswith("symm-mem"), line
            else:
                assert line.startswith("nccl"), line
        outs = llm.generate(PROMPTS, PARAMS) if prompts is None else [llm.generate([p], PARAMS)[0] for p in prompts]
        decoder = llm.engine.decoder
        runner = decoder.target if hasattr(decoder, "target") else decoder.runner  # speculative: the target's
        exchange = getattr(getattr(runner.model, "parallel", None), "exchange", None)
        PUSHES["last"] = None if exchange is None else exchange.pushes
        if tp > 1:  # the engine's line says whether one-token steps' sums are pushed
            assert ("pushed by the row-parallel GEMVs" in line) == (exchange is not None), line
    tokens = [o.outputs[0].token_ids for o in outs]
    logprobs = [[lp[t] for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in outs]
    return tokens, logprobs, [[margin(top) for top in o.outputs[0].logprobs] for o in outs]


def margin(top: dict) -> float:
    """How far a position's greedy token's logprob is above the runner-up's."""
    best = sorted(top.values(), reverse=True)
    return best[0] - best[1]


def assert_same_until_a_near_tie(got, ref, tol=5e-2):
    """Greedy tokens as tp 1's up to the end, or up to a position where tp 1's token led the runner-up
    by less than `tol` (within bf16's error: tp 2 sums rounded halves, and the fused all-reduce adds
    and normalises in fp32), and logprobs within `tol` up to there."""
    for i, (tokens, lps, ref_tokens, ref_lps, ref_margins) in enumerate(zip(*got[:2], *ref)):
        n = next((j for j, (a, b) in enumerate(zip(tokens, ref_tokens)) if a != b), len(ref_tokens))
        if n < len(ref_tokens):
            assert ref_margins[n] < tol, (
                f"prompt {i}: token {n} is {tokens[n]}, tp 1's {ref_tokens[n]} led the "
                f"runner-up by {ref_margins[n]:.3f}"
            )
        stop = min(n + 1, len(ref_tokens))
        torch.testing.assert_close(torch.tensor(lps[:stop]), torch.tensor(ref_lps[:stop]), atol=tol, rtol=0)


def _skip_without_fp8_kernels() -> None:
    from infer.plugins.layer.fp8_fused import CAPS

    reason = CAPS.available()
    if reason is not None:
        pytest.skip(reason)


def plain_and_speculative(folder, tmp_path, prompts, **options):
    """tp 2's plain decoding of `prompts`, then its speculative decoding with a one-layer draft of the
    same shape (K = 3)."""
    draft = tmp_path / "draft"
    draft.mkdir()
    (draft / "config.json").write_text(json.dumps({**SHAPE, "num_hidden_layers": 1}))
    plain = generate(folder, 2, prompts, **options)
    return plain, generate(
        folder, 2, prompts, decoding="speculative", draft=str(draft), num_speculative_tokens=3, **options
    )


def _available(name):
    from infer.core.registry import PluginRegistry

    registry = PluginRegistry.load()
    return name in registry.names("attention") and registry.get("attention", name).unavailable_reason() is None


@pytest.mark.parametrize("cuda_graphs", [True, False])
@pytest.mark.parametrize("attention", ["paged-cuda", "torch"])
def test_tp2_matches_tp1_fp32(shape_dir, attention, cuda_graphs):
    if not _available(attention):
        pytest.skip(f"{attention} cannot run here")
    options = dict(attention=attention, dtype="float32", cuda_graphs=cuda_graphs)
    ref_tokens, ref_lps, _ = reference(shape_dir, **options)
    tokens, lps, _ = generate(shape_dir, 2, **options)
    assert tokens == ref_tokens
    for a, b in zip(lps, ref_lps):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-3, rtol=0)


def test_tp2_with_nccl_all_reduce_matches_tp1(shape_dir):
    options = dict(attention="paged-cuda", dtype="float32", cuda_graphs=True)
    ref_tokens, ref_lps, _ = reference(shape_dir, **options)
    tokens, lps, _ = generate(shape_dir, 2, all_reduce="nccl", **options)
    assert tokens == ref_tokens
    for a, b in zip(lps, ref_lps):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-3, rtol=0)


@pytest.mark.parametrize(
    "attention,prefill,all_reduce",
    [
        ("paged-cuda", None, "auto"),
        ("flashinfer", None, "auto"),
        ("paged-cuda", "xformers", "auto"),
        ("paged-cuda", None, "flashinfer"),
    ],
)
def test_tp2_matches_tp1_bf16_with_graphs(shape_dir, attention, prefill, all_reduce):
    for name in filter(None, (attention, prefill, "flashinfer" if all_reduce == "flashinfer" else None)):
        if not _available(name):
            pytest.skip(f"{name} cannot run here")
    options = dict(attention=attention, prefill_attention=prefill, dtype="bfloat16", cuda_graphs=True)
    ref = reference(shape_dir, **options)
    try:
        got = generate(shape_dir, 2, **({"all_reduce": all_reduce} if all_reduce != "auto" else {}), **options)
    except WorkerError as exc:  # a rank's own plugin check (xformers built for another torch, say)
        if "cannot run here" in str(exc):
            pytest.skip(str(exc)[:300])
        raise
    assert_same_until_a_near_tie(got, ref)


@pytest.mark.parametrize("dtype,cuda_graphs", [("bfloat16", True), ("float32", False)])
def test_fp8_tp2_matches_tp1(shape_dir, dtype, cuda_graphs, tol=1e-1):
    """FP8 weights (the same dummy weights quantized at load) in the CUDA kernels at tp 2: the row-parallel
    shards quantize their own columns of x per row (in the quantizing and SiLU-and-mul kernels, as at tp 1),
    one-token steps through the FP8 GEMV and several rows through the FP8 GEMM. Greedy tokens as tp 1's up
    to a near tie: each rank's activations are rounded to e4m3 with their own scale, which moves this
    shape's logprobs by up to 0.06 in float32 (measured with the plain-torch layer on CPU ranks), and tp 2
    sums rounded partial products."""
    _skip_without_fp8_kernels()
    options = dict(attention="paged-cuda", dtype=dtype, cuda_graphs=cuda_graphs, quantization="fp8")
    ref = reference(shape_dir, **options)
    got = generate(shape_dir, 2, **options)
    assert_same_until_a_near_tie(got, ref, tol)
    one_at_a_time = generate(shape_dir, 2, [PROMPTS[1], PROMPTS[4]], **options)  # one-row steps: the GEMV
    assert_same_until_a_near_tie(one_at_a_time, [[column[i] for i in (1, 4)] for column in ref], tol)


def test_fp8_tp2_speculative_is_lossless(shape_dir, tmp_path):
    """FP8 weights at tp 2 with a one-layer FP8 draft: verify steps (K + 1 rows through the FP8 GEMM)
    give plain tp 2 decoding's greedy tokens (one row through the GEMV), up to a near tie."""
    _skip_without_fp8_kernels()
    options = dict(attention="paged-cuda", dtype="bfloat16", cuda_graphs=True, quantization="fp8")
    plain, spec = plain_and_speculative(shape_dir, tmp_path, [PROMPTS[1], PROMPTS[3]], **options)
    assert_same_until_a_near_tie(spec, plain, 1e-1)


def test_tp2_with_pdl_matches_tp1(shape_dir, monkeypatch):
    """PDL (on by default on Hopper): the Triton kernels and FlashInfer's all-reduce launched as
    programmatic dependents, in every rank's CUDA graphs; the tokens of plain launches (INFER_PDL=0)."""
    from infer.kernels import pdl, triton_pdl

    if not _available("flashinfer") or torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("needs flashinfer and a GPU of compute capability 9.0 or newer")
    options = dict(attention="paged-cuda", dtype="bfloat16", cuda_graphs=True, all_reduce="flashinfer")
    runs = {}
    try:
        for setting in ("0", "1"):
            monkeypatch.setenv("INFER_PDL", setting)  # rank 0 reads it again; the spawned ranks inherit it
            pdl.reset()
            assert triton_pdl.use_pdl(torch.device("cuda", 0)) == (setting == "1")
            runs[setting], _, _ = generate(shape_dir, 2, **options)
    finally:
        monkeypatch.delenv("INFER_PDL")
        pdl.reset()
    assert runs["1"] == runs["0"]


@pytest.mark.parametrize("cuda_graphs", [True, False])
def test_tp2_one_token_steps_push_their_partial_sums(shape_dir, monkeypatch, cuda_graphs):
    """One sequence at a time at tp 2 with FlashInfer's all-reduce: the row-parallel GEMVs push their
    partial sums into the ranks' exchange (infer.distributed.all_reduce.lamport); greedy tokens as tp 1's and as the
    all-reduce's (INFER_GEMV_PUSH=0), up to a near tie."""
    if not _available("flashinfer"):
        pytest.skip("needs flashinfer")
    options = dict(attention="paged-cuda", dtype="bfloat16", cuda_graphs=cuda_graphs, all_reduce="flashinfer")
    prompts = [PROMPTS[0], PROMPTS[3], PROMPTS[4]]
    ref = generate(shape_dir, 1, prompts, **options)
    pushed = generate(shape_dir, 2, prompts, **options)
    assert PUSHES["last"] > 0
    monkeypatch.setenv("INFER_GEMV_PUSH", "0")  # the spawned ranks inherit it
    reduced = generate(shape_dir, 2, prompts, **options)
    assert PUSHES["last"] is None
    assert_same_until_a_near_tie(pushed, ref)
    assert_same_until_a_near_tie(reduced, ref)
    assert_same_until_a_near_tie(pushed, reduced)


def test_tp2_speculative_with_pushed_sums_is_lossless(shape_dir, tmp_path):
    """Speculative decoding at tp 2 with a separate one-layer draft: the draft's one-token steps push
    their sums into the same exchange as the target's, whose verify steps (K + 1 tokens) take the
    all-reduce; greedy tokens as plain decoding's at tp 2, up to a near tie (the two sum in another order)."""
    if not _available("flashinfer"):
        pytest.skip("needs flashinfer")
    options = dict(attention="paged-cuda", dtype="bfloat16", cuda_graphs=True, all_reduce="flashinfer")
    plain, spec = plain_and_speculative(shape_dir, tmp_path, [PROMPTS[1], PROMPTS[3]], **options)
    assert PUSHES["last"] > 0
    assert_same_until_a_near_tie(spec, plain)


def test_tp2_pipelined_decode_matches_tp1(shape_dir):
    # no logprobs, so decode steps are pipelined: rank 1 takes each step's ids from rank 0's GPU
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    options = dict(model=str(shape_dir), load_format="dummy", attention="paged-cuda", dtype="float32", max_num_seqs=16)
    with LLM(tensor_parallel_size=1, pipeline_decode=False, **options) as llm:
        expected = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    with LLM(tensor_parallel_size=2, pipeline_decode=True, **options) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
        assert llm.engine.decoder.runner.pipeline.hits > 0
    assert got == expected


def test_tp2_engines_with_graphs_close_promptly(shape_dir):
    """NCCL's teardown waits for every CUDA graph that captured one of its collectives: each rank
    destroys its graphs first, so a closed engine's ranks exit and the next engine can start."""
    import time

    for _ in range(2):  # the second engine in this process needs the first one's group gone
        llm = LLM(model=str(shape_dir), load_format="dummy", tensor_parallel_size=2, max_num_seqs=16, cuda_graphs=True)
        assert len(llm.generate(PROMPTS[:2], PARAMS)) == 2
        started = time.monotonic()
        llm.close()
        assert time.monotonic() - started < 60, "closing a tp2 engine with CUDA graphs took over a minute"
        assert not torch.distributed.is_initialized()
