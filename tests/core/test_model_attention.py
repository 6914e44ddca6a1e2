"""A model's sliding window and soft cap against the attention backends that would run them."""

import pytest

import infer
from infer.core.compose import check_model_attention, compose
from infer.core.config import EngineConfig, ModelConfig
from infer.core.errors import IncompatiblePluginsError
from infer.core.interfaces import Capabilities
from infer.core.registry import PluginRegistry
from infer.plugins.attention.torch_backend import TorchAttention


class PlainAttention(TorchAttention):  # the same kernels, declaring neither window nor soft cap
    capabilities = Capabilities()


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
