"""The small interfaces every strategy implements, and the objects that cross between them.

Each interface is documented by *when* the engine calls it and *what* it may change.
Implementations are plain classes; a factory registered through a hook builds them once per
engine, so the hot loop is ordinary method calls.

One module per noun (capabilities, attention, kv, scheduling, sampling, decoding, text,
models, parallel, decode paths, constraints); everything is importable from here: `from infer.api import AttentionBackend`.
An optional ability is a small `runtime_checkable` protocol beside the interface it extends, whose
docstring documents it; a strategy without it works, without what it would add.
"""

from infer.api.adapters import (
    AdaptableModel,
    AdapterBatch,
    AdapterKind,
    AdapterLayer,
    AdapterSpec,
    AdapterTarget,
    LoRARequest,
    begin_adapter,
)
from infer.api.attention import (
    AttentionBackend,
    AttentionBatch,
    AttentionSpec,
    KVCache,
    RotaryFusingAttention,
)
from infer.api.capabilities import DEFAULT_CAPABILITIES, Capabilities, capabilities_of
from infer.api.constraints import (
    AheadProcessor,
    AheadRow,
    KitParams,
    LogitsProcessor,
    LogitsRow,
    PreparingProcessor,
    ProcessorContext,
    ServingProcessor,
)
from infer.api.decode_paths import DecodeGraphs, DecodePipeline
from infer.api.decoding import Decoder, DecoderContext, ForwardRunner, ModelRunnerLike, SelfDescribing, StatsSummary
from infer.api.kv import BlockOps, KVAllocator, KVUsage
from infer.api.models import (
    LAYER_KINDS,
    CausalLM,
    CheckpointQuantized,
    CheckpointShapes,
    CpuDtypePreferring,
    DecoderStack,
    FusingActivation,
    GatedLinear,
    HFArchitectures,
    KitConfig,
    Layers,
    LinearMatmul,
    ModelArchitecture,
    ModelPresets,
    PlainRMSNorm,
    PushingMatmul,
    QuantizedLinear,
    QuantizingNorm,
    RegisterFn,
    RotaryTables,
    TakesQuantizedInput,
    pushes_partial_sums,
    pushing,
)
from infer.api.overlap import DeviceWaits
from infer.api.parallel import (
    Communicator,
    Executor,
    HeadLayout,
    Launch,
    LocalExecutor,
    ModelParallel,
    PipelineLink,
    PipelineStage,
    SingleProcess,
    StageActivations,
    TensorParallelLayers,
)
from infer.api.reasoning import ReasoningParser, ReasoningSplit, ReasoningStream
from infer.api.sampling import Sampler, SamplerOutput, SupportedParams, TokenSampler, VerifyingSampler
from infer.api.scheduling import (
    BatchOutlook,
    PipeliningScheduler,
    ResettableStats,
    ScheduledSeq,
    Scheduler,
    SchedulerOutput,
    StepResult,
    TokenBudgeted,
)
from infer.api.text import DetokenizedDelta, Detokenizer

__all__ = [
    "Capabilities", "DEFAULT_CAPABILITIES", "capabilities_of",
    "AttentionSpec", "AttentionBatch", "KVCache", "AttentionBackend", "RotaryFusingAttention",
    "KVAllocator", "KVUsage", "BlockOps",
    "ScheduledSeq", "SchedulerOutput", "StepResult", "Scheduler", "BatchOutlook", "PipeliningScheduler",
    "ResettableStats", "TokenBudgeted",
    "SamplerOutput", "Sampler", "TokenSampler", "VerifyingSampler", "SupportedParams",
    "ModelRunnerLike", "ForwardRunner", "DecoderContext", "Decoder", "SelfDescribing", "StatsSummary",
    "DetokenizedDelta", "Detokenizer", "DeviceWaits",
    "ReasoningParser", "ReasoningSplit", "ReasoningStream",
    "LogitsProcessor", "LogitsRow", "ProcessorContext", "PreparingProcessor", "AheadProcessor", "AheadRow", "ServingProcessor", "KitParams",
    "LAYER_KINDS", "Layers", "RotaryTables", "FusingActivation", "LinearMatmul", "QuantizedLinear", "PushingMatmul",
    "CheckpointQuantized", "CpuDtypePreferring",
    "pushing", "pushes_partial_sums", "PlainRMSNorm", "QuantizingNorm", "TakesQuantizedInput", "GatedLinear",
    "CausalLM", "CheckpointShapes", "ModelArchitecture", "HFArchitectures", "ModelPresets", "RegisterFn",
    "DecoderStack", "KitConfig",
    "DecodeGraphs", "DecodePipeline",
    "LoRARequest", "AdapterTarget", "AdapterSpec", "AdapterBatch", "AdapterKind", "AdapterLayer", "AdaptableModel", "begin_adapter",
    "HeadLayout", "Communicator", "Executor", "LocalExecutor", "SingleProcess", "ModelParallel", "TensorParallelLayers", "Launch",
    "PipelineStage", "PipelineLink", "StageActivations",
]  # fmt: skip
