"""Modules that moved, importable under their old names for a deprecation window (docs/plugins.md,
"Versions"): the old name is the new module itself, and its first import warns with the new name.
A prefix maps its submodules too (`infer.core.interfaces.attention` is `infer.api.attention`).
`infer/__init__.py` installs the finder; a name is removed from here at the plugin API's next major.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from types import ModuleType

# old name -> new name (plugin API 2.1 moved each of them)
MOVED = {
    "infer.core.interfaces": "infer.api",
    "infer.core.request": "infer.api.request",
    "infer.core.errors": "infer.api.errors",
    "infer.core.config": "infer.api.config",
    "infer.core.hookspecs": "infer.api.hookspecs",
    "infer.core.slots": "infer.api.slots",
    "infer.env": "infer.common.env",
    "infer.log": "infer.common.log",
    "infer.warmup": "infer.kernels.warmup",
}


def new_name(name: str) -> str | None:
    """Where module `name` lives now, or None if it did not move."""
    for old, new in MOVED.items():
        if name == old or name.startswith(old + "."):
            return new + name[len(old) :]
    return None


class MovedFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(
        self, fullname: str, path: object = None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        if new_name(fullname) is None:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None  # a blank module, replaced in exec_module

    def exec_module(self, module: ModuleType) -> None:
        old = module.__name__
        new = new_name(old)
        assert new is not None, "find_spec answers only moved names"
        warnings.warn(
            f"{old} moved to {new}: import from there (the old name is an alias, removed at plugin API 3)",
            DeprecationWarning,
            stacklevel=2,
        )
        # the import system takes the module from sys.modules after this: the old name is the new module
        sys.modules[old] = importlib.import_module(new)


FINDER = MovedFinder()


def install() -> None:
    if FINDER not in sys.meta_path:
        # first: a moved package's submodule would otherwise be found again in the new package's folder,
        # as a second copy under the old name; every other name it declines at once
        sys.meta_path.insert(0, FINDER)
