"""The Triton kernels launched as programmatic dependents (PDL, on by default on Hopper) give bitwise
the results of plain launches: each kernel eagerly and a decode layer's chain of them captured in a
CUDA graph and replayed, and greedy tokens end to end. Skipped on GPUs before Hopper."""

import pytest
import torch

from infer.kernels import pdl, triton_pdl

pytestmark = pytest.mark.gpu


@pytest.fixture
def switch_pdl(monkeypatch):
    """switch_pdl(True) / switch_pdl(False) sets INFER_PDL for the kernels launched after it."""

    def switch(on: bool) -> None:
        monkeypatch.setenv("INFER_PDL", "1" if on else "0")
        pdl.reset()

    switch(True)
    if not triton_pdl.use_pdl(torch.device("cuda")):
        pytest.skip("no programmatic dependent launch on this GPU (compute capability < 9.0)")
    yield switch
    pdl.reset()


def _layer_chain(x, w_qkv, w_o, w_up, w_down, norm_w, cos, sin, positions, kv, case):
    """One decode layer's kernels back to back, each reading the one before's output."""
    from infer.kernels import layers as triton_layers
    from infer.kernels.gemv import gemv
    from infer.plugins.attention.paged_cuda.kernels import cache_write, decode

    h, res = triton_layers.rms_norm(x, norm_w, 1e-5, x)
    qkv = gemv(h, w_qkv)
    heads, kv_heads, dim = case
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q, k = triton_layers.rotary(positions, q.view(1, heads, dim), k.view(1, kv_heads, dim), cos, sin)
    k_cache, v_cache, tables, seq_lens, slots, scratch = kv
    cache_write.cache_write(k, v.view(1, kv_heads, dim), k_cache, v_cache, slots)
    out = torch.empty_like(q)
    decode.paged_decode(out, q, k_cache, v_cache, tables, seq_lens, dim**-0.5, 1, scratch, block_n=64)
    h = gemv(out.view(1, -1), w_o) + res
    up = triton_layers.silu_and_mul(gemv(h, w_up))
    return gemv(up, w_down)


def test_kernels_with_pdl_match_plain_launches(switch_pdl):
    torch.manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    heads, kv_heads, dim, hidden, inter = 16, 16, 128, 2048, 5504
    w_qkv = torch.randn((heads + 2 * kv_heads) * dim, hidden, device=dev, dtype=dt) / hidden**0.5
    w_o = torch.randn(hidden, heads * dim, device=dev, dtype=dt) / (heads * dim) ** 0.5
    w_up = torch.randn(2 * inter, hidden, device=dev, dtype=dt) / hidden**0.5
    w_down = torch.randn(hidden, inter, device=dev, dtype=dt) / inter**0.5
    norm_w = torch.rand(hidden, device=dev, dtype=dt) + 0.5
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2, device=dev).float() / dim))
    angles = torch.outer(torch.arange(4096, device=dev).float(), inv)
    cos, sin = angles.cos(), angles.sin()
    positions = torch.tensor([300], device=dev)
    num_blocks, block = 64, 16
    k_cache = torch.randn(num_blocks, block, kv_heads, dim, device=dev, dtype=dt)
    v_cache = torch.randn_like(k_cache)
    tables = torch.randperm(num_blocks, device=dev)[:32].int().view(1, 32)
    seq_lens = torch.tensor([301], device=dev, dtype=torch.int32)
    slots = (tables[0, 300 // block].long() * block + 300 % block).view(1)
    splits = 8  # a batch-1 step splits its context: the reduce kernel runs too
    scratch = (
        torch.empty(1, heads, splits, dim, device=dev),
        torch.empty(1, heads, splits, device=dev),
        torch.empty(1, heads, splits, device=dev),
    )
    x = torch.randn(1, hidden, device=dev, dtype=dt)

    def run(on: bool, graph: bool) -> torch.Tensor:
        switch_pdl(on)
        kv = (k_cache.clone(), v_cache.clone(), tables, seq_lens, slots, scratch)
        args = (x, w_qkv, w_o, w_up, w_down, norm_w, cos, sin, positions, kv, (heads, kv_heads, dim))
        if not graph:
            return _layer_chain(*args)
        _layer_chain(*args)  # compile and autotune outside the capture
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = _layer_chain(*args)
        for _ in range(3):
            g.replay()
        torch.cuda.synchronize()
        return out.clone()

    plain = run(False, graph=False)
    assert torch.isfinite(plain.float()).all()
    assert torch.equal(run(True, graph=False), plain)
    assert torch.equal(run(True, graph=True), plain)
    assert torch.equal(run(False, graph=True), plain)


def test_greedy_tokens_with_pdl_match(switch_pdl):
    from infer import SamplingParams
    from infer.llm import LLM

    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    prompts = [[1, 415, 5565, 302, 4843, 349], [1, 801, 10342, 28732]]
    tokens = {}
    for on in (False, True):
        switch_pdl(on)
        with LLM(
            model="smollm2-135m", load_format="dummy", max_model_len=2048, attention="paged-cuda", dtype="bfloat16"
        ) as llm:
            tokens[on] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert tokens[True] == tokens[False]
