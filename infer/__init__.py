"""infer: a plugin-architecture LLM inference engine."""

from infer.api import Capabilities
from infer.api.hookspecs import PLUGIN_API_VERSION, hookimpl
from infer.api.request import CompletionOutput, RequestOutput, SamplingParams

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "SamplingParams",
    "RequestOutput",
    "CompletionOutput",
    "Capabilities",
    "hookimpl",
    "PLUGIN_API_VERSION",
    "__version__",
]


def __getattr__(name: str):
    if name == "LLM":  # the engine pulls in the model stack; import it only when asked for
        from infer.llm import LLM

        return LLM
    raise AttributeError(f"module 'infer' has no attribute {name!r}")
