"""`flashinfer` and `xformers` on a machine without them (CI): they register, say why they cannot run,
compose refuses them with that reason, and their planning and wiring are right against stand-ins
for the two libraries that compute with torch what the real kernels compute (same call contract)."""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import sys
import types
from pathlib import Path

import pytest
import torch

from infer.api.config import EngineConfig, ModelConfig
from infer.api.errors import IncompatiblePluginsError
from infer.core.compose import check_model_attention, compose
from infer.core.registry import PluginRegistry
from infer.plugins.attention import flashinfer_backend, xformers_backend
from infer.plugins.attention.flashinfer_backend import FlashInferAttention, paged_kv_layout
from infer.plugins.attention.xformers_backend import XformersAttention
from infer.testing.attention import BATCH_SPECS, BatchSpec, check_backend, make_case

CUDA = torch.device("cuda")  # compose only reads the device type: nothing runs on it here
HAS = {name: importlib.util.find_spec(name) is not None for name in ("flashinfer", "xformers")}


@pytest.fixture
def registry() -> PluginRegistry:
    registry = PluginRegistry.load()
    missing = [m for m in (flashinfer_backend, xformers_backend) if not registry.manager.is_registered(m)]
    return PluginRegistry.load(extra_plugins=missing) if missing else registry  # before `pip install -e .`


def test_entry_points_declared():
    lines = (Path(__file__).parents[3] / "pyproject.toml").read_text().splitlines()
    assert 'attention-flashinfer = "infer.plugins.attention.flashinfer_backend"' in lines
    assert 'attention-xformers = "infer.plugins.attention.xformers_backend"' in lines


def test_both_register(registry):
    assert {"flashinfer", "xformers"} <= set(registry.names("attention"))
    assert registry.get("attention", "xformers").capabilities.phases == frozenset({"prefill"})
    assert registry.get("attention", "flashinfer").capabilities.cuda_graph_safe


@pytest.mark.parametrize("name", ["flashinfer", "xformers"])
def test_unavailable_with_reason(registry, name):
    if HAS[name]:
        pytest.skip(f"{name} is installed here")
    reason = registry.get("attention", name).unavailable_reason()
    assert reason is not None and reason.startswith(f"{name} is not importable") and "pip install" in reason


@pytest.mark.parametrize("name", ["flashinfer", "xformers"])
def test_compose_refuses_with_reason(registry, name):
    if HAS[name]:
        pytest.skip(f"{name} is installed here")
    with pytest.raises(IncompatiblePluginsError, match="runs only on cuda, not on cpu"):
        compose(EngineConfig(attention="torch", prefill_attention=name), registry, torch.device("cpu"), torch.float16)
    if name == "flashinfer":
        flag, config = "--attention", EngineConfig(attention=name)
    else:
        flag, config = "--prefill-attention", EngineConfig(attention="torch", prefill_attention=name)
    with pytest.raises(IncompatiblePluginsError, match=f"{flag} {name} cannot run here: {name} is not importable"):
        compose(config, registry, CUDA, torch.float16)


def test_auto_never_picks_them_on_cpu(registry):
    assert compose(EngineConfig(), registry, torch.device("cpu"), torch.float32).attention.name not in HAS


def test_xformers_serves_only_prefill(registry, monkeypatch):
    runnable = dataclasses.replace(XformersAttention.capabilities, available=lambda: None)
    monkeypatch.setattr(XformersAttention, "capabilities", runnable)
    with pytest.raises(IncompatiblePluginsError, match="serves only prefill: use it as --prefill-attention xformers"):
        compose(EngineConfig(attention="xformers"), registry, CUDA, torch.float16)
    composition = compose(EngineConfig(attention="torch", prefill_attention="xformers"), registry, CUDA, torch.bfloat16)
    assert composition.names()["prefill_attention"] == "xformers"


def test_a_windowed_model_refuses_xformers_and_names_the_backends_with_windows(registry, monkeypatch):
    runnable = dataclasses.replace(XformersAttention.capabilities, available=lambda: None)
    monkeypatch.setattr(XformersAttention, "capabilities", runnable)
    composition = compose(EngineConfig(attention="torch", prefill_attention="xformers"), registry, CUDA, torch.bfloat16)
    model = ModelConfig("MistralForCausalLM", 64, 32, 64, 2, 4, 2, 8, 4096, name="tiny", layer_windows=(256, None))
    with pytest.raises(IncompatiblePluginsError, match="--prefill-attention xformers does not implement it") as refused:
        check_model_attention(composition, registry, model, 4096)
    able = str(refused.value).split("one that does (")[1].split(")")[0].split(", ")
    assert {"torch", "paged-cuda", "flashinfer"} <= set(able) and "xformers" not in able
    check_model_attention(composition, registry, model, 256)  # a context within the window needs none


