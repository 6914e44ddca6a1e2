"""The engine options of `run`, `bench` and `doctor`, one per EngineConfig field (the flag, type, default
and choices come from the field; only the help texts live here), and the output-path check."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, Callable

import click

from infer.api.config import CHOICES, EngineConfig
from infer.api.options import FieldType, field_types, flag
from infer.api.vllm import ENGINE, Alias
from infer.api.vllm import engine_options as vllm_names


def _slot_help(what: str, builtin: str) -> str:
    return f"{what}: {builtin}, or a plugin's (`infer plugins` lists every installed name)."


HELP: dict[str, str] = {  # EngineConfig field -> help, in the order `--help` lists the options
    "model": "Named model or shape, an HF model folder, or an HF repo id (org/name) in the HF cache.",
    "revision": "For an HF repo id (org/name): the branch, tag or commit to load.  [default: main]",
    "model_impl": "The model plugin that runs --model (one that claims its architecture); auto: the first that "
    "claims it. `infer plugins` lists them.",
    "chat_template": "A jinja chat template (a file's path, or the text itself) replacing the model's.",
    "tokenizer": "Another model's tokenizer (a folder, cached model or HF repo id); ids past it are never generated.",
    "load_format": "dummy: random weights of the model's shape.",
    "dtype": "Weights and activations; auto: bfloat16 on CUDA, float32 on the CPU.",
    "device": "auto, cpu, cuda, cuda:N.",
    "attention": _slot_help(
        "Attention backend", "auto (the fastest that runs here), torch, paged-cuda, flashinfer, xformers"
    ),
    "prefill_attention": _slot_help(
        "A different backend for prefill, composed with --attention", "torch, paged-cuda, flashinfer, xformers"
    ),
    "kv_allocator": _slot_help("KV block allocator", "paged, contiguous"),
    "scheduler": _slot_help("Scheduler", "fcfs, static"),
    "sampler": _slot_help("Sampler", "vectorized, naive"),
    "decoding": _slot_help("Decoder", "autoregressive, speculative (with --draft), early-exit (with --exit-layer)"),
    "detokenizer": _slot_help("Detokenizer", "parallel, sequential"),
    "block_size": "Tokens per KV block (a power of two).",
    "num_kv_blocks": "Fix the KV cache size in blocks (it must hold one request of --max-model-len).",
    "kv_cache_memory_gib": "KV cache budget in GiB (default: 1 GiB on the CPU; on a GPU, --gpu-memory-utilization "
    "of its memory less what is in use).",
    "kv_cache_dtype": "KV cache elements: auto (the model's dtype), or fp8 (e4m3 with a scale per layer: half of "
    "bf16's bytes, twice the blocks). Attention backends with fp8-kv in `infer plugins` read it.",
    "quantization": "Linear layers' weights: fp8 (e4m3 with a scale per output channel: half of bf16's bytes; "
    "a bf16 checkpoint is quantized as it loads); gptq, awq, w4a16 (4-bit weights in groups: GPTQ, AWQ and "
    "compressed-tensors checkpoints, or a bf16 one rounded to nearest as it loads); or a scheme a layers plugin "
    "adds. Default: as the checkpoint.",
    "gpu_memory_utilization": "Fraction of the GPU's memory the engine may use (weights, activations, KV cache), "
    "in (0, 1].",
    "enable_prefix_caching": "Reuse the KV blocks of cached prompt prefixes.",
    "preemption_mode": "What a preempted request's KV blocks do: freed and recomputed, or swapped to CPU memory.",
    "swap_space_gib": "CPU KV pool in GiB for --preemption-mode swap (recompute when it is full).",
    "max_num_seqs": "Requests running at once, at most.",
    "priority_aging_s": "Seconds of waiting a priority level is worth: a request of priority p ranks as if it arrived p x this later (lower values run first), so none waits more than the difference x this behind a later one.",
    "max_num_batched_tokens": "Tokens computed per step at most (longer prompts are chunked).",
    "max_step_ms": "A step's target time in ms: the per-step token budget shrinks to what the device computes in it "
    "(measured as it runs), so a long prompt cannot freeze other streams; default: none (infer serve: 500).",
    "structured_compile_timeout_s": "Seconds a request waits for its output constraint (grammar) to compile; "
    "past it the request is refused.",
    "max_model_len": "Context length, prompt and output (default: the model's).",
    "tensor_parallel_size": "Tensor-parallel ranks.",
    "pipeline_parallel_size": "Pipeline stages, each holding a contiguous run of the layers over --tp ranks "
    "(--tp x --pp processes in all).",
    "pipeline_micro_batches": "Micro-batches a step's tokens cross the pipeline stages in, so that the stages "
    "work at once (default: one per stage).",
    "all_reduce": "How --tp sums: symm-mem (one-shot kernel over peer memory), flashinfer (fused with the residual "
    "add and RMSNorm), nccl, or auto (flashinfer, else symm-mem, whichever can run first).",
    "draft": "For --decoding speculative: a model of the target's vocabulary, ngram, or self (with --exit-layer).",
    "num_speculative_tokens": "Draft tokens verified per request per step.",
    "exit_layer": "Decoder layers kept by --decoding early-exit or --draft self.",
    "cuda_graphs": "Capture decode steps in CUDA graphs where the attention backend allows.",
    "cuda_graph_max_tokens": "Replay steps with prompt tokens from CUDA graphs too, up to this many tokens "
    "(0: decode steps only).",
    "pipeline_decode": "Queue each decode step's forward before the step before's tokens reach the host "
    "(default: on CUDA).",
    "seed": "Seeds dummy weights and unseeded sampling.",
    "cpu_threads": "Torch's threads on the CPU (also INFER_CPU_THREADS); default: the cores this process may use "
    "(affinity, a container's quota), one when the machine is already busy (spinning threads wait on held cores).",
    "enable_lora": "Serve adapters (LoRA): requests name one, and a step mixes them with the base model.",
    "adapter": _slot_help("Adapter kind, with --enable-lora", "lora (PEFT LoRA folders)"),
    "max_loras": "Adapters a step may run, each in a device slot (the least recently used evicted to host memory).",
    "max_lora_rank": "The largest rank an adapter may have, up to 128 (device slots are this wide).",
    "max_cpu_loras": "Adapters kept in host memory, loaded or not (default: --max-loras).",
}


def engine_option(name: str, kind: FieldType, default: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A field's option: bools as --x/--no-x (a None default stays unset: the engine decides), choices
    from a Literal type or config.CHOICES, any other type as click converts it; parameter name = field."""
    text, choices = HELP.get(name, ""), kind.choices or CHOICES.get(name)
    if kind.base is bool:
        return click.option(f"{flag(name)}/--no-{flag(name)[2:]}", name, default=default, show_default=True, help=text)
    kind_of = click.Choice(list(choices)) if choices else kind.base
    return click.option(flag(name), name, type=kind_of, default=default, show_default=True, help=text)


