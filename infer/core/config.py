"""Run configuration: what the user chose (EngineConfig) and what the model is (ModelConfig)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal

import torch

from infer.core.config_fields import check_fields, check_known, parse_option
from infer.core.errors import ConfigError

LoadFormat = Literal["auto", "safetensors", "dummy"]
PreemptionMode = Literal["recompute", "swap"]
ALL_REDUCE = ("auto", "nccl", "symm-mem", "flashinfer")  # --all-reduce choices

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Everything a run is built from. Strings name strategies; the registry resolves them once."""

    model: str = "smollm2-135m"  # named shape, cached model name, or HF-style folder
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
    enable_prefix_caching: bool = True  # reuse the KV blocks of a cached prompt prefix
    preemption_mode: PreemptionMode = "recompute"  # recompute | swap (to a CPU pool; recompute when it is full)
    swap_space_gib: float = 4.0  # CPU KV pool for --preemption-mode swap
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 256  # running requests at most
    max_num_batched_tokens: int = 4096  # tokens computed per step at most (long prompts are chunked)
    max_model_len: int | None = None  # default: the model's context length
    seed: int = 0  # seeds dummy weights and unseeded sampling
    cuda_graphs: bool = True
    pipeline_decode: bool | None = None  # queue the next decode forward before this step's tokens reach the host; None: on CUDA
    tensor_parallel_size: int = 1
    all_reduce: str = "auto"  # tensor parallelism's all-reduce: auto | nccl | symm-mem | flashinfer
    draft: str | None = None  # draft model for speculative decoding
    num_speculative_tokens: int = 4
    exit_layer: int | None = None  # early exit: layers kept
    trust_chat_template: bool = True

    def validate(self) -> None:
        """Every field's type and range, then the names a string field must be one of."""
        check_fields(self)
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ConfigError(f"unknown --dtype {self.dtype!r}: use one of auto, {', '.join(sorted(set(DTYPES)))}")
        if self.all_reduce not in ALL_REDUCE:
            raise ConfigError(f"unknown --all-reduce {self.all_reduce!r}: use {', '.join(ALL_REDUCE[:-1])} or {ALL_REDUCE[-1]}")

    @classmethod
    def parse_option(cls, name: str, text: str, where: str) -> Any:
        """A field's value from text (`--baseline`, `bench --matrix`), converted by its declared type."""
        return parse_option(cls, name, text, where)

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
    """The architecture's numbers, read from config.json (or a named preset)."""

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
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: torch.dtype | None = None
    name: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_hf(cls, hf: dict[str, Any], name: str = "") -> "ModelConfig":
        try:
            num_heads = int(hf["num_attention_heads"])
            hidden = int(hf["hidden_size"])
            eos = hf.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
            dtype = DTYPES.get(str(hf.get("torch_dtype") or hf.get("dtype") or ""), None)
            return cls(
                architecture=(hf.get("architectures") or ["LlamaForCausalLM"])[0],
                vocab_size=int(hf["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(hf["intermediate_size"]),
                num_layers=int(hf["num_hidden_layers"]),
                num_heads=num_heads,
                num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
                head_dim=int(hf.get("head_dim") or hidden // num_heads),
                max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
                rms_norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
                rope_theta=float(hf.get("rope_theta", 10000.0)),
                rope_scaling=hf.get("rope_scaling"),
                tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
                bos_token_id=hf.get("bos_token_id"),
                eos_token_ids=eos_ids,
                torch_dtype=dtype,
                name=name,
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"model config for {name or 'the model'} is missing or has a bad field ({exc}): check config.json") from exc

    def with_layers(self, num_layers: int) -> "ModelConfig":
        return replace(self, num_layers=num_layers)
