"""Layer kinds added after plugins were written for the first ones."""

import infer
from infer.api import Capabilities
from infer.core.registry import PluginRegistry
from infer.plugins.layer import torch_layers


def test_a_layers_plugin_of_the_first_four_kinds_still_loads():
    """A third-party layers plugin written before gelu_and_mul existed replaces its kinds; the
    built-in serves the new one."""

    class Norm(torch_layers.RMSNorm):
        capabilities = Capabilities(priority=50)

    class OldLayers:
        @staticmethod
        @infer.hookimpl
        def infer_register_layers(register):
            register("rms_norm", Norm)
            register("rotary_embedding", torch_layers.RotaryEmbedding)
            register("silu_and_mul", torch_layers.SiluAndMul)
            register("linear", torch_layers.Linear)

    layers = PluginRegistry.load([OldLayers]).layers("cpu")
    assert layers.rms_norm is Norm and layers.gelu_and_mul is torch_layers.GeluAndMul