def test_xformers_reports_ops_that_cannot_run(monkeypatch):
    fmha = _fake_xformers(monkeypatch)

    def broken(*args, **kwargs):
        raise NotImplementedError("xFormers wasn't build with CUDA support")

    monkeypatch.setattr(fmha, "memory_efficient_attention_forward", broken)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    xformers_backend._available.cache_clear()
    try:
        reason = xformers_backend._available()
    finally:
        xformers_backend._available.cache_clear()
    assert reason is not None and reason.startswith("xformers is installed but its ops cannot run here: ")


def test_paged_kv_layout():
    indptr, indices, last = paged_kv_layout([1, 16, 17, 40], [[7], [3, 9], [5, 2, 8], [4, 6, 1, 0]], 16)
    assert indptr == [0, 1, 2, 4, 7]  # extra table entries (lookahead blocks) are not pages yet
    assert indices == [7, 3, 5, 2, 4, 6, 1]
    assert last == [1, 16, 1, 8]


# --------------------------------------------------------------------------- stand-in libraries


def _attend(q, keys, values, q_start: int, scale: float, causal=True, window_left=-1, soft_cap=None) -> torch.Tensor:
    """q: [Q, H, D]; keys, values: [L, Hkv, D]; query j sits at key position q_start + j. FlashInfer's
    window (include/flashinfer/attention/variants.cuh): key k is seen when k + window_left >= q_start + j,
    causal or not; its soft cap: scores become soft_cap * tanh(scores / soft_cap) (0 or None: uncapped)."""
    group = q.shape[1] // keys.shape[1]
    k, v = keys.float().repeat_interleave(group, 1), values.float().repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    if soft_cap:
        scores = soft_cap * torch.tanh(scores / soft_cap)
    k_pos, q_pos = torch.arange(k.shape[0])[None, :], q_start + torch.arange(q.shape[0])[:, None]
    hidden = k_pos > q_pos if causal else torch.zeros_like(k_pos > q_pos)
    if window_left >= 0:
        hidden |= k_pos + window_left < q_pos
    return torch.einsum("hqk,khd->qhd", scores.masked_fill(hidden, float("-inf")).softmax(-1), v).to(q.dtype)


class _FakeWrapper:
    """flashinfer's paged wrappers: plan() takes host int32 page tables, run() reads them (NHD)."""

    def __init__(
        self,
        workspace,
        kv_layout,
        use_cuda_graph=False,
        paged_kv_indptr_buffer=None,
        paged_kv_indices_buffer=None,
        paged_kv_last_page_len_buffer=None,
        backend="auto",
    ):
        assert kv_layout == "NHD" and workspace.dtype == torch.uint8
        self.buffers = (paged_kv_indptr_buffer, paged_kv_indices_buffer, paged_kv_last_page_len_buffer)
        self.use_cuda_graph, self.backend = use_cuda_graph, backend

    def reset_workspace_buffer(self, float_workspace, int_workspace) -> None:
        assert int_workspace.dtype == torch.uint8

    def plan(
        self,
        *tables,
        causal=False,
        sm_scale=None,
        q_data_type=None,
        kv_data_type=None,
        window_left=-1,
        logits_soft_cap=None,
    ):
        assert all(t.dtype == torch.int32 and t.device.type == "cpu" for t in tables[:-4])  # built on the host
        *tables, self.num_heads, self.num_kv_heads, self.head_dim, self.page_size = tables
        if len(tables) == 3:  # decode: one query per sequence
            tables = [torch.arange(len(tables[2]) + 1, dtype=torch.int32), *tables]
        if self.use_cuda_graph:
            assert len(tables[3]) == len(self.buffers[2]), "graph-mode batch size is fixed"
            for buffer, table in zip(self.buffers, tables[1:]):
                buffer[: len(table)].copy_(table)
            tables = [tables[0], *self.buffers]
        self.tables, self.causal, self.scale = tables, causal, sm_scale
        self.window_left, self.soft_cap, self.kv_data_type = window_left, logits_soft_cap, kv_data_type

    def run(self, q, kv_cache, out=None, k_scale=None, v_scale=None):
        """An FP8 cache (kv_data_type) is read as FlashInfer does: sm_scale * k_scale, the output * v_scale."""
        qo_indptr, indptr, indices, last = (t.tolist() for t in self.tables)
        k_cache, v_cache = kv_cache
        assert k_cache.dtype == self.kv_data_type, "FlashInfer checks the cache against the planned kv_data_type"
        scale = self.scale * (k_scale if k_scale is not None else 1.0)
        for i in range(len(last)):
            pages = torch.tensor(indices[indptr[i] : indptr[i + 1]])
            kv_len = (len(pages) - 1) * self.page_size + last[i]
            keys, values = k_cache[pages].flatten(0, 1)[:kv_len], v_cache[pages].flatten(0, 1)[:kv_len]
            q_i = q[qo_indptr[i] : qo_indptr[i + 1]]
            start = kv_len - len(q_i)
            attended = _attend(q_i, keys, values, start, scale, self.causal, self.window_left, self.soft_cap)
            out[qo_indptr[i] : qo_indptr[i + 1]] = attended
        if v_scale is not None:
            out *= v_scale
        return out


