"""The `paged-cuda` Triton kernels at small shapes: on the CPU under Triton's interpreter (how CI
runs them), compiled on the GPU where there is one."""

import functools
import os

import pytest
import torch

if not torch.cuda.is_available():
    # Before triton is imported anywhere in this process: kernels defined afterwards are interpreted.
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from infer.api.rope import Rope
from infer.plugins.attention.paged_cuda import PagedCudaAttention, infer_register_attention_backends
from infer.testing.attention import BATCH_SPECS, BatchSpec, check_backend, make_case, naive_attention

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
    reason="TRITON_INTERPRET was set to something else before this module, and there is no GPU",
)
DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
HEADS = {"mha": (4, 4), "gqa": (4, 2), "mqa": (6, 1)}
LONG_DECODE = BatchSpec("decode-long", (1, 1, 1), (200, 75, 3))  # 8 splits of tiles of 16: 7, 5 and 1 used


def small(**knobs):
    return functools.partial(PagedCudaAttention, **knobs)


@pytest.mark.parametrize("batch_spec", BATCH_SPECS, ids=lambda s: s.name)
@pytest.mark.parametrize("heads", HEADS.values(), ids=HEADS.keys())
@pytest.mark.parametrize("block_size", [16, pytest.param(32, marks=pytest.mark.slow)])  # interpreted Triton
def test_matches_naive(batch_spec, heads, block_size):
    case = make_case(batch_spec, *heads, block_size=block_size, device=DEVICE, seed=7)
    check_backend(PagedCudaAttention, case, atol=1e-5, rtol=1e-5)


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
@pytest.mark.parametrize("batch_spec", BATCH_SPECS[2:], ids=lambda s: s.name)
@pytest.mark.parametrize("heads", HEADS.values(), ids=HEADS.keys())
def test_small_prefill_tiles(batch_spec, heads):
    """Tiles of 16: several query blocks per sequence, and unmasked key tiles before the diagonal."""
    case = make_case(batch_spec, *heads, device=DEVICE, seed=9)
    check_backend(small(prefill_block_m=16, prefill_block_n=16), case, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("heads", HEADS.values(), ids=HEADS.keys())
@pytest.mark.parametrize("block_size", [16, pytest.param(32, marks=pytest.mark.slow)])  # interpreted Triton
def test_split_decode_matches_naive(heads, block_size):
    case = make_case(LONG_DECODE, *heads, block_size=block_size, device=DEVICE, seed=3)
    backend_cls = small(max_splits=8, decode_block_n=16)
    backend = backend_cls(case.spec)
    backend.plan(case.batch)
    assert backend._plan.split and backend._plan.splits == 8
    check_backend(backend_cls, case, atol=1e-5, rtol=1e-5)


def test_mixed_batch_with_split_decode():
    case = make_case(BATCH_SPECS[-1], device=DEVICE, seed=11)  # decodes then prefill/extend
    check_backend(small(max_splits=4, decode_block_n=16), case, atol=1e-5, rtol=1e-5)


def test_unsplit_decode_when_batch_fills_gpu():
    case = make_case(LONG_DECODE, device=DEVICE, seed=5)
    backend_cls = small(max_splits=8, decode_block_n=32, split_below_programs=1)
    backend = backend_cls(case.spec)
    backend.plan(case.batch)
    assert not backend._plan.split
    check_backend(backend_cls, case, atol=1e-5, rtol=1e-5)


def test_bf16():
    case = make_case(BATCH_SPECS[-1], dtype=torch.bfloat16, device=DEVICE, seed=2)
    check_backend(small(max_splits=4, decode_block_n=16), case, atol=2e-2, rtol=2e-2)


def test_split_count_depends_on_batch_size_only():
    case = make_case(LONG_DECODE, *HEADS["gqa"], device=DEVICE, seed=3)
    backend = PagedCudaAttention(case.spec, split_programs=64, max_splits=16, decode_block_n=16)
    # 2 KV heads: 1 sequence -> 32 splits, capped at 16; 3 -> cdiv(64, 6) = 11; filling the GPU -> 1
    assert [backend.num_splits(b) for b in (1, 3)] == [16, 11]
    assert backend.num_splits(backend.split_below_programs) == 1


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
def test_decode_is_replayable_on_new_lengths():
    """One backend, its split-K scratch reused for other lengths: stale partitions are never read."""
    case = make_case(LONG_DECODE, device=DEVICE, seed=13)
    backend = PagedCudaAttention(case.spec, max_splits=8, decode_block_n=16)
    backend.plan(case.batch)
    backend.forward(case.q, case.k, case.v, case.kv_cache)
    shorter = make_case(BatchSpec("decode-short", (1, 1, 1), (40, 120, 9)), device=DEVICE, seed=14)
    backend.plan(shorter.batch)
    out = backend.forward(shorter.q, shorter.k, shorter.v, shorter.kv_cache)
    torch.testing.assert_close(out, naive_attention(shorter), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cache_write(dtype):
    from infer.plugins.attention.paged_cuda.kernels.cache_write import cache_write

    gen = torch.Generator().manual_seed(0)
    num_blocks, block_size, kv_heads, head_dim, tokens = 6, 16, 3, 24, 21  # non-power-of-2 heads and dim
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype=dtype, device=DEVICE)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype=dtype, device=DEVICE)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    qkv = torch.randn(tokens, 3, kv_heads, head_dim, generator=gen).to(dtype=dtype, device=DEVICE)
    k, v = qkv[:, 1], qkv[:, 2]  # strided views of a fused qkv, as a model hands them over
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens].to(DEVICE)
    cache_write(k, v, k_cache, v_cache, slots)
    expected_k.view(-1, kv_heads, head_dim)[slots] = k
    expected_v.view(-1, kv_heads, head_dim)[slots] = v
    torch.testing.assert_close(k_cache, expected_k, atol=0, rtol=0)  # untouched slots too
    torch.testing.assert_close(v_cache, expected_v, atol=0, rtol=0)


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [(4, 2), (6, 3), (1, 1)])
def test_rotary_cache_write_is_the_rotary_layer_then_cache_write(dtype, heads):
    from infer.kernels.layers import rotary
    from infer.plugins.attention.paged_cuda.kernels.cache_write import cache_write, rotary_cache_write
    from infer.plugins.layer.torch_layers import RotaryEmbedding

    gen = torch.Generator().manual_seed(0)
    (num_q, num_kv), head_dim, num_blocks, block_size, tokens = heads, 32, 5, 16, 9
    tables = RotaryEmbedding(Rope.default(head_dim, 10000.0), 128)
    cos, sin = tables.cos.to(DEVICE), tables.sin.to(DEVICE)
    qkv = torch.randn(tokens, (num_q + 2 * num_kv) * head_dim, generator=gen).to(dtype=dtype, device=DEVICE)
    q, k, v = (
        x.view(tokens, -1, head_dim) for x in qkv.split([num_q * head_dim, num_kv * head_dim, num_kv * head_dim], -1)
    )
    positions = torch.randint(0, 128, (tokens,), generator=gen).to(DEVICE)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens].to(DEVICE)
    caches = [
        torch.randn(num_blocks, block_size, num_kv, head_dim, generator=gen).to(dtype=dtype, device=DEVICE)
        for _ in range(2)
    ]
    expected_caches = [c.clone() for c in caches]
    expected_q, rotated_k = rotary(positions, q, k, cos, sin)
    cache_write(rotated_k, v, *expected_caches, slots)
    got_q = rotary_cache_write(positions, q, k, v, cos, sin, *caches, slots)
    torch.testing.assert_close(got_q, expected_q, atol=0, rtol=0)
    for got, expected in zip(caches, expected_caches):  # every slot, written or not
        torch.testing.assert_close(got, expected, atol=0, rtol=0)


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
@pytest.mark.parametrize("batch_spec", [BATCH_SPECS[1], BATCH_SPECS[5]], ids=lambda s: s.name)
def test_forward_with_rotary_is_forward_of_the_rotated_heads(batch_spec):
    from infer.kernels.layers import rotary
    from infer.plugins.layer.torch_layers import RotaryEmbedding

    case = make_case(batch_spec, device=DEVICE)
    tables = RotaryEmbedding(Rope.default(case.spec.head_dim, 10000.0), case.spec.max_model_len)
    cos, sin = tables.cos.to(DEVICE), tables.sin.to(DEVICE)
    positions = torch.cat([torch.arange(s - q, s) for q, s in zip(batch_spec.query_lens, case.batch.seq_lens)]).to(
        DEVICE
    )
    plain, fused = PagedCudaAttention(case.spec), PagedCudaAttention(case.spec)
    assert fused.fuses_rotary()
    caches = [tuple(c.clone() for c in case.kv_cache) for _ in range(2)]
    plain.plan(case.batch)
    expected = plain.forward(*rotary(positions, case.q, case.k, cos, sin), case.v, caches[0])
    fused.plan(case.batch)
    got = fused.forward_with_rotary(positions, case.q, case.k, case.v, caches[1], cos, sin)
    torch.testing.assert_close(got, expected, atol=0, rtol=0)
    for a, b in zip(*caches):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_rotary_fuses_only_for_power_of_two_halves():
    from infer.plugins.attention.paged_cuda.kernels.cache_write import fits

    assert fits(64) and fits(128) and fits(2)
    assert not fits(96) and not fits(80) and not fits(0)


