"""`paged-cuda` over an FP8 KV cache at small shapes (on the CPU under Triton's interpreter, compiled on
a GPU): its cache write stores the bytes the `torch` backend stores, its decode and prefill kernels
read them as the `torch` backend does (fp32 tolerance), and both stay within FP8's error of attention
over the unquantized K/V."""

import functools
import os

import pytest
import torch

if not torch.cuda.is_available():
    # Before triton is imported anywhere in this process: kernels defined afterwards are interpreted.
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

import triton
import triton.language as tl

from infer.api.kv_cache import FP8, FP8KVCache, quantize_fp8
from infer.api.rope import Rope
from infer.plugins.attention.paged_cuda import PagedCudaAttention
from infer.plugins.attention.paged_cuda.kernels.fp8 import quantize
from infer.plugins.attention.torch_backend import TorchAttention
from infer.testing.attention import BATCH_SPECS, BatchSpec, check_backend, make_case, naive_attention

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
    reason="TRITON_INTERPRET was set to something else before this module, and there is no GPU",
)
DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
HEADS = {"mha": (4, 4), "gqa": (4, 2), "mqa": (6, 1)}
SCALES = (0.37, 2.5)  # neither a power of two: a scale applied twice, or not at all, shows
LONG_DECODE = BatchSpec("decode-long", (1, 1, 1), (200, 75, 3))
SPLIT = dict(max_splits=8, decode_block_n=16)


def fp8_case(batch_spec, heads=HEADS["gqa"], **kwargs):
    return make_case(batch_spec, *heads, device=DEVICE, kv_cache_dtype=FP8, kv_scales=SCALES, **kwargs)


def run(backend, case, window=None):
    backend.plan(case.batch)
    return backend.forward(case.q, case.k, case.v, case.kv_cache, **({} if window is None else {"window": window}))


