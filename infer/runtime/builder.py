"""Build an engine from a config: check the strategies, load the models, size the KV cache, wire.

Order matters: every name and capability is checked before the model's weights are read, so a
bad combination fails in milliseconds with a message naming the fix. The checks are here; what
follows them runs in `infer.runtime` from the `BuildPlan` they settle: the models and their
runners (`runners`), the KV caches (`kv_cache`), the decode paths (`decode_paths`).
"""

from __future__ import annotations

import inspect
import time
import warnings
from typing import Any, Iterable

from infer.api import (
    AdaptableModel,
    Communicator,
    KVAllocator,
    Launch,
    ProcessorContext,
    Scheduler,
    SelfDescribing,
    SingleProcess,
)
from infer.api.config import EngineConfig
from infer.api.errors import ConfigError
from infer.api.pooling import default_pooler, matryoshka_dimensions
from infer.common import cpus, env
from infer.common.log import get_logger
from infer.core.block_mover import BlockMover
from infer.core.compose import check_model_attention, compose
from infer.core.engine import Engine, EngineParts
from infer.core.output import OutputProcessor, Pooling
from infer.core.registry import PluginRegistry
from infer.inputs.chat_template import load_chat_template
from infer.loading.loader import check_weight_shapes, meta_model, resolve_source, with_tokenizer
from infer.loading.quantization import checkpoint_quantization, quantization_for, run_dtype
from infer.runtime.decode_paths import attach_decode_paths
from infer.runtime.kv_cache import build_kv_caches, check_fits
from infer.runtime.plan import BuildPlan
from infer.runtime.runners import Models, check_draft_source, load_models


def build_engine(
    config: EngineConfig,
    extra_plugins: Iterable[Any] = (),
    launch: Launch | None = None,
    parallel: Communicator | None = None,
) -> EngineParts:
    """Check, load the models, size the KV cache, wire. `launch`: who starts the ranks of a `--tp N > 1`
    run (`infer.distributed.launch.launch`); `parallel`: this rank's place, when a launcher builds it."""
    started = time.perf_counter()
    phases: dict[str, float] = {}
    mark = [started]

    def phase(name: str) -> None:  # the time since the last phase ended
        now = time.perf_counter()
        phases[name] = round(now - mark[0], 3)
        mark[0] = now

    plan = _check(config, extra_plugins, launch, parallel)
    phase("checks")
    if config.world_size > 1 and parallel is None:  # start (or join) the ranks, then build each
        assert launch is not None, "checked by _check"
        return launch(config, extra_plugins, plan.source.name, plan.model_config, plan.device)
    governor = None
    if plan.device.type == "cpu":
        governor = _cpu_threads(config)
        if config.gpu_memory_utilization != EngineConfig().gpu_memory_utilization:  # a GPU option, given here
            get_logger().warning(
                f"--gpu-memory-utilization {config.gpu_memory_utilization} does nothing on the CPU: the KV cache "
                f"there takes --kv-cache-memory GiB (default 1)"
            )
    parallel = SingleProcess(plan.device) if parallel is None else parallel
    # every rank, in the same order: the fast all-reduce's set-up is collective
    parallel = parallel.set_up(config.all_reduce, plan.dtype, plan.model_config.hidden_size)
    log = get_logger()
    log.info(  # the slow part of a build: say so before it starts
        "loading the model", model=plan.source.name, device=str(plan.device), load_format=config.load_format
    )
    models, decoder, tokenizer = load_models(plan, parallel)
    phase("load")
    log.info("model loaded", seconds=round(time.perf_counter() - started, 2))
    for runner, _ in models:
        runner.threads = governor
    lookahead = decoder.num_lookahead_tokens
    num_blocks, block_mover = build_kv_caches(
        config, models, parallel, plan.max_model_len, lookahead, plan.dtype, plan.device
    )
    phase("kv_cache")
    allocator, scheduler = _wire(plan, models, decoder, num_blocks, block_mover)
    phase("wiring")
    detokenizer = _detokenizer(plan, tokenizer) if tokenizer is not None else None
    eos = set(plan.model_config.eos_token_ids)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        eos.add(int(tokenizer.eos_token_id))
    context = ProcessorContext(tokenizer, plan.model_config.vocab_size, frozenset(eos), plan.device, config)
    processors = tuple(s.factory(context) for s in plan.registry.all("logits_processor") if not s.unavailable_reason())
    model = models[0][0].model
    describe = {
        "model": plan.source.name,
        "device": str(plan.device),
        "dtype": str(plan.dtype).removeprefix("torch."),
        "kv_blocks": num_blocks,
        "block_size": config.block_size,
        "config_hash": config.digest(),
        "weight_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        **plan.composition.names(),
        **(decoder.describe if isinstance(decoder, SelfDescribing) else {}),
        **parallel.describe(model),
    }
    get_logger(**describe).info(
        "engine built",
        seconds=round(time.perf_counter() - started, 2),
        load_format=config.load_format,
        **{f"{name}_s": seconds for name, seconds in phases.items()},
    )
    return EngineParts(
        config=config,
        model_config=plan.model_config,
        scheduler=scheduler,
        allocator=allocator,
        decoder=decoder,
        output=OutputProcessor(detokenizer, _pooling(plan)),
        tokenizer=tokenizer,
        max_model_len=plan.max_model_len,
        vocab_size=plan.model_config.vocab_size,
        eos_token_ids=frozenset(eos),
        describe=describe,
        block_mover=block_mover,
        runners=tuple(r for r, _ in models),
        processors=processors,
        adapters=models[0][0].adapters,
        build_phases=phases,
    )


