"""vLLM's names, as a vLLM user writes them: each works the same in infer (an alias of infer's own name) or
is refused with one line naming infer's equivalent, or why it has none. docs/vllm.md is this table in
prose; tests/test_vllm_names.py walks every row.

`ENGINE` holds the engine's options, the same for `LLM(...)` keywords and `infer run` / `infer serve`
flags (a keyword's flag is its name with dashes: `tensor_parallel_size`, `--tensor-parallel-size`);
`SERVE` the server's own flags. `engine_options(options)` turns a vLLM user's keywords into infer's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from infer.api.errors import ConfigError

__all__ = [
    "Alias", "Refused", "ENGINE", "SERVE", "SAMPLING", "LLM_METHODS", "engine_options", "refusal", "method_refusal",
]  # fmt: skip


@dataclass(frozen=True, slots=True)
class Alias:
    """vLLM's `vllm` name works as infer's `infer` field, its value through `convert`."""

    vllm: str
    infer: str
    convert: Callable[[Any], Any] | None = None
    note: str = ""
    switch: bool = False  # vLLM's flag takes no value (store_true), whatever infer's field holds


@dataclass(frozen=True, slots=True)
class Refused:
    """vLLM's `vllm` name has no working equivalent here; `why` says what to do instead."""

    vllm: str
    why: str


def _not(value: Any) -> Any:
    return not value


SAME = (  # vLLM's engine options that infer spells the same and that do the same
    "model",
    "tokenizer",
    "revision",
    "dtype",
    "max_model_len",
    "block_size",
    "seed",
    "gpu_memory_utilization",
    "max_num_seqs",
    "max_num_batched_tokens",
    "quantization",
    "kv_cache_dtype",
    "enable_prefix_caching",
    "load_format",
    "model_impl",
    "enable_lora",
    "max_loras",
    "max_lora_rank",
    "max_cpu_loras",
    "num_speculative_tokens",
    "preemption_mode",
    "chat_template",
)

ENGINE: tuple[Alias | Refused, ...] = (
    *(Alias(name, name) for name in SAME),
    Alias("tensor_parallel_size", "tensor_parallel_size", note="also --tp"),
    Alias("tp", "tensor_parallel_size"),
    Alias("pipeline_parallel_size", "pipeline_parallel_size", note="also --pp"),
    Alias("pp", "pipeline_parallel_size"),
    Alias("kv_cache_memory", "kv_cache_memory_gib", note="GiB; vLLM's kv_cache_memory_bytes is bytes"),
    Alias("kv_cache_memory_bytes", "kv_cache_memory_gib", lambda v: v / 2**30),
    Alias("swap_space", "swap_space_gib", note="GiB, with --preemption-mode swap"),
    Alias("enforce_eager", "cuda_graphs", _not, note="--enforce-eager is --no-cuda-graphs"),
    Alias("prefix_caching", "enable_prefix_caching"),
    Alias("num_gpu_blocks_override", "num_kv_blocks"),
    Alias("speculative_model", "draft"),
    Alias(
        "disable_custom_all_reduce", "all_reduce", lambda v: "nccl" if v else "auto", "--all-reduce nccl", switch=True
    ),
    Refused(
        "trust_remote_code",
        "infer never runs a checkpoint's own code: its model plugins implement each architecture "
        "(`infer plugins` lists them); drop --trust-remote-code",
    ),
    Refused(
        "download_dir",
        "infer reads and downloads checkpoints through the HF cache: set HF_HUB_CACHE (or HF_HOME) to the folder",
    ),
    Refused("cpu_offload_gb", "infer keeps every weight on the device: use a smaller model or --quantization fp8"),
    Refused("tokenizer_mode", "infer loads the tokenizer transformers' AutoTokenizer picks: drop --tokenizer-mode"),
    Refused("max_logprobs", "infer takes any logprobs up to the vocabulary size: drop --max-logprobs"),
    Refused("disable_log_stats", "infer logs no periodic statistics (GET /metrics has them): drop --disable-log-stats"),
    Refused(
        "distributed_executor_backend",
        "an LLM's --tp ranks are processes of this host: drop it (infer serve --distributed-executor-backend ray "
        "places engines on Ray)",
    ),
    Refused("compilation_config", "infer captures CUDA graphs itself (--cuda-graphs, --cuda-graph-max-tokens)"),
    Refused("enable_chunked_prefill", "infer always chunks long prompts (--max-num-batched-tokens): drop it"),
    Refused("task", "one engine both generates and embeds (LLM.embed, /v1/embeddings): drop --task"),
    Refused("runner", "one engine both generates and embeds (LLM.embed, /v1/embeddings): drop --runner"),
    Refused("max_seq_len_to_capture", "--cuda-graph-max-tokens sets the steps CUDA graphs replay"),
    Refused("guided_decoding_backend", "structured output runs on xgrammar (the xgrammar logits processor): drop it"),
)

