"""The FP8 KV cache compiled on a GPU (compute capability 8.9 or newer), at real shapes: `paged-cuda`
(and FlashInfer, where it is installed) against the `torch` backend's FP8 path on the same quantized
cache, against the oracle over the dequantized values, within FP8's error of unquantized attention,
under CUDA graph replay, and end to end. Run: `pytest -m gpu tests/gpu/test_fp8_kv_gpu.py`.
"""

import os

import pytest
import torch

from infer import SamplingParams
from infer.api.kv_cache import FP8KVCache
from infer.llm import LLM
from infer.plugins.attention.torch_backend import TorchAttention
from infer.testing.agreement import prefix_agreement
from infer.testing.attention import check_backend, naive_attention, quantized

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="TRITON_INTERPRET=1 interprets the kernels"),
    pytest.mark.skipif(
        torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9), reason="e4m3 needs sm_89+"
    ),
]
pytest.importorskip("triton")

from test_paged_cuda_gpu import BATCHES, HEADS, MAX_MODEL_LEN, paged_case, replayed  # noqa: E402  (tests/gpu, on sys.path)

SCALES = (0.37, 2.5)
TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 5e-3, torch.float32: 1e-4}


def fp8_case(batch_name, heads, block_size, dtype, seed=0, num_blocks=None):
    return quantized(paged_case(*BATCHES[batch_name], *heads, block_size, dtype, seed, num_blocks), SCALES)


def run(backend_cls, case):
    backend = backend_cls(case.spec)
    backend.plan(case.batch)
    return backend.forward(case.q, case.k, case.v, case.kv_cache)


