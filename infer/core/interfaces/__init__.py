"""Moved to `infer.api` (with its submodules): this old name is an alias that warns, kept for the
plugins written against it; import from `infer.api` (docs/plugins.md)."""

import importlib
import pkgutil
import sys
import warnings

import infer.api

# every submodule of infer.api, so that none is loaded a second time under this old name
SUBMODULES = tuple(m.name for m in pkgutil.iter_modules(infer.api.__path__))

warnings.warn(
    "infer.core.interfaces moved to infer.api: import from there (the old name is an alias, to be removed)",
    DeprecationWarning,
    stacklevel=2,
)
for _name in SUBMODULES:
    sys.modules[f"{__name__}.{_name}"] = importlib.import_module(f"infer.api.{_name}")
sys.modules[__name__] = infer.api