def test_available_and_registered():
    assert PagedCudaAttention.capabilities.available() is None
    assert PagedCudaAttention.capabilities.sliding_window and PagedCudaAttention.capabilities.soft_cap
    registered = {}
    infer_register_attention_backends(lambda name, factory: registered.setdefault(name, factory))
    assert registered == {"paged-cuda": PagedCudaAttention}


SPLIT = dict(max_splits=8, decode_block_n=16)
SMALL_TILES = dict(prefill_block_m=64, prefill_block_n=16)  # 32 queries a block, keys in tiles of 16
WINDOW_CASES = {  # name -> (batch spec, heads, window, soft cap, backend knobs)
    "decode-within-a-block": (BATCH_SPECS[1], HEADS["gqa"], 5, None, {}),
    "split-decode-across-blocks": (LONG_DECODE, HEADS["gqa"], 40, None, SPLIT),
    # a tile's rows can see none of its keys: a window of 7 and 32 queries against 16 keys
    "prefill-small-tiles": (BATCH_SPECS[3], HEADS["gqa"], 7, None, SMALL_TILES),
    "extend-capped": (BATCH_SPECS[4], HEADS["mha"], 20, 2.0, {}),
    "mixed-longer-than-every-sequence": (BATCH_SPECS[5], HEADS["mqa"], 100, None, SPLIT),
    "mixed-capped": (BATCH_SPECS[5], HEADS["gqa"], 6, 2.0, {**SPLIT, **SMALL_TILES}),
    "mixed-capped-no-window": (BATCH_SPECS[5], HEADS["gqa"], None, 2.0, SPLIT),
}


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
@pytest.mark.parametrize("name", WINDOW_CASES)
def test_sliding_window_and_soft_cap_match_naive(name):
    batch_spec, heads, window, soft_cap, knobs = WINDOW_CASES[name]
    case = make_case(batch_spec, *heads, device=DEVICE, seed=17, window=window, soft_cap=soft_cap)
    if "max_splits" in knobs:  # the split decode kernel and its reduce see the window too
        backend = PagedCudaAttention(case.spec, **knobs)
        backend.plan(case.batch)
        assert backend._plan.split
    check_backend(small(**knobs), case, atol=1e-5, rtol=1e-5)