@triton.jit
def _quantize_kernel(x_ptr, out_ptr, scale_inv, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(out_ptr + offs, quantize(tl.load(x_ptr + offs), scale_inv, out_ptr.dtype.element_ty))


def test_quantize_kernel_stores_what_torch_stores():
    """Every e4m3 value, the midpoints between neighbours (ties go to the even one), subnormals, values
    past 448 and random ones: the kernels' rounding, bit for bit, even under the interpreter."""
    grid = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    grid = grid[grid.isfinite()].sort().values
    gen = torch.Generator().manual_seed(0)
    values = torch.cat(
        [
            grid,
            (grid[1:] + grid[:-1]) / 2,
            torch.randn(4000, generator=gen) * 3,
            torch.randn(2000, generator=gen) * 0.01,
            torch.tensor([500.0, -1e4, 448.5, 2.0**-10, -(2.0**-11), 0.0]),
        ]
    )
    x = torch.zeros(1 << 14)
    x[: len(values)] = values
    for scale in (1.0, 0.37):
        out = torch.empty(len(x), dtype=FP8, device=DEVICE)
        _quantize_kernel[(1,)](x.to(DEVICE), out, 1.0 / scale, N=len(x))
        expected = quantize_fp8(x, scale)
        assert torch.equal(out.cpu().float(), expected.float()), "the kernel rounds differently from torch"


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
@pytest.mark.parametrize("batch_spec", BATCH_SPECS, ids=lambda s: s.name)
@pytest.mark.parametrize("heads", HEADS.values(), ids=HEADS.keys())
def test_matches_the_torch_backend_on_the_same_quantized_cache(batch_spec, heads):
    """The same FP8 cache and new tokens into both backends: the same bytes written, the same outputs
    within fp32 tolerance."""
    case = fp8_case(batch_spec, heads, seed=7)
    reference = fp8_case(batch_spec, heads, seed=7)
    expected = run(TorchAttention(reference.spec), reference)
    got = run(PagedCudaAttention(case.spec), case)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    for mine, theirs in zip(case.kv_cache, reference.kv_cache):
        assert torch.equal(mine.view(torch.uint8).cpu(), theirs.view(torch.uint8).cpu())


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
@pytest.mark.parametrize("backend_cls", [TorchAttention, PagedCudaAttention], ids=["torch", "paged-cuda"])
@pytest.mark.parametrize("batch_spec", [BATCH_SPECS[1], BATCH_SPECS[3], BATCH_SPECS[5]], ids=lambda s: s.name)
def test_within_fp8_error_of_unquantized_attention(backend_cls, batch_spec):
    """e4m3 keeps 3 mantissa bits: K and V are off by 2-3% (RMS), and so is attention over them."""
    case = fp8_case(batch_spec, seed=4)
    out = run(backend_cls(case.spec), case).float()
    exact = naive_attention(make_case(batch_spec, *HEADS["gqa"], device=DEVICE, seed=4)).to(out.device)
    error = ((out - exact).norm() / exact.norm()).item()
    print(f"{batch_spec.name}: relative error against unquantized K/V {error:.4f}")
    assert 0 < error < 0.05
    torch.testing.assert_close(out, exact, atol=0.2, rtol=0.1)


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
def test_split_decode():
    backend_cls = functools.partial(PagedCudaAttention, **SPLIT)
    case = fp8_case(LONG_DECODE, seed=3)
    backend = backend_cls(case.spec)
    backend.plan(case.batch)
    assert backend._plan.split and backend._plan.splits == 8
    check_backend(backend_cls, case, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("batch_spec", "window", "soft_cap"),
    [(LONG_DECODE, 40, None), (BATCH_SPECS[4], 20, 2.0), (BATCH_SPECS[5], 6, 2.0)],
    ids=["split-decode-window", "extend-window-capped", "mixed-window-capped"],
)
@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
def test_windows_and_soft_caps(batch_spec, window, soft_cap):
    """k_scale folds into the logits before the cap; a window narrows what is read, not how."""
    case = fp8_case(batch_spec, seed=5, window=window, soft_cap=soft_cap)
    check_backend(functools.partial(PagedCudaAttention, **SPLIT), case, atol=1e-5, rtol=1e-5)


def test_bf16_model():
    case = make_case(BATCH_SPECS[-1], dtype=torch.bfloat16, device=DEVICE, seed=2, kv_cache_dtype=FP8, kv_scales=SCALES)
    check_backend(functools.partial(PagedCudaAttention, **SPLIT), case, atol=2e-2, rtol=2e-2)


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
@pytest.mark.parametrize("batch_spec", [BATCH_SPECS[1], BATCH_SPECS[5]], ids=lambda s: s.name)
def test_forward_with_rotary_is_forward_of_the_rotated_heads(batch_spec):
    from infer.kernels.layers import rotary
    from infer.plugins.layer.torch_layers import RotaryEmbedding

    case = fp8_case(batch_spec)
    tables = RotaryEmbedding(Rope.default(case.spec.head_dim, 10000.0), case.spec.max_model_len)
    cos, sin = tables.cos.to(DEVICE), tables.sin.to(DEVICE)
    positions = torch.cat([torch.arange(s - q, s) for q, s in zip(batch_spec.query_lens, case.batch.seq_lens)])
    positions = positions.to(DEVICE)
    plain, fused = PagedCudaAttention(case.spec), PagedCudaAttention(case.spec)
    caches = [FP8KVCache(*(c.clone() for c in case.kv_cache), *SCALES) for _ in range(2)]
    plain.plan(case.batch)
    expected = plain.forward(*rotary(positions, case.q, case.k, cos, sin), case.v, caches[0])
    fused.plan(case.batch)
    got = fused.forward_with_rotary(positions, case.q, case.k, case.v, caches[1], cos, sin)
    torch.testing.assert_close(got, expected, atol=0, rtol=0)
    for a, b in zip(*caches):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_declares_fp8_kv():
    assert PagedCudaAttention.capabilities.fp8_kv and TorchAttention.capabilities.fp8_kv
    assert "fp8-kv" in PagedCudaAttention.capabilities.describe()


def test_e4m3_mma_decode_is_taken_only_where_its_ptx_runs():
    """`decode_e4m3` (PTX, GPU-tested in tests/gpu/test_fp8_kv_gpu.py) never serves an interpreted or CPU
    run; its warps a program fill ~16 warps an SM in 1, 2 or 4 a program."""
    from infer.plugins.attention.paged_cuda.kernels import decode_e4m3

    q = torch.zeros(1, 32, 128, dtype=torch.bfloat16, device=DEVICE)
    cache = torch.zeros(2, 4, 16, 8, 128, dtype=FP8, device=DEVICE)
    assert decode_e4m3.layout_fits(q, cache[0], cache[1], None, None)
    assert not decode_e4m3.fits(q, cache[0], cache[1], None, None)
    assert [decode_e4m3.warps(programs, 132) for programs in (2000, 1056, 1000, 512, 256, 8)] == [1, 2, 2, 4, 4, 4]


@pytest.mark.parametrize(
    "change",
    [
        dict(window=256),
        dict(soft_cap=50.0),
        dict(q=torch.zeros(1, 32, 128)),  # fp32 activations
        dict(q=torch.zeros(1, 32, 64, dtype=torch.bfloat16)),  # head_dim 64
        dict(q=torch.zeros(1, 128, 128, dtype=torch.bfloat16)),  # a GQA group of 16
        dict(q=torch.zeros(1, 32, 129, dtype=torch.bfloat16)[:, :, 1:]),  # q's rows off 16 bytes
        dict(k=torch.zeros(4, 8, 8, 128, dtype=FP8)),  # blocks of 8 tokens
        dict(v=torch.zeros(4 * 16 * 8 * 128 + 1, dtype=FP8)[1:].view(4, 16, 8, 128)),  # V off 16 bytes
        dict(v=torch.zeros(4, 16, 8, 128, dtype=torch.bfloat16)),
    ],
    ids=["window", "soft-cap", "fp32", "head-dim-64", "group-16", "q-misaligned", "block-8", "v-misaligned", "v-bf16"],
)
def test_e4m3_mma_decode_refuses_what_its_lanes_cannot_load(change):
    """`decode_e4m3.layout_fits`, the kernel's Requires: one thing off at a time, the Triton kernel serves."""
    args = dict(
        q=torch.zeros(1, 32, 128, dtype=torch.bfloat16),
        k=torch.zeros(4, 16, 8, 128, dtype=FP8),
        v=torch.zeros(4, 16, 8, 128, dtype=FP8),
        window=None,
        soft_cap=None,
    )
    from infer.plugins.attention.paged_cuda.kernels import decode_e4m3

    assert decode_e4m3.layout_fits(*args.values())
    args.update(change)
    assert not decode_e4m3.layout_fits(*args.values())
