"""Run configuration: what the user chose (EngineConfig) and what the model is (ModelConfig)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal

import torch

from infer.api.errors import ConfigError
from infer.api.options import check_fields, check_known, parse_option

if TYPE_CHECKING:
    from infer.api.rope import Rope

LoadFormat = Literal["auto", "safetensors", "dummy"]
PreemptionMode = Literal["recompute", "swap"]
KVCacheDtype = Literal["auto", "fp8"]  # fp8: e4m3 (torch.float8_e4m3fn), one scale per layer for K and for V
ALL_REDUCE = ("auto", "nccl", "symm-mem", "flashinfer")  # --all-reduce choices

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "fp32": torch.float32,
    "fp16": torch.float16,
    "half": torch.float16,
    "bf16": torch.bfloat16,
}
CHOICES = {"dtype": ("auto", *DTYPES), "all_reduce": ALL_REDUCE}  # str fields validate() holds to names


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Everything a run is built from. Strings name strategies; the registry resolves them once."""

    model: str = "smollm2-135m"  # named shape, cached model name, HF repo id (org/name), or HF-style folder
    revision: str | None = None  # an HF repo id's branch, tag or commit; None: main
    model_impl: str = "auto"  # the model plugin that runs --model; auto: the one claiming its architecture
    chat_template: str | None = None  # a jinja file's path, or the template's text; None: the model's own
    tokenizer: str | None = None  # another model's tokenizer (as --model names one); None: the model's own
    load_format: LoadFormat = "auto"  # dummy: random weights of the model's shape
    dtype: str = "auto"  # auto: bfloat16 on CUDA, float32 on the CPU
    device: str = "auto"  # auto: cuda when available, else cpu
    attention: str = "auto"  # decode (and default prefill) attention backend
    prefill_attention: str | None = None  # a different backend for prefill, composed with `attention`
    kv_allocator: str = "paged"
    scheduler: str = "fcfs"
    sampler: str = "vectorized"
    decoding: str = "autoregressive"
    detokenizer: str = "parallel"
    block_size: int = 16  # tokens per KV block
    num_kv_blocks: int | None = None  # override the budget (tests force preemption with it)
    kv_cache_memory_gib: float | None = None  # KV budget; default: 1 GiB on CPU, 90% of free GPU memory
    kv_cache_dtype: KVCacheDtype = "auto"  # auto: the model's dtype; fp8: 1 byte an element (twice bf16's blocks)
    quantization: str | None = None  # linear weights: a layers plugin's scheme (fp8); None: as the checkpoint
    enable_prefix_caching: bool = True  # reuse the KV blocks of a cached prompt prefix
    preemption_mode: PreemptionMode = "recompute"  # recompute | swap (to a CPU pool; recompute when it is full)
    swap_space_gib: float = 4.0  # CPU KV pool for --preemption-mode swap
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 256  # running requests at most
    # a request of priority p ranks as if it had arrived p x this many seconds later (lower ranks run
    # first): a priority level is worth this much waiting, so a request waits at most
    # (its priority - a later arrival's) x this behind any later arrival. A queue longer than this erases
    # a level's lead (at 10 s, a 60 s queue left high priority 24 s ahead of low, not 60): a minute by default
    priority_aging_s: float = 60.0
    max_num_batched_tokens: int = 4096  # tokens computed per step at most (long prompts are chunked)
    # a step's target time: the per-step token budget shrinks (never below 16 tokens, never above
    # max_num_batched_tokens) to what the device computes in this time, so one long prompt cannot
    # freeze the other requests' streams on a slow device; None: max_num_batched_tokens always
    max_step_ms: float | None = None
    # an output constraint (grammar) compiles beside the step loop; a request waits for it at most this long
    structured_compile_timeout_s: float = 10.0
    max_model_len: int | None = None  # default: the model's context length
    seed: int = 0  # seeds dummy weights and unseeded sampling
    # torch's threads on the CPU; None: INFER_CPU_THREADS, else the cores this process may use (affinity, a
    # cgroup's quota), one when other processes keep them busy (infer.common.cpus)
    cpu_threads: int | None = None
    cuda_graphs: bool = True
    # steps with prompt tokens replay a graph too, up to this many tokens (0: decode steps only)
    cuda_graph_max_tokens: int = 512
    pipeline_decode: bool | None = (
        None  # queue the next decode forward before this step's tokens reach the host; None: on CUDA
    )
    tensor_parallel_size: int = 1
    # pipeline stages (--pp): each holding a contiguous run of the layers over --tp ranks; a step's tokens
    # cross them in micro-batches (pipeline_micro_batches; None: one per stage), so the stages work at once
    pipeline_parallel_size: int = 1
    pipeline_micro_batches: int | None = None
    all_reduce: str = "auto"  # tensor parallelism's all-reduce: auto | nccl | symm-mem | flashinfer
    draft: str | None = None  # draft model for speculative decoding
    num_speculative_tokens: int = 4
    exit_layer: int | None = None  # early exit: layers kept
    # adapters (`infer.api.adapters`): requests may name one (LoRARequest); `max_loras` of them run in
    # a step, in device slots, the least recently used evicted to host memory (at most max_cpu_loras)
    enable_lora: bool = False
    adapter: str = "lora"  # the adapter kind (its plugin reads the folders and applies them)
    max_loras: int = 4
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # None: as many as max_loras

    def validate(self) -> None:
        """Every field's type and range, then the names a string field must be one of."""
        check_fields(self)
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ConfigError(
                f"--max-cpu-loras {self.max_cpu_loras} is under --max-loras {self.max_loras}: host memory keeps at "
                f"least the adapters in device slots; use --max-cpu-loras {self.max_loras} or more"
            )
        if not self.priority_aging_s > 0:  # also refuses NaN
            raise ConfigError(f"--priority-aging-s {self.priority_aging_s}: use a number of seconds > 0")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ConfigError(f"unknown --dtype {self.dtype!r}: use one of auto, {', '.join(sorted(set(DTYPES)))}")
        if self.all_reduce not in ALL_REDUCE:
            raise ConfigError(
                f"unknown --all-reduce {self.all_reduce!r}: use {', '.join(ALL_REDUCE[:-1])} or {ALL_REDUCE[-1]}"
            )

    @classmethod
    def parse_option(cls, name: str, text: str, where: str) -> Any:
        """A field's value from text (`--baseline`, `bench --matrix`), converted by its declared type."""
        return parse_option(cls, name, text, where)

    @property
    def world_size(self) -> int:
        """The processes one engine runs: tensor-parallel ranks times pipeline stages."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def replace(self, **changes: Any) -> "EngineConfig":
        check_known(type(self), list(changes))
        return replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def digest(self) -> str:
        """A short hash of the configuration, bound into every log record of the run."""
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()[:12]

    def resolve_device(self, require_present: bool = True) -> torch.device:
        """require_present=False: the device named, present or not (what would run on it)."""
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        try:
            device = torch.device(self.device)
        except RuntimeError as exc:
            raise ConfigError(f"unknown --device {self.device!r}: use cpu, cuda or cuda:N") from exc
        if device.type not in ("cpu", "cuda"):
            raise ConfigError(f"unknown --device {self.device!r}: use cpu, cuda or cuda:N")
        if device.type == "cuda" and not torch.cuda.is_available() and require_present:
            raise ConfigError("--device cuda was asked for but no CUDA device is visible: use --device cpu")
        return device

    def resolve_dtype(self, device: torch.device, model_dtype: torch.dtype | None = None) -> torch.dtype:
        if self.dtype != "auto":
            return DTYPES[self.dtype]
        if device.type == "cpu":
            return torch.float32
        return torch.bfloat16 if model_dtype in (None, torch.float32) else model_dtype


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """The engine's typed view of a transformers config (a folder's config.json, or a named preset);
    read by `infer.loading.config.model_config_from_hf`."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    # transformers' standardised RoPE settings: rope_type, rope_theta and the type's own keys
    rope_parameters: dict[str, Any] = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0})
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: torch.dtype | None = None
    name: str = ""
    # sliding-window attention: layer i attends to its last layer_windows[i] tokens (None: all of them);
    # empty when no layer is windowed
    layer_windows: tuple[int | None, ...] = ()
    attention_scale: float | None = None  # query-key scale; None: head_dim ** -0.5
    attention_soft_cap: float | None = None  # attention scores capped as cap * tanh(s / cap) (Gemma 2)
    extra: dict[str, Any] = field(default_factory=dict)

    def rope(self) -> "Rope":
        from infer.api.rope import rope_for

        return rope_for(
            self.rope_parameters,
            self.head_dim,
            self.hidden_size,
            self.num_heads,
            self.max_position_embeddings,
            f"config.json of {self.name or 'the model'}",
        )

    def context_limit(self) -> tuple[int, str]:
        """The longest context this model runs exactly (positions), and the reason it is no longer."""
        from infer.api.rope import rope_context_limit

        return rope_context_limit(self.rope_parameters, self.max_position_embeddings)

    def with_layers(self, num_layers: int) -> "ModelConfig":
        return replace(self, num_layers=num_layers, layer_windows=self.layer_windows[:num_layers])

    def sliding_windows(self) -> tuple[int, ...]:
        """The distinct windows of the windowed layers, smallest first."""
        return tuple(sorted({w for w in self.layer_windows if w is not None}))

    def within_context(self, max_model_len: int) -> "ModelConfig":
        """This config for contexts of at most max_model_len tokens: a window that long or longer
        changes nothing, so it is dropped (and any attention backend serves the layer)."""
        windows = tuple(w if w is not None and w < max_model_len else None for w in self.layer_windows)
        return replace(self, layer_windows=windows if any(w is not None for w in windows) else ())
