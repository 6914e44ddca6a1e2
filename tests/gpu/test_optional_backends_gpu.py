"""`flashinfer` and `xformers` on a GPU against the naive oracle: the named batch specs (permuted block
tables) at small shapes and at Llama shapes (GQA 32/8, head_dim 128), fp16 and bf16, KV blocks of 16;
xformers as the prefill half of `HybridAttention(xformers, torch)`; flashinfer's decode step captured
in a CUDA graph and replayed on new data. Run: `pytest -m gpu tests/gpu`. FlashInfer JIT-compiles
its decode and prefill kernels once per dtype on first use (about a minute each time, cached).
"""

from __future__ import annotations

import functools
import importlib

import pytest
import torch

from infer.api import AttentionSpec
from infer.plugins.attention.torch_backend import TorchAttention
from infer.runtime.hybrid_attention import HybridAttention
from infer.testing.attention import BATCH_SPECS, AttentionCase, BatchSpec, check_backend, make_case, naive_attention

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

TOLERANCE = {torch.float16: 5e-3, torch.bfloat16: 2e-2}
DTYPES = pytest.mark.parametrize("dtype", TOLERANCE, ids=lambda d: str(d).removeprefix("torch."))
SPECS = pytest.mark.parametrize("batch_spec", BATCH_SPECS, ids=lambda s: s.name)
HEADS = {"gqa-4-2": (4, 2, 128), "mha-4": (4, 4, 128), "gqa-32-8": (32, 8, 128)}  # (H, Hkv, D)
XFORMERS_HEADS = {**HEADS, "mha-4-d64": (4, 4, 64)}
BLOCK_SIZE = 16


def _runnable(library: str, plugin: str):
    pytest.importorskip(library)
    module = importlib.import_module(f"infer.plugins.attention.{plugin}")
    reason = module._available()  # with tests/gpu/conftest.py's xformers workaround applied
    if reason:
        pytest.skip(reason)
    return module


@pytest.fixture(scope="module")
def flashinfer_cls():
    return _runnable("flashinfer", "flashinfer_backend").FlashInferAttention


@pytest.fixture(scope="module")
def xformers_cls():
    return _runnable("xformers", "xformers_backend").XformersAttention


def _case(batch_spec: BatchSpec, heads: tuple[int, int, int], dtype: torch.dtype, seed: int = 0, **kw) -> AttentionCase:
    num_heads, num_kv_heads, head_dim = heads
    return make_case(
        batch_spec,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=BLOCK_SIZE,
        dtype=dtype,
        device="cuda",
        seed=seed,
        **kw,
    )


@SPECS
@pytest.mark.parametrize("heads", HEADS.values(), ids=HEADS.keys())
@DTYPES
def test_flashinfer_matches_naive(flashinfer_cls, batch_spec, heads, dtype):
    case = _case(batch_spec, heads, dtype, seed=1)
    check_backend(flashinfer_cls, case, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("batch_spec", BATCH_SPECS[:2], ids=lambda s: s.name)
@DTYPES
def test_flashinfer_eager_decode_matches_naive(flashinfer_cls, batch_spec, dtype):
    case = _case(batch_spec, HEADS["gqa-32-8"], dtype, seed=2)
    backend_cls = functools.partial(flashinfer_cls, cuda_graph=False)
    check_backend(backend_cls, case, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@SPECS
@pytest.mark.parametrize("heads", XFORMERS_HEADS.values(), ids=XFORMERS_HEADS.keys())
@DTYPES
def test_xformers_matches_naive(xformers_cls, batch_spec, heads, dtype):
    case = _case(batch_spec, heads, dtype, seed=3)
    check_backend(xformers_cls, case, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@SPECS
@pytest.mark.parametrize("heads", [HEADS["gqa-4-2"], HEADS["gqa-32-8"]], ids=["gqa-4-2", "gqa-32-8"])
@DTYPES
def test_hybrid_xformers_prefill_torch_decode(xformers_cls, batch_spec, heads, dtype):
    case = _case(batch_spec, heads, dtype, seed=4)

    def hybrid(spec: AttentionSpec) -> HybridAttention:
        return HybridAttention(prefill=xformers_cls(spec), decode=TorchAttention(spec))

    check_backend(hybrid, case, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


def _decode_case(context_lens: tuple[int, ...], heads, seed: int, num_blocks: int) -> AttentionCase:
    needed = sum(-(-(c + 1) // BLOCK_SIZE) for c in context_lens)
    spec = BatchSpec("decode", (1,) * len(context_lens), context_lens)
    return _case(spec, heads, torch.bfloat16, seed=seed, spare_blocks=num_blocks - needed)


@pytest.mark.parametrize("heads", [HEADS["gqa-4-2"], HEADS["gqa-32-8"]], ids=["gqa-4-2", "gqa-32-8"])
def test_flashinfer_cuda_graph_decode_replay(flashinfer_cls, heads):
    """Capture one decode step; refill q/k/v, the cache and slot_mapping in place, plan the next
    step's batch (other lengths, other tables) and replay: the graph matches the eager wrapper."""
    first = _decode_case((300, 3, 16, 47, 0, 200), heads, seed=5, num_blocks=48)
    second = _decode_case((5, 250, 31, 0, 64, 17), heads, seed=6, num_blocks=48)
    backend = flashinfer_cls(first.spec)
    backend.plan(first.batch)
    backend.forward(first.q, first.k, first.v, first.kv_cache)  # JIT and warm-up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.forward(first.q, first.k, first.v, first.kv_cache)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out.float(), naive_attention(first), atol=2e-2, rtol=2e-2)

    eager = flashinfer_cls(first.spec, cuda_graph=False)
    eager.plan(second.batch)
    expected = eager.forward(second.q, second.k, second.v, tuple(c.clone() for c in second.kv_cache))
    for dst, src in zip((first.q, first.k, first.v, *first.kv_cache), (second.q, second.k, second.v, *second.kv_cache)):
        dst.copy_(src)
    first.batch.slot_mapping.copy_(second.batch.slot_mapping)  # what the captured cache write reads
    backend.plan(second.batch)  # refills the graph-mode page tables in place
    graph.replay()
    torch.cuda.synchronize()
    assert list(backend.windows[None].graph_decoders) == [len(second.batch.query_lens)]
    torch.testing.assert_close(out, expected, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(out.float(), naive_attention(second), atol=2e-2, rtol=2e-2)
