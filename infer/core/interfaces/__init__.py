"""The small interfaces every strategy implements, and the objects that cross between them.

Each interface is documented by *when* the engine calls it and *what* it may change.
Implementations are plain classes; a factory registered through a hook builds them once per
engine, so the hot loop is ordinary method calls.

One module per noun (capabilities, attention, kv, scheduling, sampling, decoding, text,
models); everything is importable from here: `from infer.core.interfaces import AttentionBackend`.
"""

from infer.core.interfaces.attention import AttentionBackend, AttentionBatch, AttentionSpec, KVCache
from infer.core.interfaces.capabilities import DEFAULT_CAPABILITIES, Capabilities, capabilities_of
from infer.core.interfaces.decoding import Decoder, DecoderContext, ModelRunnerLike
from infer.core.interfaces.kv import BlockOps, KVAllocator, KVUsage
from infer.core.interfaces.models import LAYER_KINDS, CausalLM, CheckpointShapes, Layers, ModelArchitecture, RegisterFn
from infer.core.interfaces.sampling import Sampler, SamplerOutput
from infer.core.interfaces.scheduling import ScheduledSeq, Scheduler, SchedulerOutput, StepResult
from infer.core.interfaces.text import DetokenizedDelta, Detokenizer

__all__ = [
    "Capabilities",
    "DEFAULT_CAPABILITIES",
    "capabilities_of",
    "AttentionSpec",
    "AttentionBatch",
    "KVCache",
    "AttentionBackend",
    "KVAllocator",
    "KVUsage",
    "BlockOps",
    "ScheduledSeq",
    "SchedulerOutput",
    "StepResult",
    "Scheduler",
    "SamplerOutput",
    "Sampler",
    "ModelRunnerLike",
    "DecoderContext",
    "Decoder",
    "DetokenizedDelta",
    "Detokenizer",
    "LAYER_KINDS",
    "Layers",
    "CausalLM",
    "ModelArchitecture",
    "CheckpointShapes",
    "RegisterFn",
]
