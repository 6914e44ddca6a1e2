"""Which plugin API a plugin declares, and whether this core provides it.

A plugin module (or object) may declare the plugin API versions it was written for:

    INFER_PLUGIN_API = ">=1,<2"     comma-separated integer comparisons (>=, <=, >, <, ==, !=)
    INFER_PLUGIN_API = 1            exactly that version
    infer_plugin_api = (1, 1)       an inclusive (min, max) range

A plugin that declares nothing is taken to fit. The registry refuses one that does not fit this
core's `PLUGIN_API_VERSION` and records it as broken, with this module's message.
"""

from __future__ import annotations

import operator
import re
from typing import Any, Callable

from infer.api.hookspecs import PLUGIN_API_VERSION

ATTRIBUTES = ("INFER_PLUGIN_API", "infer_plugin_api")
_OPS: dict[str, Callable[[int, int], bool]] = {
    ">=": operator.ge,
    "<=": operator.le,
    ">": operator.gt,
    "<": operator.lt,
    "==": operator.eq,
    "!=": operator.ne,
}
_CLAUSE = re.compile(r"^\s*(>=|<=|==|!=|>|<)?\s*(\d+)\s*$")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse(declaration: Any) -> Callable[[int], bool]:
    """A predicate over API versions; ValueError when the declaration is not one of the three forms."""
    if _is_int(declaration):
        return lambda v: v == declaration
    if isinstance(declaration, tuple) and len(declaration) == 2 and all(map(_is_int, declaration)):
        low, high = declaration
        if low > high:
            raise ValueError(f"the range {declaration!r} is empty (min > max)")
        return lambda v: low <= v <= high
    if isinstance(declaration, str) and declaration.strip():
        clauses = []
        for part in declaration.split(","):
            match = _CLAUSE.match(part)
            if match is None:
                raise ValueError(f"{part.strip()!r} is not a comparison such as '>=1' or '<2'")
            clauses.append((_OPS[match.group(1) or "=="], int(match.group(2))))
        return lambda v: all(op(v, bound) for op, bound in clauses)
    raise ValueError("expected a string such as '>=1,<2', an int, or a (min, max) tuple of ints")


def declared(plugin: Any) -> tuple[str, Any] | None:
    for attr in ATTRIBUTES:
        if hasattr(plugin, attr):
            return attr, getattr(plugin, attr)
    return None


def mismatch(plugin: Any, core_version: int = PLUGIN_API_VERSION) -> str | None:
    """None when the plugin fits this core, else the reason, naming both sides' versions."""
    found = declared(plugin)
    if found is None:
        return None
    attr, declaration = found
    try:
        fits = parse(declaration)
    except ValueError as exc:
        return (
            f"it declares {attr} = {declaration!r}, which is not a plugin API range ({exc}); "
            f"this infer provides plugin API {core_version}: declare e.g. '>={core_version},<{core_version + 1}'"
        )
    if fits(core_version):
        return None
    return (
        f"it declares {attr} = {declaration!r} but this infer provides plugin API {core_version} "
        f"(the versions that fit: {core_version}); install a release of the plugin written for plugin API "
        f"{core_version}, or an infer whose plugin API the plugin declares"
    )