@pytest.fixture
def fake_flashinfer(monkeypatch) -> types.ModuleType:
    module = types.ModuleType("flashinfer")
    module.BatchDecodeWithPagedKVCacheWrapper = _FakeWrapper
    module.BatchPrefillWithPagedKVCacheWrapper = _FakeWrapper
    monkeypatch.setitem(sys.modules, "flashinfer", module)
    return module


def _fake_xformers(monkeypatch) -> types.SimpleNamespace:
    class _Bias:
        def __init__(self, q_lens, k_lens, bottom_right):
            self.q_lens, self.k_lens, self.bottom_right = list(q_lens), list(k_lens), bottom_right

    def top_left(q_lens, device=None):
        return _Bias(q_lens, q_lens, False)

    def bottom_right(q_lens, k_lens, device=None):
        assert all(k >= q for q, k in zip(q_lens, k_lens))
        return _Bias(q_lens, k_lens, True)

    def attention(query, key, value, attn_bias=None, scale=None):
        assert query.ndim in (4, 5) and query.shape[0] == 1
        assert query.ndim == 4 or key.stride(3) == 0  # GQA: keys expanded over the group
        q = query[0].flatten(1, -2)  # [M, H, K]
        k, v = (x[0, :, :, 0] if x.ndim == 5 else x[0] for x in (key, value))  # [L, Hkv, K]
        out, qs, ks = [], 0, 0
        for q_len, k_len in zip(attn_bias.q_lens, attn_bias.k_lens):
            start = k_len - q_len if attn_bias.bottom_right else 0
            out.append(_attend(q[qs : qs + q_len], k[ks : ks + k_len], v[ks : ks + k_len], start, scale))
            qs, ks = qs + q_len, ks + k_len
        return torch.cat(out).reshape(query.shape)

    masks = types.SimpleNamespace(
        BlockDiagonalCausalMask=types.SimpleNamespace(from_seqlens=top_left),
        BlockDiagonalCausalFromBottomRightMask=types.SimpleNamespace(from_seqlens=bottom_right),
    )
    fmha = types.SimpleNamespace(attn_bias=masks, memory_efficient_attention_forward=attention)
    ops = types.ModuleType("xformers.ops")
    ops.fmha = fmha
    monkeypatch.setitem(sys.modules, "xformers", types.ModuleType("xformers"))
    monkeypatch.setitem(sys.modules, "xformers.ops", ops)
    return fmha


HEADS = {"mha": (4, 4), "gqa": (4, 2), "mqa": (6, 1)}


@pytest.mark.parametrize("batch_spec", BATCH_SPECS, ids=lambda s: s.name)
@pytest.mark.parametrize("heads", HEADS.values(), ids=HEADS.keys())
def test_flashinfer_plan_and_forward(fake_flashinfer, batch_spec, heads):
    case = make_case(batch_spec, num_heads=heads[0], num_kv_heads=heads[1], seed=4)
    check_backend(functools.partial(FlashInferAttention, workspace_bytes=1024), case, atol=1e-5, rtol=1e-5)


