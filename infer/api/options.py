"""EngineConfig's fields as users write them: text converted by the field's declared type, and every
value checked against its type and range, so a bad option is one ConfigError before anything loads.

One place for both: `--baseline`, `bench --matrix` and `LLM(**options)` all end here.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from typing import Any, Callable, Literal

from infer.api.errors import ConfigError
from infer.api.slots import CHOSEN, PREFILL_ATTENTION

# field -> the CLI flag, where it is not the field's name with dashes
FLAG_NAMES = {
    "kv_cache_memory_gib": "--kv-cache-memory",
    "swap_space_gib": "--swap-space",
    "tensor_parallel_size": "--tp",
    "pipeline_parallel_size": "--pp",
    "enable_prefix_caching": "--prefix-caching",
}

TRUE, FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def flag(name: str) -> str:
    return FLAG_NAMES.get(name, "--" + name.replace("_", "-"))


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _power_of_two(v: int) -> bool:
    return v >= 1 and not v & (v - 1)


# field -> (holds, what a valid value is); checked after the type, None passes where the type allows it
RANGES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "block_size": (_power_of_two, "a power of two (8, 16, 32, ...)"),
    "num_kv_blocks": (lambda v: v >= 1, "an integer >= 1, or None for the memory budget's"),
    "kv_cache_memory_gib": (lambda v: math.isfinite(v) and v > 0, "a number of GiB > 0, or None for the default"),
    "swap_space_gib": (lambda v: math.isfinite(v) and v >= 0, "a number of GiB >= 0"),
    "gpu_memory_utilization": (lambda v: 0 < v <= 1, "a fraction in (0, 1]"),
    "max_num_seqs": (lambda v: v >= 1, "an integer >= 1"),
    "max_num_batched_tokens": (lambda v: v >= 1, "an integer >= 1"),
    "max_step_ms": (lambda v: math.isfinite(v) and v > 0, "a number of milliseconds > 0, or None for no target"),
    "structured_compile_timeout_s": (lambda v: math.isfinite(v) and v > 0, "a number of seconds > 0"),
    "max_model_len": (lambda v: v >= 1, "an integer >= 1, or None for the model's context length"),
    "seed": (lambda v: v >= 0, "an integer >= 0"),
    "cuda_graph_max_tokens": (lambda v: v >= 0, "an integer >= 0 (0: graphs for decode steps only)"),
    "tensor_parallel_size": (lambda v: v >= 1, "an integer >= 1"),
    "pipeline_parallel_size": (lambda v: v >= 1, "an integer >= 1"),
    "pipeline_micro_batches": (lambda v: v >= 1, "an integer >= 1, or None for one per stage"),
    "num_speculative_tokens": (lambda v: v >= 1, "an integer >= 1"),
    "exit_layer": (lambda v: v >= 1, "an integer >= 1 (decoder layers kept), or None"),
    "max_loras": (lambda v: v >= 1, "an integer >= 1"),
    "cpu_threads": (lambda v: v >= 1, "an integer >= 1, or None for the cores this process may use"),
    "max_lora_rank": (lambda v: 1 <= v <= 128, "an integer in [1, 128]"),
    "max_cpu_loras": (lambda v: v >= 1, "an integer >= 1, or None for --max-loras"),
    "draft": (lambda v: v.strip() != "", "ngram, self, or a model name or folder"),
    "revision": (lambda v: v.strip() != "", "a branch, tag or commit of the HF repo, or None for main"),
    "chat_template": (lambda v: v.strip() != "", "a jinja file's path or the template's text, or None for the model's"),
    **{
        s.field: (lambda v: v.strip() != "", "a registered strategy name (see `infer plugins`)")
        for s in (*CHOSEN, PREFILL_ATTENTION)
    },
}


@dataclasses.dataclass(frozen=True, slots=True)
class FieldType:
    """A field's declared type, unpacked: `int | None` is FieldType(int, optional=True)."""

    base: Any  # int, float, bool, str, or a Literal[...]
    optional: bool

    @property
    def choices(self) -> tuple[Any, ...] | None:
        return typing.get_args(self.base) if typing.get_origin(self.base) is Literal else None

    def describe(self) -> str:
        what = (
            ("one of " + ", ".join(map(str, self.choices)))
            if self.choices
            else {int: "an integer", float: "a number", bool: "true or false", str: "a string"}[self.base]
        )
        return what + (", or None" if self.optional else "")

    def holds(self, value: Any) -> bool:
        if value is None:
            return self.optional
        if self.choices is not None:
            return value in self.choices
        if self.base is bool:
            return isinstance(value, bool)
        if self.base is int:
            return _is_int(value)
        if self.base is float:
            return _is_int(value) or isinstance(value, float)
        return isinstance(value, self.base)

    def parse(self, text: str) -> Any:
        """Text as on a command line -> a value of this type; ValueError when it is none."""
        t = text.strip()
        if self.optional and t.lower() in ("none", "null", ""):
            return None
        if self.choices is not None:
            if t not in self.choices:
                raise ValueError(t)
            return t
        if self.base is bool:
            if t.lower() not in TRUE + FALSE:
                raise ValueError(t)
            return t.lower() in TRUE
        return self.base(t)


def field_types(cls: type) -> dict[str, FieldType]:
    hints = typing.get_type_hints(cls)
    found = {}
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        args = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else ()
        if args:
            rest = [a for a in args if a is not type(None)]
            found[f.name] = FieldType(rest[0], optional=len(rest) < len(args))
        else:
            found[f.name] = FieldType(hint, optional=False)
    return found


def _unknown(names: list[str], types: dict[str, FieldType]) -> ConfigError:
    return ConfigError(f"unknown engine option(s) {', '.join(names)}: valid options are {', '.join(sorted(types))}")


def parse_option(cls: type, name: str, text: str, where: str) -> Any:
    """`where` ("--baseline 'block_size=abc'") starts the message. Field names may use dashes."""
    types = field_types(cls)
    key = name.strip().replace("-", "_")
    if not key:
        raise ConfigError(f"{where}: no option name before '=': write FIELD=VALUE, e.g. block_size=32")
    if key not in types:
        raise _unknown([name.strip()], types)
    kind = types[key]
    try:
        return kind.parse(text)
    except ValueError:
        raise ConfigError(f"{where}: {key} takes {kind.describe()}, not {text.strip()!r}") from None


def check_known(cls: type, names: list[str]) -> None:
    types = field_types(cls)
    unknown = sorted(set(names) - set(types))
    if unknown:
        raise _unknown(unknown, types)


def check_fields(config: Any) -> None:
    """Every field's type, then its range: the first bad one is a ConfigError naming field, flag and fix."""
    for name, kind in field_types(type(config)).items():
        value = getattr(config, name)  # a dataclass field, by its name from field_types
        if not kind.holds(value):
            raise ConfigError(f"invalid {name}={value!r} ({flag(name)}): use {kind.describe()}")
        if value is not None and name in RANGES:
            holds, what = RANGES[name]
            if not holds(value):
                raise ConfigError(f"invalid {name}={value!r} ({flag(name)}): use {what}")
