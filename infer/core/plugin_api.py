"""Which plugin API a plugin declares, and whether this core provides it.

The plugin API has a major and a minor version (`infer.PLUGIN_API`, now (2, 2); `PLUGIN_API_VERSION`
is its major). A minor bump only adds: a plugin written for 2.0 runs on every 2.x, and what a minor
version supersedes keeps working with a DeprecationWarning naming its replacement. A major bump may
remove what was deprecated and change a factory's call or an interface. docs/plugins.md says which
version changed what.

A plugin module (or object) may declare the plugin API versions it was written for:

    INFER_PLUGIN_API = ">=2.1,<3"   comma-separated comparisons (>=, <=, >, <, ==, !=) with a major
                                    or a major.minor version; a bare major compares majors only
                                    (">=2,<3" is every 2.x, "==2" too)
    INFER_PLUGIN_API = 2            that major version, any minor
    infer_plugin_api = (1, 2)       an inclusive (min, max) range of majors

A plugin that declares nothing is taken to fit. The registry refuses one that does not fit this
core's version and records it as broken, with this module's message.
"""

from __future__ import annotations

import operator
import re
from typing import Any, Callable

from infer.api.hookspecs import PLUGIN_API

Version = tuple[int, int]  # (major, minor)
ATTRIBUTES = ("INFER_PLUGIN_API", "infer_plugin_api")
_OPS: dict[str, Callable[[Any, Any], bool]] = {
    ">=": operator.ge,
    "<=": operator.le,
    ">": operator.gt,
    "<": operator.lt,
    "==": operator.eq,
    "!=": operator.ne,
}
_CLAUSE = re.compile(r"^\s*(>=|<=|==|!=|>|<)?\s*(\d+)(?:\.(\d+))?\s*$")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def describe(version: Version) -> str:
    return f"{version[0]}.{version[1]}"


def parse(declaration: Any) -> Callable[[Version], bool]:
    """A predicate over (major, minor) API versions; ValueError when the declaration is not one of the
    three forms."""
    if _is_int(declaration):
        return lambda v: v[0] == declaration
    if isinstance(declaration, tuple) and len(declaration) == 2 and all(map(_is_int, declaration)):
        low, high = declaration
        if low > high:
            raise ValueError(f"the range {declaration!r} is empty (min > max)")
        return lambda v: low <= v[0] <= high
    if isinstance(declaration, str) and declaration.strip():
        clauses: list[tuple[Callable[[Any, Any], bool], int, int | None]] = []
        for part in declaration.split(","):
            match = _CLAUSE.match(part)
            if match is None:
                raise ValueError(f"{part.strip()!r} is not a comparison such as '>=2.1' or '<3'")
            minor = match.group(3)
            clauses.append((_OPS[match.group(1) or "=="], int(match.group(2)), None if minor is None else int(minor)))
        return lambda v: all(
            op(v[0], major) if minor is None else op(v, (major, minor)) for op, major, minor in clauses
        )
    raise ValueError("expected a string such as '>=2.1,<3', an int, or a (min, max) tuple of ints")


def declared(plugin: Any) -> tuple[str, Any] | None:
    for attr in ATTRIBUTES:
        # a plugin is any module or object: the declaration is an optional attribute, read by name
        value = getattr(plugin, attr, _MISSING)
        if value is not _MISSING:
            return attr, value
    return None


_MISSING = object()


def mismatch(plugin: Any, core_version: Version = PLUGIN_API) -> str | None:
    """None when the plugin fits this core, else the reason, naming both sides' versions."""
    found = declared(plugin)
    if found is None:
        return None
    attr, declaration = found
    major, version = core_version[0], describe(core_version)
    try:
        fits = parse(declaration)
    except ValueError as exc:
        return (
            f"it declares {attr} = {declaration!r}, which is not a plugin API range ({exc}); "
            f"this infer provides plugin API {version}: declare e.g. '>={version},<{major + 1}'"
        )
    if fits(core_version):
        return None
    return (
        f"it declares {attr} = {declaration!r} but this infer provides plugin API {version} "
        f"(the plugins that fit declare it, e.g. '>={major},<{major + 1}'); install a release of the plugin "
        f"written for plugin API {version}, or an infer whose plugin API the plugin declares"
    )