def _cpu_threads(config: EngineConfig) -> cpus.Governor | None:
    """Torch's threads for a CPU engine: --cpu-threads, INFER_CPU_THREADS, or what the machine allows now;
    then, unless the user chose, a governor that drops to one thread while other processes take the cores."""
    import torch

    asked = config.cpu_threads or env.cpu_threads()
    default = torch.get_num_threads()
    threads, warning = cpus.choose(asked, default)
    if warning is not None:
        get_logger().warning(warning)
    if threads != default:
        torch.set_num_threads(threads)
    cores = cpus.available()
    full = min(default, cores)
    if asked is not None or full < 2:
        return None
    return cpus.Governor(full, cores, current=threads)


def _pooling(plan: BuildPlan) -> Pooling:
    """Every pooler installed, the model's default and how far its embeddings may be cut."""
    poolers = {s.name: s.factory() for s in plan.registry.all("pooler") if not s.unavailable_reason()}
    default, problem = default_pooler(plan.source.path)
    return Pooling(poolers, default, matryoshka_dimensions(plan.source.hf_config), problem)


def _detokenizer(plan: BuildPlan, tokenizer: Any) -> Any:
    """The detokenizer, from `factory(tokenizer, waits)` (plugin API 2.1). A factory of API 2.0 takes the
    tokenizer alone: it still works, with a DeprecationWarning, until plugin API 3."""
    strategy = plan.composition.detokenizer
    try:  # the one place a factory's signature is read: API 2.0's form is still served, through 2.x
        inspect.signature(strategy.factory).bind(tokenizer, plan.waits)
    except TypeError:
        warnings.warn(
            f"detokenizer {strategy.name!r} ({strategy.distribution}): its factory takes (tokenizer), the plugin "
            "API 2.0 form; since 2.1 it is factory(tokenizer, waits: infer.api.DeviceWaits), and plugin API 3 "
            "calls no other: take `waits` (defer work to it, or ignore it)",
            DeprecationWarning,
            stacklevel=2,
        )
        return strategy.factory(tokenizer)
    except ValueError:  # no signature to read (a builtin): call it the 2.1 way
        pass
    return strategy.factory(tokenizer, plan.waits)


