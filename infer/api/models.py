"""Model architectures and the layers they are built from."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Protocol, Sequence, TypeVar, runtime_checkable

import torch

from infer.api.attention import AttentionBackend, KVCache

if TYPE_CHECKING:
    from infer.api.config import ModelConfig
    from infer.api.parallel import StageActivations


LAYER_KINDS = ("rms_norm", "rotary_embedding", "silu_and_mul", "linear", "gelu_and_mul")


@dataclass(frozen=True, slots=True)
class Layers:
    """The layer implementations a model builds itself from, resolved once per engine.

    Optional abilities: a rotary layer whose `RotaryTables.fuses_into_attention` is true only rotates
    by its cos, sin, which a `RotaryFusingAttention` backend may apply instead. `FusingActivation.down(h,
    weight)` is matmul(self(h), weight) in one kernel, for a projection `fuses_with` accepts. A linear
    class's `LinearMatmul.matmul(x, weight)` is what tensor-parallel shards call (else F.linear); a
    matmul (or `down`) whose `PushingMatmul.pushes` is true takes `push=`, a tensor-parallel exchange
    (`pushing` declares it, `pushes_partial_sums` reads it). A norm that is `PlainRMSNorm` may be computed by the tensor-parallel
    all-reduce itself; a `QuantizingNorm` stores its output quantized for a linear that
    `TakesQuantizedInput`; a `GatedLinear` down projection applies the MLP's activation to its input itself.
    """

    rms_norm: Any  # (hidden_size, eps) -> module; forward(x, residual=None)
    rotary_embedding: Any  # (rope: infer.api.rope.Rope, max_position) -> module with cos, sin; forward(positions, q, k)
    silu_and_mul: Any  # () -> module; forward(x [T, 2I]) -> [T, I]
    linear: Any  # (in_features, out_features, bias=False) -> module
    # () -> module; forward(x [T, 2I]) -> gelu_tanh(gate) * up [T, I] (GeGLU: Gemma). None only in a
    # Layers built by hand without it; the registry always fills it (the built-in one at least)
    gelu_and_mul: Any = None
    # the decoder projections' linear under a quantization (a class with `quantization`, the scheme
    # it registered for: `QuantizedLinear`); None: `linear`. The LM head stays `linear`.
    quantized_linear: Any = None


@runtime_checkable
class RotaryTables(Protocol):
    fuses_into_attention: bool


@runtime_checkable
class FusingActivation(Protocol):
    def fuses_with(self, projection: torch.nn.Module) -> bool: ...

    def down(self, h: torch.Tensor, weight: torch.Tensor, push: Any = None) -> torch.Tensor: ...


@runtime_checkable
class LinearMatmul(Protocol):
    matmul: Callable[..., torch.Tensor]


@runtime_checkable
class QuantizedLinear(Protocol):
    """A linear layer holding quantized weights. `load_rows(name, offset, size, tensor)` fills rows
    [offset, offset + size) of its parameter `name` from a checkpoint tensor (a model's weight: it
    quantizes; a quantized checkpoint's weight or scale: as it is) and returns the parameter names filled."""

    quantization: str

    def load_rows(self, name: str, offset: int, size: int, tensor: torch.Tensor) -> list[str]: ...


@runtime_checkable
class CheckpointQuantized(Protocol):
    """A `QuantizedLinear` class whose layout depends on how the checkpoint was quantized (group size,
    symmetry, format version): `for_checkpoint(quantization_config)` returns the factory (in_features,
    out_features, bias=False) -> module the model builds its projections with, given config.json's
    `quantization_config` (a dict), or None when a model-dtype checkpoint is quantized as it loads
    (`--quantization` on a bf16 checkpoint, or dummy weights). Plugin API 2.4."""

    quantization: str

    @classmethod
    def for_checkpoint(cls, quantization_config: Mapping[str, Any] | None) -> Callable[..., torch.nn.Module]: ...


@runtime_checkable
class CpuDtypePreferring(Protocol):
    """A quantized linear class whose product on the CPU is fast in one activation dtype (`cpu_dtype`):
    with `--dtype auto` on the CPU the run takes it instead of float32 (4-bit weights: torch's int4 matmul
    runs in bf16). Plugin API 2.4."""

    cpu_dtype: torch.dtype


@runtime_checkable
class PushingMatmul(Protocol):
    pushes: bool


M = TypeVar("M", bound=Callable[..., Any])


def pushing(matmul: M) -> M:
    """Declare `matmul` (a function, or a method such as `FusingActivation.down`) a `PushingMatmul`: it takes
    `push=`, where it stores a one-token partial sum into the ranks' exchange."""
    matmul.pushes = True  # type: ignore[attr-defined]  # a function's own attribute, which no type can declare
    return matmul


def pushes_partial_sums(matmul: Any) -> bool:
    """Whether `matmul` (a function, or a bound method such as `FusingActivation.down`) is a `PushingMatmul`
    whose `pushes` is true."""
    fn = matmul.__func__ if inspect.ismethod(matmul) else matmul  # a bound method's attributes are its function's
    return isinstance(fn, PushingMatmul) and bool(fn.pushes)


@runtime_checkable
class PlainRMSNorm(Protocol):
    """An rms_norm layer that is weight * x / rms(x) with its `weight` ([hidden]) and `eps` read as they
    are, when `plain_rms_norm` is true: the tensor-parallel reduce may then compute it in its own kernel,
    fused with the all-reduce and the residual add. A norm that changes the formula sets it False (or
    leaves it out: it is then always applied by its own forward). `weight` and `eps` are not members:
    `isinstance` does not see a module's parameters on Python 3.12 on (it reads attributes statically)."""

    plain_rms_norm: bool


@runtime_checkable
class QuantizingNorm(Protocol):
    """An rms_norm layer that can store its output quantized per row, for a linear after it that
    `TakesQuantizedInput`: the model sets `quantize_output` (False until then) where that is so."""

    quantize_output: bool


@runtime_checkable
class TakesQuantizedInput(Protocol):
    """A (quantized) linear layer that may take its input quantized by the norm before it, when
    `takes_quantized_input` is true (a `QuantizingNorm` then hands it so)."""

    takes_quantized_input: bool


@runtime_checkable
class GatedLinear(Protocol):
    """A linear layer that, as an MLP's down projection, applies the activation itself: `gated(h)` is
    self(act(h)) for h = [gate | up], where `fuses_activation` names the activation's layer kind
    ("silu_and_mul")."""

    fuses_activation: str

    def gated(self, h: torch.Tensor) -> torch.Tensor: ...


class CausalLM(Protocol):
    """A model as the runner sees it: a torch.nn.Module (the runner reads its parameters and buffers)."""

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64, sequences one after another
        positions: torch.Tensor,  # [T] int64
        kv_caches: list[KVCache],  # one per layer that runs (a pipeline stage: one per layer of its own)
        num_layers: int | None = None,  # run only the first layers (early exit, self-draft); None: all
        # (2.7) a pipeline stage after the first starts from the stage before's output and residual; a
        # stage before the last returns its own as a StageActivations. A model without a pipeline-parallel
        # form (no `stage` argument) never gets it
        carried: StageActivations | None = None,
    ) -> torch.Tensor | StageActivations: ...  # [T, hidden], after the final norm

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...  # [B, hidden] -> [B, vocab] float32

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        """Copy (HF name, tensor or safetensors slice) pairs into the parameters; returns the names of
        the parameters filled (the loader fails on any left out)."""
        ...