SERVE: tuple[Alias | Refused, ...] = (  # `infer` here: how infer serve spells it
    Alias("model", "MODEL", note="positional, as `vllm serve MODEL`; or --model, repeatable"),
    Alias("served_model_name", "--served-model-name NAME", note="one model; several: --model MODEL:name=NAME"),
    Alias("disable_log_requests", "--disable-log-requests", note="no access log line per request"),
    Refused("ssl_keyfile", "infer serve speaks plain HTTP on loopback: put a TLS proxy in front of it"),
    Refused("ssl_certfile", "infer serve speaks plain HTTP on loopback: put a TLS proxy in front of it"),
    Refused("uvicorn_log_level", "use `infer --log-level LEVEL serve ...`"),
    Refused("chat_template_content_format", "infer renders the chat template transformers' way: drop it"),
    Refused("enable_auto_tool_choice", "infer serve reads tool calls when --tool-call-parser is given: drop it"),
    Refused("allowed_origins", "infer serve sends no CORS headers: serve browsers through a proxy that adds them"),
    Refused("root_path", "infer serve answers at /v1: a proxy in front of it maps any prefix"),
    *(
        Alias(name, f"--{name.replace('_', '-')}")
        for name in (
            "host",
            "port",
            "api_key",
            "tool_call_parser",
            "reasoning_parser",
            "lora_modules",
            "max_waiting",
            "data_parallel_size",
            "distributed_executor_backend",
        )
    ),
)

# SamplingParams fields: vLLM's that infer's SamplingParams takes as they are, and those it refuses (a
# TypeError names an unknown keyword; a RequestError a value it refuses)
SAMPLING: tuple[Alias | Refused, ...] = (
    *(
        Alias(name, name)
        for name in (
            "n",
            "best_of",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
            "temperature",
            "top_p",
            "top_k",
            "min_p",
            "seed",
            "stop",
            "stop_token_ids",
            "ignore_eos",
            "max_tokens",
            "min_tokens",
            "logprobs",
            "prompt_logprobs",
            "detokenize",
            "skip_special_tokens",
            "include_stop_str_in_output",
            "truncate_prompt_tokens",
            "logit_bias",
            "allowed_token_ids",
            "bad_words",
            "structured_outputs",
        )
    ),
    Refused("spaces_between_special_tokens", "the text leaves special tokens out, so there is nothing to space"),
    Refused("logits_processors", "logits processors are plugins (infer_register_logits_processors), not callables"),
    Refused("output_kind", "LLM returns whole outputs; AsyncEngine.generate streams deltas"),
)

# LLM methods: vLLM's that infer's LLM has (the same call), and those it lacks (an AttributeError says why)
LLM_METHODS: tuple[Alias | Refused, ...] = (
    *(
        Alias(name, name)
        for name in ("generate", "chat", "embed", "get_tokenizer", "add_lora", "remove_lora", "list_loras")
    ),
    Refused("encode", "LLM.embed pools a prompt's hidden states (PoolingParams chooses how)"),
    Refused("beam_search", "SamplingParams(use_beam_search=True, best_of=WIDTH) with LLM.generate"),
    Refused("score", "no cross-encoder scoring here: LLM.embed and a cosine similarity"),
    Refused("classify", "no classification heads here: LLM.embed"),
    Refused("start_profile", "`infer run --profile` times each decode step by component"),
    Refused("reset_prefix_cache", "a new LLM starts with an empty prefix cache"),
    Refused("sleep", "LLM.close() gives the device memory back at once"),
)

_ENGINE = {row.vllm: row for row in ENGINE}


def method_refusal(name: str) -> str | None:
    """Why `LLM` lacks vLLM's method `name`, or None."""
    for row in LLM_METHODS:
        if row.vllm == name and isinstance(row, Refused):
            return f"vLLM's LLM.{name} has no equivalent here: {row.why}"
    return None


def refusal(name: str) -> str | None:
    """The one-line refusal for vLLM's keyword or flag `name` (dashes or underscores, leading `--`), or None."""
    key = name.lstrip("-").replace("-", "_")
    for row in (*ENGINE, *SERVE):
        if row.vllm == key and isinstance(row, Refused):
            return f"vLLM's {name} has no equivalent here: {row.why}"
    return None


def engine_options(options: dict[str, Any], known: set[str]) -> dict[str, Any]:
    """`options` (EngineConfig fields, or vLLM's names for them) as EngineConfig fields; a vLLM name
    infer refuses is a ConfigError saying why. `known`: EngineConfig's fields (left as they are)."""
    found: dict[str, Any] = {}
    for key, value in options.items():
        row = None if key in known else _ENGINE.get(key)
        if isinstance(row, Refused):
            raise ConfigError(f"vLLM's {key} has no equivalent here: {row.why}")
        if isinstance(row, Alias):
            if row.infer in options or row.infer in found:
                raise ConfigError(f"{key} and {row.infer} name the same option: give one of them")
            found[row.infer] = row.convert(value) if row.convert is not None else value
            continue
        found[key] = value
    return found