def _check(
    config: EngineConfig, extra_plugins: Iterable[Any], launch: Launch | None, parallel: Communicator | None
) -> BuildPlan:
    """Every check that needs no weights, in the order a user meets them: the config, the strategy
    names and capabilities, the model's context, its checkpoint headers, the draft, the KV cache."""
    config.validate()
    if config.world_size > 1 and parallel is None and launch is None:
        split = f"--tp {config.tensor_parallel_size}" if config.tensor_parallel_size > 1 else ""
        split += (
            f"{' ' if split else ''}--pp {config.pipeline_parallel_size}" if config.pipeline_parallel_size > 1 else ""
        )
        raise ConfigError(
            f"{split} needs a launcher to start its ranks and none was given: pass "
            "launch=infer.distributed.launch.launch to build_engine or make_engine (infer.LLM and "
            "`infer run` do), or run one process"
        )
    _check_pipeline(config)
    registry = PluginRegistry.load(extra_plugins)
    device = parallel.device if parallel is not None else config.resolve_device()
    compose(config, registry, device, config.resolve_dtype(device))  # fail fast, before any download
    chat_template = load_chat_template(config.chat_template)
    source = resolve_source(
        config.model, registry, config.load_format, revision=config.revision, model_impl=config.model_impl
    )
    source = with_tokenizer(source, config.tokenizer, registry)
    if chat_template is not None and source.tokenizer_path is None:
        raise ConfigError(
            f"--chat-template needs a tokenizer, and {source.name} has none on disk: drop --chat-template"
        )
    model_config = source.model_config()
    quantization = quantization_for(config.quantization, model_config)
    dtype = run_dtype(config, registry, device, model_config)
    if dtype != config.resolve_dtype(device, model_config.torch_dtype):
        why = f"{quantization} weights on the CPU"
        get_logger().info("dtype chosen", dtype=str(dtype).removeprefix("torch."), why=why)
    composition = compose(config, registry, device, dtype)
    context, why = model_config.context_limit()
    max_model_len = config.max_model_len or context
    if max_model_len > context:
        raise ConfigError(
            f"--max-model-len {max_model_len} exceeds {source.name}'s context of {context} tokens "
            f"({why}): use at most {context}"
        )
    check_model_attention(composition, registry, model_config, max_model_len)
    if config.exit_layer is not None and not 1 <= config.exit_layer <= model_config.num_layers:
        raise ConfigError(f"--exit-layer must be in [1, {model_config.num_layers}] for {source.name}")
    factory = source.architecture.factory
    if config.enable_lora and isinstance(factory, type) and not issubclass(factory, AdaptableModel):
        raise ConfigError(
            f"--enable-lora: model plugin {source.architecture.name} lets no adapter change it (it is no "
            f"infer.api.AdaptableModel): drop --enable-lora, or use a model plugin that serves adapters"
        )
    layers = registry.layers(device.type, quantization, checkpoint_quantization(model_config))
    if source.path is not None and parallel is None:  # once per process, before any rank starts; headers only
        check_weight_shapes(meta_model(source, model_config, layers), source.path)
    plan = BuildPlan(
        config, registry, device, dtype, composition, source, model_config, layers, max_model_len, chat_template
    )
    # every check that needs no weights comes before the first weights load: the draft's, the cache's
    needs_draft = composition.decoding.capabilities.needs_draft
    if needs_draft and config.draft not in ("ngram", "self"):
        plan.draft_source = check_draft_source(plan)
    lookahead = config.num_speculative_tokens if needs_draft else 0  # the decoder's, once built
    plan.max_rows = config.max_num_seqs * (1 + lookahead)
    if config.num_kv_blocks is not None:
        check_fits(config.num_kv_blocks, config.block_size, max_model_len, lookahead, "--num-kv-blocks")
    return plan


def _check_pipeline(config: EngineConfig) -> None:
    """What pipeline stages cannot run yet, refused before anything loads."""
    pp = config.pipeline_parallel_size
    if pp == 1:
        return
    if config.exit_layer is not None:
        raise ConfigError(
            f"--exit-layer with --pp {pp}: early exit and --draft self cut the layers that the stages split; "
            f"use --pp 1, or another --draft"
        )
    if config.enable_lora:
        raise ConfigError(f"--enable-lora with --pp {pp}: adapters are not built for pipeline stages; use --pp 1")


def _wire(
    plan: BuildPlan, models: Models, decoder: Any, num_blocks: int, block_mover: BlockMover
) -> tuple[KVAllocator, Scheduler]:
    """The allocator over the cache's blocks, the scheduler over it, and the runners' decode paths:
    CUDA graphs, and pipelining through the scheduler. Returns the allocator and the scheduler."""
    config, composition = plan.config, plan.composition
    allocator = composition.kv_allocator.factory(
        num_blocks,
        config.block_size,
        enable_prefix_caching=config.enable_prefix_caching,
        num_cpu_blocks=block_mover.num_cpu_blocks,
    )
    scheduler = composition.scheduler.factory(config, allocator)
    scheduler.num_lookahead_tokens = decoder.num_lookahead_tokens
    runners = [r for r, _ in models]
    decoder_caps = composition.decoding.capabilities
    attach_decode_paths(
        config, decoder_caps, runners, scheduler, plan.max_rows, plan.max_model_len, num_blocks, plan.device
    )
    return allocator, scheduler


def make_engine(config: EngineConfig, extra_plugins: Iterable[Any] = (), launch: Launch | None = None) -> Engine:
    """An `Engine` built from `config`. launch: who starts the ranks of a `--tp N > 1` engine
    (`infer.distributed.launch.launch`)."""
    return Engine(build_engine(config, extra_plugins, launch))
