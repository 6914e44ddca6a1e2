"""Moved to `infer.api` (with its submodules): this old name is an alias that warns, kept for the
plugins written against it; import from `infer.api` (docs/plugins.md)."""

import importlib
import sys
import warnings

import infer.api

SUBMODULES = (
    "attention", "capabilities", "constraints", "decode_paths", "decoding", "kv", "models", "parallel",
    "sampling", "scheduling", "text",
)  # fmt: skip

warnings.warn(
    "infer.core.interfaces moved to infer.api: import from there (the old name is an alias, to be removed)",
    DeprecationWarning,
    stacklevel=2,
)
for _name in SUBMODULES:
    sys.modules[f"{__name__}.{_name}"] = importlib.import_module(f"infer.api.{_name}")
sys.modules[__name__] = infer.api
