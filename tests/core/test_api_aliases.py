"""The plugin API moved to `infer.api`: the old module names (`infer.core.interfaces` and its submodules,
`infer.core.request`, `errors`, `config`, `hookspecs`, `slots`) still import, as the same objects, and
warn with the new name, so a plugin written against them keeps working for now."""

from __future__ import annotations

import importlib
import sys

import pytest

import infer.api

OLD_TO_NEW = {
    "infer.core.interfaces": "infer.api",
    "infer.core.interfaces.attention": "infer.api.attention",
    "infer.core.interfaces.sampling": "infer.api.sampling",
    "infer.core.request": "infer.api.request",
    "infer.core.errors": "infer.api.errors",
    "infer.core.config": "infer.api.config",
    "infer.core.hookspecs": "infer.api.hookspecs",
    "infer.core.slots": "infer.api.slots",
}


@pytest.mark.parametrize("old, new", OLD_TO_NEW.items())
def test_an_old_name_is_the_new_module_and_warns(old, new):
    for name in [m for m in sys.modules if m == old or m.startswith(old + ".")]:
        del sys.modules[name]  # imported afresh: the warning comes at the first import
    if old.startswith("infer.core.interfaces."):
        sys.modules.pop("infer.core.interfaces", None)
    with pytest.warns(DeprecationWarning, match=r"moved to infer\.api"):
        module = importlib.import_module(old)
    assert module is importlib.import_module(new)


def test_the_api_package_exports_what_plugins_implement():
    for name in ("AttentionBackend", "KVAllocator", "Scheduler", "Sampler", "Decoder", "Detokenizer", "CausalLM"):
        assert name in infer.api.__all__ and hasattr(infer.api, name)