def _poison_outside_windows(case) -> int:
    """NaN into every cached block that lies wholly before each sequence's first query's window (a kernel
    that reads such a block and masks it gets NaN from 0 * NaN in P @ V); returns how many there are."""
    bs, poisoned = case.spec.block_size, 0
    for q_len, seq_len, table in zip(case.batch.query_lens, case.batch.seq_lens, case.batch.block_tables):
        oldest_seen = max(seq_len - q_len - case.window + 1, 0)
        for block in table[: oldest_seen // bs]:
            for cache in case.kv_cache:
                cache[block] = float("nan")
            poisoned += 1
    return poisoned


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
@pytest.mark.parametrize("split", [False, True], ids=["unsplit", "split"])
def test_blocks_outside_the_window_are_never_read(split):
    spec = BatchSpec("long", (1, 1, 20), (90, 47, 60))  # two decodes and an extend
    case = make_case(spec, block_size=8, device=DEVICE, seed=19, window=12)
    assert _poison_outside_windows(case) == 9 + 4 + 6
    knobs = SPLIT if split else dict(split_below_programs=1)
    backend = PagedCudaAttention(case.spec, **knobs)
    backend.plan(case.batch)
    assert backend._plan.split == split
    check_backend(small(**knobs), case, atol=1e-5, rtol=1e-5)


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
def test_forward_with_rotary_takes_the_window():
    from infer.kernels.layers import rotary
    from infer.plugins.layer.torch_layers import RotaryEmbedding

    case = make_case(BATCH_SPECS[5], device=DEVICE, window=6, soft_cap=2.0)
    tables = RotaryEmbedding(Rope.default(case.spec.head_dim, 10000.0), case.spec.max_model_len)
    cos, sin = tables.cos.to(DEVICE), tables.sin.to(DEVICE)
    positions = case.batch.positions
    plain, fused = PagedCudaAttention(case.spec), PagedCudaAttention(case.spec)
    caches = [tuple(c.clone() for c in case.kv_cache) for _ in range(2)]
    plain.plan(case.batch)
    expected = plain.forward(*rotary(positions, case.q, case.k, cos, sin), case.v, caches[0], window=6)
    fused.plan(case.batch)
    got = fused.forward_with_rotary(positions, case.q, case.k, case.v, caches[1], cos, sin, window=6)
    torch.testing.assert_close(got, expected, atol=0, rtol=0)
    unwindowed = plain.forward(*rotary(positions, case.q, case.k, cos, sin), case.v, caches[0])
    assert not torch.allclose(unwindowed, expected)  # the window reached the kernels