@runtime_checkable
class CheckpointShapes(Protocol):
    """Optional: a model that says which shape each checkpoint tensor must have, so the loader checks
    the safetensors headers against the config before reading any weight."""

    def checkpoint_shape(self, name: str) -> tuple[int, ...] | None:
        """The full (unsharded) shape of checkpoint tensor `name`; None for a tensor the model ignores."""
        ...


class ModelArchitecture(Protocol):
    """Builds a model of one family. `attention` is None for a model built on the meta device for its
    shapes; under tensor parallelism an architecture that accepts `parallel=` gets the rank's
    ParallelState, and under pipeline parallelism one that accepts `stage=` its `PipelineStage`. Optional abilities: `HFArchitectures.hf_architectures` lists the config.json names
    it serves; `ModelPresets.presets` maps named shapes (`llama2-7b`) to config.json-style dicts;
    `KitConfig.kit_config` tunes the model kit's tiny checkpoints. A model built is a `CausalLM`, and may
    be a `DecoderStack` (for the kit) and `CheckpointShapes` (for the loader)."""

    def __call__(self, config: ModelConfig, layers: Layers, attention: AttentionBackend | None) -> CausalLM: ...


@runtime_checkable
class HFArchitectures(Protocol):
    hf_architectures: tuple[str, ...]


@runtime_checkable
class ModelPresets(Protocol):
    presets: dict[str, dict[str, Any]]


@runtime_checkable
class DecoderStack(Protocol):
    """Optional: a model whose embedding and decoder layers can be watched with forward hooks, so that
    the model kit (`pytest --infer-kit model=NAME`) names the first layer whose output differs from HF
    transformers' on a tp = 1 prefill; without it the kit can only say that the logits differ."""

    embed_tokens: torch.nn.Module  # ids [T] -> [T, hidden]: the table's rows, as HF's get_input_embeddings()
    # in order; each returns the hidden state after it, [T, hidden], or a pair whose sum is that state
    # (x, residual: the residual add deferred to the next layer's norm)
    layers: Sequence[torch.nn.Module]


@runtime_checkable
class KitConfig(Protocol):
    """Optional: config fields the model kit sets on its tiny random checkpoint of each HF architecture
    (over its own small sizes), so that it exercises what those leave out: a RoPE scaling, tied
    embeddings, a sliding window shorter than its prompts."""

    kit_config: dict[str, dict[str, Any]]  # HF architecture -> config.json fields


RegisterFn = Callable[[str, Any], None]  # register(name, factory)
