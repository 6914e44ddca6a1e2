"""The engine options of `run`, `bench` and `doctor`, and the checks every command's options share."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

import click

from infer.core.config import EngineConfig


def _slot_help(what: str, builtin: str) -> str:
    return f"{what}: {builtin}, or a plugin's (`infer plugins` lists every installed name)."


DTYPE_CHOICES = ["auto", "float32", "float16", "bfloat16", "fp32", "fp16", "half", "bf16"]

ENGINE_OPTIONS: list[Callable[[Callable[..., Any]], Callable[..., Any]]] = [
    click.option(
        "--model", default="smollm2-135m", show_default=True, help="Named model or shape, or an HF model folder."
    ),
    click.option(
        "--revision",
        default=None,
        help="For an HF repo id (org/name): the branch, tag or commit to load.  [default: main]",
    ),
    click.option(
        "--chat-template",
        default=None,
        help="A jinja chat template (a file's path, or the text itself) replacing the model's.",
    ),
    click.option(
        "--load-format",
        type=click.Choice(["auto", "safetensors", "dummy"]),
        default="auto",
        show_default=True,
        help="dummy: random weights of the model's shape.",
    ),
    click.option(
        "--dtype",
        type=click.Choice(DTYPE_CHOICES),
        default="auto",
        show_default=True,
        help="Weights and activations; auto: bfloat16 on CUDA, float32 on the CPU.",
    ),
    click.option("--device", default="auto", show_default=True, help="auto, cpu, cuda, cuda:N."),
    click.option(
        "--attention",
        default="auto",
        show_default=True,
        help=_slot_help(
            "Attention backend", "auto (the fastest that runs here), torch, paged-cuda, flashinfer, xformers"
        ),
    ),
    click.option(
        "--prefill-attention",
        default=None,
        help=_slot_help(
            "A different backend for prefill, composed with --attention", "torch, paged-cuda, flashinfer, xformers"
        ),
    ),
    click.option(
        "--kv-allocator", default="paged", show_default=True, help=_slot_help("KV block allocator", "paged, contiguous")
    ),
    click.option("--scheduler", default="fcfs", show_default=True, help=_slot_help("Scheduler", "fcfs, static")),
    click.option("--sampler", default="vectorized", show_default=True, help=_slot_help("Sampler", "vectorized, naive")),
    click.option(
        "--decoding",
        default="autoregressive",
        show_default=True,
        help=_slot_help("Decoder", "autoregressive, speculative (with --draft), early-exit (with --exit-layer)"),
    ),
    click.option(
        "--detokenizer", default="parallel", show_default=True, help=_slot_help("Detokenizer", "parallel, sequential")
    ),
    click.option("--block-size", type=int, default=16, show_default=True, help="Tokens per KV block (a power of two)."),
    click.option(
        "--num-kv-blocks",
        type=int,
        default=None,
        help="Fix the KV cache size in blocks (it must hold one request of --max-model-len).",
    ),
    click.option(
        "--kv-cache-memory",
        "kv_cache_memory_gib",
        type=float,
        default=None,
        help="KV cache budget in GiB (default: 1 GiB on the CPU; on a GPU, --gpu-memory-utilization of its memory less what is in use).",
    ),
    click.option(
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        show_default=True,
        help="Fraction of the GPU's memory the engine may use (weights, activations, KV cache), in (0, 1].",
    ),
    click.option(
        "--prefix-caching/--no-prefix-caching",
        "enable_prefix_caching",
        default=True,
        show_default=True,
        help="Reuse the KV blocks of cached prompt prefixes.",
    ),
    click.option(
        "--preemption-mode",
        type=click.Choice(["recompute", "swap"]),
        default="recompute",
        show_default=True,
        help="What a preempted request's KV blocks do: freed and recomputed, or swapped to CPU memory.",
    ),
    click.option(
        "--swap-space",
        "swap_space_gib",
        type=float,
        default=4.0,
        show_default=True,
        help="CPU KV pool in GiB for --preemption-mode swap (recompute when it is full).",
    ),
    click.option("--max-num-seqs", type=int, default=256, show_default=True, help="Requests running at once, at most."),
    click.option(
        "--max-num-batched-tokens",
        type=int,
        default=4096,
        show_default=True,
        help="Tokens computed per step at most (longer prompts are chunked).",
    ),
    click.option(
        "--max-model-len", type=int, default=None, help="Context length, prompt and output (default: the model's)."
    ),
    click.option("--tp", "tensor_parallel_size", type=int, default=1, show_default=True, help="Tensor-parallel ranks."),
    click.option(
        "--all-reduce",
        type=click.Choice(["auto", "nccl", "symm-mem", "flashinfer"]),
        default="auto",
        show_default=True,
        help="How --tp sums: symm-mem (one-shot kernel over peer memory), flashinfer (fused with the residual add "
        "and RMSNorm), nccl, or auto (flashinfer, else symm-mem, whichever can run first).",
    ),
    click.option(
        "--draft",
        default=None,
        help="For --decoding speculative: a model of the target's vocabulary, ngram, or self (with --exit-layer).",
    ),
    click.option(
        "--num-speculative-tokens",
        type=int,
        default=4,
        show_default=True,
        help="Draft tokens verified per request per step.",
    ),
    click.option(
        "--exit-layer", type=int, default=None, help="Decoder layers kept by --decoding early-exit or --draft self."
    ),
    click.option(
        "--cuda-graphs/--no-cuda-graphs",
        default=True,
        show_default=True,
        help="Capture decode steps in CUDA graphs where the attention backend allows.",
    ),
    click.option(
        "--pipeline-decode/--no-pipeline-decode",
        default=None,
        help="Queue each decode step's forward before the step before's tokens reach the host (default: on CUDA).",
    ),
    click.option("--seed", type=int, default=0, show_default=True, help="Seeds dummy weights and unseeded sampling."),
]


def engine_options(f: Callable[..., Any]) -> Callable[..., Any]:
    for option in reversed(ENGINE_OPTIONS):
        f = option(f)
    return f


def engine_config(options: dict[str, Any]) -> EngineConfig:
    """The engine options as parsed (one keyword per field) -> an EngineConfig, not yet validated."""
    return EngineConfig().replace(**options)


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