def test_flashinfer_decode_steps_reuse_graph_buffers(fake_flashinfer):
    first = make_case(BatchSpec("a", (1, 1, 1), (3, 40, 16)), seed=1, spare_blocks=4)
    second = make_case(BatchSpec("b", (1, 1, 1), (33, 0, 20)), seed=2, spare_blocks=3)
    backend = FlashInferAttention(first.spec, workspace_bytes=1024)
    backend.plan(first.batch)
    wrapper, indices = backend.windows[None].graph_decoders[3], backend.graph_indices.data_ptr()
    backend.forward(first.q, first.k, first.v, first.kv_cache)
    backend.plan(second.batch)
    assert backend.windows[None].graph_decoders == {3: wrapper} and backend.graph_indices.data_ptr() == indices
    mixed = make_case(BATCH_SPECS[-1], seed=3)
    eager = FlashInferAttention(mixed.spec, workspace_bytes=1024)
    eager.plan(mixed.batch)
    full = eager.windows[None]  # graphs hold decode-only steps
    assert not full.graph_decoders and eager._plan.decoders[None] is full.decoder


@pytest.mark.parametrize("batch_spec", BATCH_SPECS, ids=lambda s: s.name)
@pytest.mark.parametrize("window", [None, 5], ids=["no-window", "window-5"])
def test_flashinfer_windows_and_soft_cap(fake_flashinfer, batch_spec, window):
    """Every window the model uses gets its own wrappers, planned with window_left = W - 1 and the
    model's soft cap; forward(window=W) runs that window's."""
    case = make_case(batch_spec, seed=6, window=window, soft_cap=2.0)
    case.spec = dataclasses.replace(case.spec, sliding_windows=(5, 12))  # two windows, as Gemma-like models
    backend_cls = functools.partial(FlashInferAttention, workspace_bytes=1024)
    check_backend(backend_cls, case, atol=1e-5, rtol=1e-5)
    backend = backend_cls(case.spec)
    backend.plan(case.batch)
    assert {w: x.window_left for w, x in backend.windows.items()} == {None: -1, 5: 4, 12: 11}
    planned = [*backend._plan.decoders.values(), *(x.prefill for x in backend.windows.values())]
    assert all(x.soft_cap == 2.0 for x in planned if hasattr(x, "tables"))


def test_flashinfer_graph_decoders_per_window(fake_flashinfer):
    """A decode-only step plans a graph-mode wrapper per window, each with plan data of its own."""
    case = make_case(BatchSpec("d", (1, 1), (30, 9)), seed=7, window=4)
    backend = FlashInferAttention(case.spec, workspace_bytes=1024)
    backend.plan(case.batch)
    full, windowed = backend.windows[None], backend.windows[4]
    assert list(full.graph_decoders) == list(windowed.graph_decoders) == [2]
    assert backend._plan.decoders == {None: full.graph_decoders[2], 4: windowed.graph_decoders[2]}
    assert full.graph_int_workspace.data_ptr() != windowed.graph_int_workspace.data_ptr()
    check_backend(functools.partial(FlashInferAttention, workspace_bytes=1024), case, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("batch_spec", BATCH_SPECS, ids=lambda s: s.name)
@pytest.mark.parametrize("heads", HEADS.values(), ids=HEADS.keys())
def test_xformers_plan_and_forward(monkeypatch, batch_spec, heads):
    _fake_xformers(monkeypatch)
    case = make_case(batch_spec, num_heads=heads[0], num_kv_heads=heads[1], seed=5)
    backend = XformersAttention(case.spec)
    backend.plan(case.batch)
    assert (backend._plan.kv_slots is None) == (not any(batch_spec.context_lens))
    check_backend(XformersAttention, case, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("batch_spec", BATCH_SPECS, ids=lambda s: s.name)
def test_flashinfer_fp8_cache(fake_flashinfer, batch_spec):
    """An FP8 cache: wrappers planned with kv_data_type e4m3, the write quantized as the torch backend
    quantizes, each run given the layer's k_scale and v_scale; paged prefill on fa2 kernels."""
    case = make_case(batch_spec, seed=8, kv_cache_dtype=torch.float8_e4m3fn, kv_scales=(0.37, 2.5))
    check_backend(functools.partial(FlashInferAttention, workspace_bytes=1024), case, atol=1e-5, rtol=1e-5)
    backend = FlashInferAttention(case.spec, workspace_bytes=1024)
    assert backend.windows[None].prefill.backend == "fa2"
    assert FlashInferAttention(make_case(batch_spec).spec, workspace_bytes=1024).windows[None].prefill.backend == "auto"
