"""The strategy slots: one row each, read by the registry, compose, doctor, the CLI, bench and the kit."""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True, slots=True)
class Slot:
    # registry key, `infer plugins` column, doctor's row; the same word names the EngineConfig field (when
    # chosen by name) and the folder of its built-in plugins (infer/plugins/<name>)
    name: str
    hook: str  # the register-callback hook spec that fills it
    field: str | None  # the EngineConfig field naming the strategy; None: not chosen by name
    flag: str  # how error messages name the choice
    aliases: tuple[str, ...] = ()  # further spellings `bench --matrix` and `--infer-kit` accept


SLOTS: tuple[Slot, ...] = (  # in `infer plugins` and doctor order
    Slot("attention", "infer_register_attention_backends", "attention", "--attention"),
    Slot("kv_allocator", "infer_register_kv_allocators", "kv_allocator", "--kv-allocator", ("allocator",)),
    Slot("scheduler", "infer_register_schedulers", "scheduler", "--scheduler"),
    Slot("sampler", "infer_register_samplers", "sampler", "--sampler"),
    Slot("decoding", "infer_register_decoders", "decoding", "--decoding", ("decoder",)),
    Slot("detokenizer", "infer_register_detokenizers", "detokenizer", "--detokenizer"),
    Slot("model", "infer_register_models", None, "--model-impl"),  # chosen by the checkpoint's architecture
    Slot("layer", "infer_register_layers", None, "the layers hook"),  # every kind, by priority
    Slot("logits_processor", "infer_register_logits_processors", None, "the logits processors hook"),  # all
    Slot("reasoning_parser", "infer_register_reasoning_parsers", None, "--reasoning-parser"),  # the server's choice
    Slot("pooler", "infer_register_poolers", None, "PoolingParams.pooler"),  # all; each embedding request names one
    Slot("adapter", "infer_register_adapters", "adapter", "--adapter"),  # built with --enable-lora
)
SLOT = {s.name: s for s in SLOTS}
CHOSEN = tuple(s for s in SLOTS if s.field)  # the slots an EngineConfig names a strategy for
# the attention slot's second use: a backend for prefill only, composed with --attention
PREFILL_ATTENTION = replace(SLOT["attention"], field="prefill_attention", flag="--prefill-attention")


def find(spelling: str) -> Slot | None:
    """The slot a user's word names: its name, config field or an alias, with dashes or underscores."""
    word = spelling.strip().replace("-", "_")
    return next((s for s in SLOTS if word in (s.name, s.field, *s.aliases)), None)
