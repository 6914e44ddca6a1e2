"""infer: a plugin-architecture LLM inference engine."""

from infer.api import Capabilities
from infer.api.adapters import LoRARequest
from infer.api.config import EngineConfig
from infer.api.hookspecs import PLUGIN_API, PLUGIN_API_VERSION, hookimpl
from infer.api.pooling import PoolingParams
from infer.api.request import CompletionOutput, RequestOutput, SamplingParams
from infer.common import moved

moved.install()  # the old names of moved modules import, with a DeprecationWarning naming the new one

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "make_engine",
    "EngineConfig",
    "SamplingParams",
    "PoolingParams",
    "RequestOutput",
    "CompletionOutput",
    "LoRARequest",
    "Capabilities",
    "hookimpl",
    "PLUGIN_API",
    "PLUGIN_API_VERSION",
    "__version__",
]


def __getattr__(name: str):
    if name == "LLM":  # the engine pulls in the model stack; import it only when asked for
        from infer.llm import LLM

        return LLM
    if name == "make_engine":  # the public stepping API's engine (`infer.core.engine.Engine`)
        from infer.runtime.builder import make_engine

        return make_engine
    raise AttributeError(f"module 'infer' has no attribute {name!r}")
