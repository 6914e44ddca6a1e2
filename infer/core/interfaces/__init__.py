"""The small interfaces every strategy implements, and the objects that cross between them.

Each interface is documented by *when* the engine calls it and *what* it may change.
Implementations are plain classes; a factory registered through a hook builds them once per
engine, so the hot loop is ordinary method calls.

One module per noun (capabilities, attention, kv, scheduling, sampling, decoding, text,
models, parallel, decode paths, constraints); everything is importable from here: `from infer.core.interfaces import AttentionBackend`.
An optional ability is a small `runtime_checkable` protocol beside the interface it extends, whose
docstring documents it; a strategy without it works, without what it would add.
"""

from infer.core.interfaces.attention import (
    AttentionBackend,
    AttentionBatch,
    AttentionSpec,
    KVCache,
    RotaryFusingAttention,
)
from infer.core.interfaces.capabilities import DEFAULT_CAPABILITIES, Capabilities, capabilities_of
from infer.core.interfaces.constraints import LogitsProcessor, LogitsRow, PreparingProcessor, ProcessorContext
from infer.core.interfaces.decode_paths import DecodeGraphs, DecodePipeline
from infer.core.interfaces.decoding import Decoder, DecoderContext, ModelRunnerLike, SelfDescribing, StatsSummary
from infer.core.interfaces.kv import BlockOps, KVAllocator, KVUsage
from infer.core.interfaces.models import (
    LAYER_KINDS,
    CausalLM,
    CheckpointShapes,
    DecoderStack,
    FusingActivation,
    HFArchitectures,
    KitConfig,
    Layers,
    LinearMatmul,
    ModelArchitecture,
    ModelPresets,
    PushingMatmul,
    QuantizedLinear,
    RegisterFn,
    RotaryTables,
)
from infer.core.interfaces.parallel import Communicator, Executor, HeadLayout, Launch, LocalExecutor, SingleProcess
from infer.core.interfaces.sampling import Sampler, SamplerOutput, TokenSampler, VerifyingSampler
from infer.core.interfaces.scheduling import (
    BatchOutlook,
    PipeliningScheduler,
    ResettableStats,
    ScheduledSeq,
    Scheduler,
    SchedulerOutput,
    StepResult,
    TokenBudgeted,
)
from infer.core.interfaces.text import DetokenizedDelta, Detokenizer

__all__ = [
    "Capabilities", "DEFAULT_CAPABILITIES", "capabilities_of",
    "AttentionSpec", "AttentionBatch", "KVCache", "AttentionBackend", "RotaryFusingAttention",
    "KVAllocator", "KVUsage", "BlockOps",
    "ScheduledSeq", "SchedulerOutput", "StepResult", "Scheduler", "BatchOutlook", "PipeliningScheduler",
    "ResettableStats", "TokenBudgeted",
    "SamplerOutput", "Sampler", "TokenSampler", "VerifyingSampler",
    "ModelRunnerLike", "DecoderContext", "Decoder", "SelfDescribing", "StatsSummary",
    "DetokenizedDelta", "Detokenizer",
    "LogitsProcessor", "LogitsRow", "ProcessorContext", "PreparingProcessor",
    "LAYER_KINDS", "Layers", "RotaryTables", "FusingActivation", "LinearMatmul", "QuantizedLinear", "PushingMatmul",
    "CausalLM", "CheckpointShapes", "ModelArchitecture", "HFArchitectures", "ModelPresets", "RegisterFn",
    "DecoderStack", "KitConfig",
    "DecodeGraphs", "DecodePipeline",
    "HeadLayout", "Communicator", "Executor", "LocalExecutor", "SingleProcess", "Launch",
]  # fmt: skip
