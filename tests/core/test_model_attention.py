"""A model's sliding window and soft cap against the attention backends that would run them."""

import pytest

import infer
from infer.api import Capabilities
from infer.api.config import EngineConfig, ModelConfig
from infer.api.errors import IncompatiblePluginsError
from infer.core.compose import check_model_attention, compose
from infer.core.registry import PluginRegistry
from infer.plugins.attention.torch_backend import TorchAttention
from infer.runtime.hybrid_attention import HybridAttention
from infer.testing.attention import BATCH_SPECS, check_backend, make_case


class PlainAttention(TorchAttention):  # the same kernels, declaring neither window nor soft cap
    capabilities = Capabilities()

    def forward(self, q, k, v, kv_cache):  # and taking no window=
        return super().forward(q, k, v, kv_cache)


class Plugin:
    @staticmethod
    @infer.hookimpl
    def infer_register_attention_backends(register):
        register("plain", PlainAttention)


def model(windows=(), soft_cap=None):
    return ModelConfig("MistralForCausalLM", 64, 32, 64, 2, 4, 2, 8, 4096, name="tiny", layer_windows=windows,
                       attention_soft_cap=soft_cap)  # fmt: skip


def composed(attention):
    registry = PluginRegistry.load([Plugin])
    config = EngineConfig(attention=attention, device="cpu")
    return compose(config, registry, config.resolve_device(), config.resolve_dtype(config.resolve_device())), registry


def test_a_window_shorter_than_the_context_needs_a_backend_that_has_it():
    composition, registry = composed("plain")
    with pytest.raises(
        IncompatiblePluginsError, match=r"sliding-window.*window 256.*--attention plain.*torch.*--max-model-len 256"
    ):
        check_model_attention(composition, registry, model((256, None)), 4096)  # fmt: skip
    check_model_attention(composition, registry, model((256, None)), 256)  # the window covers the context
    check_model_attention(composition, registry, model(), 4096)
    torch_composition, _ = composed("torch")
    check_model_attention(torch_composition, registry, model((256, None)), 4096)


def test_soft_capped_scores_need_a_backend_that_caps():
    composition, registry = composed("plain")
    with pytest.raises(IncompatiblePluginsError, match=r"soft cap 50.0.*--attention plain.*torch"):
        check_model_attention(composition, registry, model(soft_cap=50.0), 4096)
    check_model_attention(composed("torch")[0], registry, model(soft_cap=50.0), 4096)


def test_within_context_drops_windows_that_change_nothing():
    config = model((8, None, 4096))
    assert config.within_context(100).layer_windows == (8, None, None)
    assert config.within_context(8).layer_windows == ()
    assert config.sliding_windows() == (8, 4096)
    assert config.with_layers(1).layer_windows == (8,)


def test_hybrid_attention_declares_windows_and_caps_only_when_both_halves_do():
    spec = make_case(BATCH_SPECS[0]).spec
    able = HybridAttention(prefill=TorchAttention(spec), decode=TorchAttention(spec)).capabilities
    assert able.sliding_window and able.soft_cap and able.pipeline_safe  # the rest is the decode half's
    for prefill, decode in [(PlainAttention, TorchAttention), (TorchAttention, PlainAttention)]:
        caps = HybridAttention(prefill=prefill(spec), decode=decode(spec)).capabilities
        assert not caps.sliding_window and not caps.soft_cap


@pytest.mark.parametrize("batch_spec", [BATCH_SPECS[1], BATCH_SPECS[3], BATCH_SPECS[5]], ids=lambda s: s.name)
def test_hybrid_attention_passes_the_window_to_both_halves(batch_spec):
    case = make_case(batch_spec, block_size=4, seed=3, window=5, soft_cap=2.0)  # decode, prefill, mixed

    def hybrid(spec):
        return HybridAttention(prefill=TorchAttention(spec), decode=TorchAttention(spec))

    check_backend(hybrid, case, atol=1e-5, rtol=1e-5)


def test_hybrid_attention_passes_no_window_to_a_half_without_windows():
    case = make_case(BATCH_SPECS[5], seed=4)
    check_backend(
        lambda spec: HybridAttention(prefill=PlainAttention(spec), decode=TorchAttention(spec)), case, 1e-5, 1e-5
    )