def _engine_options() -> dict[str, Callable[[Callable[..., Any]], Callable[..., Any]]]:
    fields = {f.name: f for f in dataclasses.fields(EngineConfig)}
    kinds = field_types(EngineConfig)
    order = [n for n in HELP if n in fields] + [n for n in fields if n not in HELP]
    return {n: engine_option(n, kinds[n], fields[n].default) for n in order}


def _vllm_options() -> dict[str, Callable[[Callable[..., Any]], Callable[..., Any]]]:
    """vLLM's spellings of engine options that infer names otherwise (`infer.api.vllm.ENGINE`), hidden from
    --help: each fills the parameter `vllm_<name>`, which `engine_config` turns into infer's field."""
    kinds = field_types(EngineConfig)
    flags = {flag(n) for n in kinds} | {f"--no-{flag(n)[2:]}" for n in kinds if kinds[n].base is bool}
    found = {}
    for row in ENGINE:
        name = f"--{row.vllm.replace('_', '-')}"
        if not isinstance(row, Alias) or name in flags or len(row.vllm) < 3:
            continue
        kind = kinds[row.infer]
        text = f"vLLM's spelling of {flag(row.infer)}{': ' + row.note if row.note else ''} (docs/vllm.md)."
        if kind.base is bool or row.switch:
            option = click.option(f"{name}/--no-{name[2:]}", f"vllm_{row.vllm}", default=None, hidden=True, help=text)
        else:
            kind_of = float if row.convert else kind.base
            option = click.option(name, f"vllm_{row.vllm}", type=kind_of, hidden=True, help=text)
        found[f"vllm_{row.vllm}"] = option
    return found


ENGINE_OPTIONS = _engine_options() | _vllm_options()  # field (or vllm_<name>) -> its option, in `--help` order


def engine_options(f: Callable[..., Any]) -> Callable[..., Any]:
    for option in reversed(ENGINE_OPTIONS.values()):
        f = option(f)
    return f


def engine_options_except(*names: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """engine_options without the named fields' options, for a command that takes those its own way."""

    def decorate(f: Callable[..., Any]) -> Callable[..., Any]:
        for name, option in reversed(ENGINE_OPTIONS.items()):
            if name not in names:
                f = option(f)
        return f

    return decorate


def engine_config(options: dict[str, Any]) -> EngineConfig:
    """The engine options as parsed (one keyword per field, and vLLM's spellings given) -> an EngineConfig, not
    yet validated."""
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    given = {k: v for k, v in options.items() if not k.startswith("vllm_")}
    vllm = {k.removeprefix("vllm_"): v for k, v in options.items() if k.startswith("vllm_") and v is not None}
    for key, value in vllm_names(vllm, fields).items():
        given[key] = value  # vLLM's spelling, given, over infer's default
    return EngineConfig().replace(**given)


def writable(ctx: click.Context, param: click.Parameter, path: Path | None) -> Path | None:
    """An output path is checked when the flags are read, not after the run whose results it would hold."""
    if path is None:
        return None
    folder = path.parent if str(path.parent) else Path(".")
    if not folder.is_dir():
        raise click.BadParameter(f"folder {folder} does not exist: create it or write elsewhere", ctx, param)
    if path.is_dir():
        raise click.BadParameter(f"{path} is a folder: name a file in it", ctx, param)
    if not os.access(path if path.exists() else folder, os.W_OK):
        raise click.BadParameter(f"{path if path.exists() else folder} is not writable: write elsewhere", ctx, param)
    return path
