"""The run's models on this rank, each loaded with its attention backend and run by a `ModelRunner`:
the target's, then those its decoder builds (a draft model, or the target's first layers), and the
decoder over them. The builder calls `load_models` once its checks have passed; the runners' KV
caches are filled after it (`kv_cache.build_kv_caches`).
"""

from __future__ import annotations

from typing import Any

from infer.api import AttentionSpec, Communicator, DecoderContext
from infer.api.adapters import AdaptableModel, AdapterSpec
from infer.api.errors import ConfigError
from infer.api.kv_cache import FP8
from infer.common.log import get_logger
from infer.core.adapters import Adapters
from infer.loading.build import check_draft, load_model
from infer.loading.kv_scales import read_kv_scales
from infer.loading.loader import ModelSource, load_tokenizer, resolve_source
from infer.runtime.hybrid_attention import HybridAttention
from infer.runtime.kv_cache import kv_cache_dtype
from infer.runtime.plan import BuildPlan
from infer.runtime.runner import ModelRunner, StageRun

Models = list[tuple[ModelRunner, Any]]  # (runner, its ModelConfig) per model, in build order (target first)


def build_model(plan: BuildPlan, source: Any, model_config: Any, parallel: Communicator) -> tuple[Any, Any]:
    """One model of the run (the target or a draft) and its attention backend, weights in place
    (under tensor parallelism: this rank's heads and shards)."""
    config, composition = plan.config, plan.composition
    model_config = model_config.within_context(plan.max_model_len)  # windows as long as the context go
    kwargs = parallel.model_kwargs(source.name, source.architecture.factory, model_config)
    heads = parallel.heads(model_config.num_heads, model_config.num_kv_heads)
    spec = AttentionSpec(
        num_heads=heads.num_heads,
        num_kv_heads=heads.num_kv_heads,
        head_dim=model_config.head_dim,
        scale=model_config.attention_scale or model_config.head_dim**-0.5,
        dtype=plan.dtype,
        device=plan.device,
        block_size=config.block_size,
        max_num_seqs=plan.max_rows,
        max_model_len=plan.max_model_len,
        sliding_windows=model_config.sliding_windows(),
        soft_cap=model_config.attention_soft_cap,
        kv_cache_dtype=kv_cache_dtype(config.kv_cache_dtype, plan.dtype),
    )
    attention = composition.attention.factory(spec)
    if composition.prefill_attention is not None:
        attention = HybridAttention(composition.prefill_attention.factory(spec), attention)
    model = load_model(
        source,
        model_config,
        plan.layers,
        attention,
        plan.device,
        plan.dtype,
        config.seed,
        "parallel" in kwargs,  # a tensor-parallel rank reads its slices; a pipeline stage, its layers' tensors
        **kwargs,
    )
    return model, attention


def kv_scales(plan: BuildPlan, source: ModelSource, model_config: Any) -> list[tuple[float, float]] | None:
    """The (k_scale, v_scale) of each layer an FP8 KV cache reads with: the checkpoint's calibrated ones
    (`infer.loading.kv_scales`), or None (1.0) for a cache in the model's dtype or a checkpoint without."""
    if source.path is None or kv_cache_dtype(plan.config.kv_cache_dtype, plan.dtype) != FP8:
        return None
    scales = read_kv_scales(source.path, model_config.num_layers)
    if scales is not None:
        get_logger(model=source.name).info("FP8 KV cache reads the checkpoint's calibrated scales", layers=len(scales))
    return scales


def check_draft_source(plan: BuildPlan, name_or_path: str | None = None) -> ModelSource:
    """The draft model's source, found and checked against the target (config.json and the weights'
    headers, no weights)."""
    draft_source = resolve_source(name_or_path or str(plan.config.draft), plan.registry, plan.config.load_format)
    check_draft(draft_source, plan.source.name, plan.model_config, plan.max_model_len, plan.layers)
    return draft_source


