"""The plugin API moved to `infer.api`: the old module names (`infer.core.interfaces` and its submodules,
`infer.core.request`, `errors`, `config`, `hookspecs`, `slots`) and the leaf utilities' (`infer.env`,
`infer.log`, `infer.warmup`) still import, as the same objects, and
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
    "infer.env": "infer.common.env",
    "infer.log": "infer.common.log",
    "infer.warmup": "infer.kernels.warmup",
}


@pytest.mark.parametrize("old, new", OLD_TO_NEW.items())
def test_an_old_name_is_the_new_module_and_warns(old, new):
    for name in [m for m in sys.modules if m == old or m.startswith(old + ".")]:
        del sys.modules[name]  # imported afresh: the warning comes at the first import
    if old.startswith("infer.core.interfaces."):
        sys.modules.pop("infer.core.interfaces", None)
    with pytest.warns(DeprecationWarning) as warned:  # a submodule's package warns too, under its own name
        module = importlib.import_module(old)
    assert f"{old} moved to {new}: import from there" in [str(w.message).split(" (")[0] for w in warned]
    assert module is importlib.import_module(new)


def test_the_api_package_exports_what_plugins_implement():
    for name in ("AttentionBackend", "KVAllocator", "Scheduler", "Sampler", "Decoder", "Detokenizer", "CausalLM"):
        assert name in infer.api.__all__ and hasattr(infer.api, name)


def test_a_moved_module_imported_from_its_old_name_works_as_before():
    sys.modules.pop("infer.log", None)
    with pytest.warns(DeprecationWarning):
        from infer.log import get_logger
    from infer.common.log import get_logger as new

    assert get_logger is new


def test_a_name_that_never_existed_is_still_an_import_error():
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("infer.core.no_such_module")
