"""The small interfaces every strategy implements, and the objects that cross between them.

Each interface is documented by *when* the engine calls it and *what* it may change.
Implementations are plain classes; a factory registered through a hook builds them once per
engine, so the hot loop is ordinary method calls.

One module per noun (capabilities, attention, kv, scheduling, sampling, decoding, text,
models); everything is importable from here: `from infer.core.interfaces import AttentionBackend`.
"""

from infer.core.interfaces.capabilities import Capabilities, DEFAULT_CAPABILITIES, capabilities_of
from infer.core.interfaces.attention import AttentionSpec, AttentionBatch, KVCache, AttentionBackend
from infer.core.interfaces.kv import KVAllocator, KVUsage, BlockOps
from infer.core.interfaces.scheduling import ScheduledSeq, SchedulerOutput, StepResult, Scheduler
from infer.core.interfaces.sampling import SamplerOutput, Sampler
from infer.core.interfaces.decoding import ModelRunnerLike, DecoderContext, Decoder
from infer.core.interfaces.text import DetokenizedDelta, Detokenizer
from infer.core.interfaces.models import LAYER_KINDS, CheckpointShapes, Layers, CausalLM, ModelArchitecture, RegisterFn

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