def attach_adapters(plan: BuildPlan, model: Any, parallel: Communicator) -> Adapters:
    """The adapter kind (`--adapter`) built over the target model's projections, its layers attached to
    them, and the run's adapters over its device slots (`--enable-lora`)."""
    config = plan.config
    if not isinstance(model, AdaptableModel):
        raise ConfigError(
            f"--enable-lora: model plugin {plan.source.architecture.name} lets no adapter change it (it is no "
            f"infer.api.AdaptableModel): drop --enable-lora, or use a model plugin that serves adapters"
        )
    assert plan.composition.adapter is not None, "composed with --enable-lora"
    most = max(config.max_num_batched_tokens, config.cuda_graph_max_tokens, plan.max_rows)
    spec = AdapterSpec(
        targets=tuple(model.adapter_targets()),
        max_adapters=config.max_loras,
        max_rank=config.max_lora_rank,
        dtype=plan.dtype,
        device=plan.device,
        max_tokens=most + plan.max_rows,  # a step's budget, and the decodes and proposals beside it
        rank=parallel.rank,
        world_size=parallel.world_size,
        all_reduce=parallel.all_reduce if parallel.is_parallel else None,
    )
    kind = plan.composition.adapter.factory(spec)
    model.attach_adapters(kind.layers())
    return Adapters(kind, config.max_loras, config.max_cpu_loras)


def _stages(parallel: Communicator, plan: BuildPlan, model_config: Any) -> StageRun | None:
    """How a runner of this model crosses the pipeline stages (`--pp N > 1`), or None."""
    link, stage = parallel.link, parallel.stage(model_config.num_layers)
    if link is None or stage is None:
        return None
    micro = plan.config.pipeline_micro_batches or stage.num_stages
    return StageRun(link, stage, micro, model_config.hidden_size, model_config.vocab_size, plan.dtype)


def load_models(plan: BuildPlan, parallel: Communicator) -> tuple[Models, Any, Any]:
    """The target's runner, the decoder (with the runners of the models it builds: drafts), each
    with its model config, and the tokenizer. The runners' KV caches are still empty: the decoder may
    set the layers that run (early exit) or add models (a draft) whose caches are indexed by the same
    block tables, so a block costs every model's bytes. Each runner's list is filled in place later
    (a self-draft shares the target's)."""
    config, composition, device = plan.config, plan.composition, plan.device
    scales = kv_scales(plan, plan.source, plan.model_config)  # read (and checked) before the weights
    model, attention = build_model(plan, plan.source, plan.model_config, parallel)
    tokenizer = load_tokenizer(plan.source.tokenizer_path)
    if tokenizer is not None and plan.chat_template is not None:
        tokenizer.chat_template = plan.chat_template
    sampler = composition.sampler.factory(plan.model_config.vocab_size, device)
    adapters = attach_adapters(plan, model, parallel) if config.enable_lora else None
    runner = ModelRunner(
        model, attention, [], sampler, config.block_size, device,
        executor=parallel.executor(0), waits=plan.waits, kv_scales=scales, pools=True, adapters=adapters,
        stages=_stages(parallel, plan, plan.model_config),
    )  # fmt: skip
    models: Models = [(runner, plan.model_config)]
    draft_source = plan.draft_source

    def build_draft(name_or_path: str, num_layers: int | None = None) -> ModelRunner:
        nonlocal draft_source
        if draft_source is None or name_or_path != config.draft:  # checked before when it is --draft
            draft_source = check_draft_source(plan, name_or_path)
        draft_config = draft_source.model_config()
        if num_layers is not None:
            draft_config = draft_config.with_layers(num_layers)
        draft_scales = kv_scales(plan, draft_source, draft_config)
        draft_model, draft_attention = build_model(plan, draft_source, draft_config, parallel)
        draft_sampler = composition.sampler.factory(draft_config.vocab_size, device)
        executor = parallel.executor(len(models))
        draft = ModelRunner(
            draft_model, draft_attention, [], draft_sampler, config.block_size, device,
            executor=executor, waits=plan.waits, kv_scales=draft_scales,
            stages=_stages(parallel, plan, draft_config),
        )  # fmt: skip
        models.append((draft, draft_config))
        return draft

    def share_model(num_layers: int) -> ModelRunner:  # its own model id: every rank replays its own graphs
        shared = ModelRunner(
            model, attention, runner.kv_caches, sampler, config.block_size, device, num_layers,
            executor=parallel.executor(len(models)), waits=plan.waits,
            kv_scales=runner.kv_scales,  # its cache is the target's (allocated with these)
            adapters=adapters,  # its model is the target's, whose layers call the adapters
        )  # fmt: skip
        models.append((shared, plan.model_config))
        return shared

    context = DecoderContext(runner, config, build_draft, plan.model_config, share_model, plan.waits)
    decoder = composition.decoding.factory(context)
    return models, decoder, tokenizer
