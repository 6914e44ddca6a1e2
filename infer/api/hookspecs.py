"""The plugin contract.

A plugin is a module (or object) with `@infer.hookimpl` functions, published under the `infer`
entry-point group. Every slot has one register-callback hook; the engine calls each hook once,
when it is built, with a `register(name, factory)` callable. The factory is a class or function
that builds the strategy; its `capabilities` attribute (an `infer.Capabilities`) says what it can
do, so an impossible combination is refused before any weight loads. A plugin module may declare
the plugin API versions it was written for (`INFER_PLUGIN_API = ">=2.1,<3"`, a major as an int, or
`infer_plugin_api = (1, 2)`, a range of majors); one that does not fit `PLUGIN_API` is refused at
load and recorded as broken (see `infer.core.plugin_api`).

How each slot's factory is called:

========================  ===============================================================
slot                      factory(...) -> strategy
========================  ===============================================================
attention                 factory(spec: AttentionSpec) -> AttentionBackend
kv_allocator              factory(num_blocks: int, block_size: int, *, enable_prefix_caching: bool,
                          num_cpu_blocks: int) -> KVAllocator
scheduler                 factory(config: EngineConfig, allocator: KVAllocator) -> Scheduler
sampler                   factory(vocab_size: int, device: torch.device) -> Sampler
decoder                   factory(ctx: DecoderContext) -> Decoder
detokenizer               factory(tokenizer, waits: DeviceWaits) -> Detokenizer
model                     an architecture class: hf_architectures, presets, and
                          factory(config: ModelConfig, layers: Layers, attention) -> CausalLM
layer                     factory(*args) -> torch.nn.Module, registered under a layer kind
                          ("rms_norm", "rotary_embedding", "silu_and_mul", "linear",
                          "gelu_and_mul"); a kind a plugin leaves out is served by
                          another (the built-in torch layers register every kind);
                          rotary_embedding(rope: Rope, max_position) takes transformers'
                          frequencies and attention scaling (infer.api.rope);
                          the highest `capabilities.priority` runnable on the device wins
logits_processor          factory(ctx: ProcessorContext) -> LogitsProcessor; every one
                          installed is built, and serves the requests it admits
reasoning_parser          factory(tokenizer) -> ReasoningParser (infer.api.reasoning); the server
                          builds the one --reasoning-parser names, once per served model
pooler                    factory() -> Pooler (infer.api.pooling); every one installed is built,
                          and an embedding request names one (else the model's default)
adapter                   factory(spec: AdapterSpec) -> AdapterKind (infer.api.adapters); the one
                          --adapter names, built when the run serves adapters (--enable-lora)
========================  ===============================================================
"""

from __future__ import annotations

from typing import Any

import pluggy

from infer.api import RegisterFn

PROJECT_NAME = "infer"
# The plugin API's (major, minor) version: a minor bump only adds (what it supersedes keeps working, with a
# DeprecationWarning naming the replacement, until the next major); a major bump may remove and change.
# docs/plugins.md lists what each version changed.
PLUGIN_API = (2, 8)
PLUGIN_API_VERSION = PLUGIN_API[0]  # the major

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


@hookspec
def infer_register_attention_backends(register: RegisterFn) -> None:
    """Register attention backends: `register("paged-cuda", PagedCudaBackend)`.

    Called once per engine build. The capabilities' `phases` say whether the backend serves
    prefill, decode or both; `devices`, `dtypes` and `block_sizes` are checked against the run.
    """


@hookspec
def infer_register_kv_allocators(register: RegisterFn) -> None:
    """Register KV block allocators: `register("paged", PagedAllocator)`. Called once per build."""


@hookspec
def infer_register_schedulers(register: RegisterFn) -> None:
    """Register schedulers: `register("fcfs", FcfsScheduler)`. Called once per build."""


@hookspec
def infer_register_samplers(register: RegisterFn) -> None:
    """Register samplers: `register("vectorized", VectorizedSampler)`. Called once per build."""


@hookspec
def infer_register_decoders(register: RegisterFn) -> None:
    """Register decoding strategies: `register("speculative", SpeculativeDecoder)`.

    A decoder whose capabilities set `needs_draft` is refused unless a draft model is named.
    """


@hookspec
def infer_register_detokenizers(register: RegisterFn) -> None:
    """Register detokenizers: `register("parallel", ParallelDetokenizer)`. Called once per build."""


@hookspec
def infer_register_models(register: RegisterFn) -> None:
    """Register model architectures: `register("llama", Llama)`.

    The class lists the HF `architectures` names it serves and its named shapes (`presets`),
    so `--model llama2-7b` and a folder whose config.json says LlamaForCausalLM both find it.
    When several claim an architecture the first one found runs it, unless `--model-impl NAME`
    names another. `pytest --infer-kit model=NAME` checks it against HF transformers' own model.
    """


@hookspec
def infer_register_layers(register: RegisterFn) -> None:
    """Register model layer implementations by kind: `register("rms_norm", FusedRMSNorm)`.

    Lets a plugin swap a fused kernel into every model without touching the model code.
    """


@hookspec
def infer_register_logits_processors(register: RegisterFn) -> None:
    """Register logits processors: `register("xgrammar", XGrammarProcessor)`.

    Each one decides per request whether it applies (structured output, logit bias, ...).
    """


@hookspec
def infer_register_reasoning_parsers(register: RegisterFn) -> None:
    """Register reasoning parsers: `register("qwen3", Qwen3Reasoning)` (`infer serve --reasoning-parser`).

    Plugin API 2.1. A parser splits a chat's output into its reasoning and its answer, whole or as it
    streams (`infer.api.reasoning`); the kit checks that both splits agree for every chunking.
    """


@hookspec
def infer_register_poolers(register: RegisterFn) -> None:
    """Register poolers: `register("mean", MeanPooler)` (`PoolingParams(pooler="mean")`).

    Plugin API 2.2. A pooler turns an embedding request's prompt hidden states into its vector
    (`infer.api.pooling`); every one installed is built once per engine.
    """


@hookspec
def infer_register_adapters(register: RegisterFn) -> None:
    """Register adapter kinds: `register("lora", LoRAKind)` (`--adapter`, with --enable-lora).

    Plugin API 2.3. A kind reads an adapter's folder, keeps adapters in device slots and adds each
    token's adapter's delta to the projections a model lets it change (`infer.api.adapters`); its
    factory is `factory(spec: AdapterSpec)`, built once per target model of a run that serves adapters.
    """


@hookspec
def infer_register_commands(cli: Any) -> None:
    """Add commands to the `infer` click group. Called once when the CLI starts."""