@pytest.mark.parametrize("batch_name", BATCHES)
@pytest.mark.parametrize("heads", HEADS.values(), ids=HEADS.keys())
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("dtype", TOLERANCE, ids=lambda d: str(d).removeprefix("torch."))
def test_paged_cuda_matches_the_torch_backend(batch_name, heads, block_size, dtype):
    """The same FP8 cache into both: the same bytes written; outputs within the dtype's tolerance (the
    oracle over the dequantized values checks the written slots too)."""
    from infer.plugins.attention.paged_cuda import PagedCudaAttention

    case, reference = (fp8_case(batch_name, heads, block_size, dtype) for _ in range(2))
    got, expected = run(PagedCudaAttention, case), run(TorchAttention, reference)
    torch.testing.assert_close(got.float(), expected.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
    for mine, theirs in zip(case.kv_cache, reference.kv_cache):
        assert torch.equal(mine.view(torch.uint8), theirs.view(torch.uint8))
    check_backend(
        PagedCudaAttention, fp8_case(batch_name, heads, block_size, dtype), TOLERANCE[dtype], TOLERANCE[dtype]
    )


@pytest.mark.parametrize("batch_name", ["decode-64-to-4096", "prefill-varlen", "mixed-60-decode"])
def test_within_fp8_error_of_unquantized_attention(batch_name):
    from infer.plugins.attention.paged_cuda import PagedCudaAttention

    exact = paged_case(*BATCHES[batch_name], *HEADS["gqa"], 16, torch.bfloat16)
    out = run(PagedCudaAttention, quantized(exact, SCALES)).float()
    expected = naive_attention(exact)
    error = ((out - expected).norm() / expected.norm()).item()
    print(f"{batch_name}: relative error against unquantized K/V {error:.4f}")
    assert error < 0.05


def test_decode_cuda_graph_replay():
    num_blocks = 8 * (-(-MAX_MODEL_LEN // 16)) + 8
    lens = [(100, 4000, 1, 2047, 513, 16, 3000, 64), (4095, 7, 900, 31, 2500, 1024, 0, 333)]
    first, second = (
        quantized(paged_case((1,) * 8, c, *HEADS["gqa"], 16, torch.bfloat16, seed, num_blocks), SCALES)
        for seed, c in zip((2, 3), lens)
    )
    _, out = replayed(first, second)
    assert isinstance(first.kv_cache, FP8KVCache)
    torch.testing.assert_close(out.float(), naive_attention(second), atol=2e-2, rtol=2e-2)


_MMA_CONTEXTS = tuple(range(16)) + (16, 31, 99, 510, 999, 4094, 255, 777, 2048, 3000, 63)  # last steps of 1-16 tokens


@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("heads", [(32, 8), (32, 32), (28, 4), (16, 2)], ids=["gqa4", "mha", "gqa7", "gqa8"])
@pytest.mark.parametrize("warps", [1, 2, 4])
def test_e4m3_mma_decode_matches_the_decode_kernel(warps, heads, block_size, dtype, splits):
    """`decode_e4m3` (K and V loaded into MMA registers by PTX) against `decode`'s Triton kernel on the same
    FP8 cache: sequences whose last step holds each of 1-16 tokens (the rest masked), 1-4 warps a
    program (warps with no token in a step), groups of 1, 4, 7 and 8 heads, whole and split contexts."""
    from infer.plugins.attention.paged_cuda.kernels import decode, decode_e4m3

    case = quantized(paged_case((1,) * len(_MMA_CONTEXTS), _MMA_CONTEXTS, *heads, block_size, dtype), SCALES)
    k_cache, v_cache = case.kv_cache
    assert decode_e4m3.fits(case.q, k_cache, v_cache, None, None)
    num_seqs, num_heads = len(_MMA_CONTEXTS), heads[0]

    def attend(kernel, **kwargs):
        out = torch.full_like(case.q, float("nan"))
        scratch = None
        if splits > 1:
            scratch = (
                torch.empty(num_seqs, num_heads, splits, 128, device="cuda"),
                torch.empty(num_seqs, num_heads, splits, device="cuda"),
                torch.empty(num_seqs, num_heads, splits, device="cuda"),
            )
        args = (case.batch.block_tables_t, case.batch.seq_lens_t, case.spec.scale, num_seqs, scratch, 64)
        kernel(out, case.q, k_cache, v_cache, *args, scales=SCALES, **kwargs)
        return out

    got = attend(decode_e4m3.paged_decode_e4m3, num_warps=warps)
    expected = attend(decode.paged_decode)
    tolerance = TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), expected.float(), atol=tolerance, rtol=tolerance)


def test_backend_takes_the_e4m3_mma_decode_under_graph_replay(monkeypatch):
    """An unsplit FP8 decode batch (64 sequences x 8 KV heads) goes to `decode_e4m3`, captured in a CUDA
    graph and replayed over other contexts; a sliding window keeps the Triton kernel."""
    from infer.plugins.attention.paged_cuda.kernels import decode_e4m3

    calls = []
    launch = decode_e4m3.paged_decode_e4m3
    monkeypatch.setattr(decode_e4m3, "paged_decode_e4m3", lambda *a, **k: calls.append(k) or launch(*a, **k))
    rng = torch.Generator().manual_seed(5)
    lens = [tuple(torch.randint(0, 4000, (64,), generator=rng).tolist()) for _ in range(2)]
    num_blocks = 64 * (-(-MAX_MODEL_LEN // 16)) + 8
    first, second = (
        quantized(paged_case((1,) * 64, c, *HEADS["gqa"], 16, torch.bfloat16, seed, num_blocks), SCALES)
        for seed, c in zip((2, 3), lens)
    )
    backend, out = replayed(first, second)
    # the compiling call and the captured one
    assert [k["num_warps"] for k in calls] == [decode_e4m3.warps(64 * 8, backend.num_sms)] * 2
    torch.testing.assert_close(out.float(), naive_attention(second), atol=2e-2, rtol=2e-2)
    kv_cache = first.kv_cache
    assert not decode_e4m3.fits(first.q, kv_cache[0], kv_cache[1], 256, None)
    assert not decode_e4m3.fits(first.q, kv_cache[0], kv_cache[1], None, 50.0)


@pytest.mark.parametrize("batch_name", ["decode-64-to-4096", "extend-chunked-spec", "mixed-60-decode"])
def test_flashinfer_matches_the_torch_backend(batch_name):
    pytest.importorskip("flashinfer")
    from infer.plugins.attention.flashinfer_backend import FlashInferAttention

    case, reference = (fp8_case(batch_name, HEADS["gqa"], 16, torch.bfloat16) for _ in range(2))
    got, expected = run(FlashInferAttention, case), run(TorchAttention, reference)
    torch.testing.assert_close(got.float(), expected.float(), atol=2e-2, rtol=2e-2)


def _greedy(**opts):
    llm = LLM(model="smollm2-135m", load_format="dummy", max_model_len=2048, max_num_batched_tokens=1024, **opts)
    prompts = [[(37 * i + 11 * j) % 40000 + 10 for j in range(n)] for i, n in enumerate((1, 7, 33, 200, 700, 1100))]
    outs = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    blocks = llm.engine.parts.describe["kv_blocks"]
    llm.close()
    return [o.outputs[0].token_ids for o in outs], blocks


@pytest.mark.parametrize("cuda_graphs", [False, True])
def test_engine_paged_cuda_fp8_follows_the_torch_backends_fp8(cuda_graphs):
    """fp32 dummy weights: both backends read the same quantized cache, so greedy tokens agree."""
    expected, _ = _greedy(attention="torch", dtype="float32", kv_cache_dtype="fp8", cuda_graphs=False)
    got, _ = _greedy(attention="paged-cuda", dtype="float32", kv_cache_dtype="fp8", cuda_graphs=cuda_graphs)
    agreement = prefix_agreement(expected, got)
    print(f"paged-cuda fp8 against torch fp8: {agreement:.1%}")
    assert agreement >= 0.9


def test_engine_fp8_holds_twice_the_blocks():
    budget = dict(attention="paged-cuda", kv_cache_memory_gib=0.25, cuda_graphs=False)
    bf16, fp8 = (_greedy(kv_cache_dtype=kv, **budget) for kv in ("auto", "fp8"))
    print(f"0.25 GiB: {bf16[1]} bf16 blocks, {fp8[1]} fp8; greedy agreement {prefix_agreement(bf16[0], fp8[0]):.1%}")
    assert fp8[1] // 2 == bf16[1]  # floor(2 x budget / bytes): one more where the halves' remainders add up
