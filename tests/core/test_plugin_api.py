"""Plugin API versions: the declaration forms, and the registry refusing a plugin that does not fit."""

from __future__ import annotations

import types

import pytest

import infer
from infer.api.errors import PluginNotFoundError
from infer.core import plugin_api
from infer.core.registry import PluginRegistry

V = infer.PLUGIN_API_VERSION
M = infer.PLUGIN_API[1]
CORE = f"{V}.{M}"


def sampler_plugin(name: str, **declaration: object) -> types.ModuleType:
    module = types.ModuleType(f"plugin_{name.replace('-', '_')}")

    @infer.hookimpl
    def infer_register_samplers(register):
        register(name, object)

    module.infer_register_samplers = infer_register_samplers
    for attr, value in declaration.items():
        setattr(module, attr, value)
    return module


@pytest.mark.parametrize(
    "declaration,fits",
    [
        (f">={V},<{V + 1}", True),
        (f">={V + 1}", False),
        (f"<{V}", False),
        (f"=={V}", True),
        (f"!={V}", False),
        (str(V), True),
        (V, True),
        (V + 1, False),
        ((1, V), True),
        ((V + 1, V + 3), False),
        (f" >= 1 , <= {V} ", True),
        (f">={V}.{M},<{V + 1}", True),  # a minor: the features of V.M, which this core has
        (f">={V}.{M + 1},<{V + 1}", False),  # a later minor's features: not here yet
        (f"<{V}.{M}", False),
        (f"<={V}.{M}", True),
        (f"=={V}.{M}", True),
        (f"=={V}.{M + 1}", False),
        (f">={V}.0", True),
    ],
)
def test_declaration_forms(declaration, fits):
    assert plugin_api.parse(declaration)((V, M)) is fits


def test_a_bare_major_compares_majors_only():
    for minor in (0, 1, 7):
        assert plugin_api.parse(f">={V},<{V + 1}")((V, minor))
        assert plugin_api.parse(f"=={V}")((V, minor))
        assert not plugin_api.parse(f">{V}")((V, minor))
        assert plugin_api.parse(V)((V, minor))
    assert plugin_api.parse(f"<={V}")((V, 9)) and not plugin_api.parse(f"<={V}")((V + 1, 0))


@pytest.mark.parametrize("declaration", ["", ">=one", "~=1", "2.1.3", ">=2.", (2, 1), (1, 2, 3), 1.5, True, None])
def test_malformed_declarations_are_refused(declaration):
    with pytest.raises(ValueError):
        plugin_api.parse(declaration)


def test_registry_refuses_an_incompatible_plugin_and_says_which_versions_fit():
    future = sampler_plugin("from-the-future", INFER_PLUGIN_API=f">={V + 1},<{V + 2}")
    tuple_range = sampler_plugin("old-range", infer_plugin_api=(0, V - 1))
    fits = sampler_plugin("fits", INFER_PLUGIN_API=f">=1,<{V + 1}")
    undeclared = sampler_plugin("undeclared")
    registry = PluginRegistry.load([future, tuple_range, fits, undeclared], entry_points=False)
    assert {"fits", "undeclared"} <= set(registry.names("sampler"))
    assert {"from-the-future", "old-range"}.isdisjoint(registry.names("sampler"))
    broken = {b.plugin: b.error for b in registry.broken}
    assert broken["plugin_from_the_future"] == (
        f"plugin API mismatch: it declares INFER_PLUGIN_API = '>={V + 1},<{V + 2}' but this infer provides plugin API "
        f"{CORE} (the plugins that fit declare it, e.g. '>={V},<{V + 1}'); install a release of the plugin written for "
        f"plugin API {CORE}, or an infer whose plugin API the plugin declares"
    )
    assert f"infer_plugin_api = (0, {V - 1})" in broken["plugin_old_range"]
    with pytest.raises(PluginNotFoundError, match=r"unknown --sampler 'from-the-future'.*plugin API mismatch"):
        registry.get("sampler", "from-the-future")


def test_malformed_declaration_is_recorded_as_broken():
    registry = PluginRegistry.load([sampler_plugin("odd", INFER_PLUGIN_API="version one")], entry_points=False)
    assert "odd" not in registry.names("sampler")
    (broken,) = registry.broken
    assert "INFER_PLUGIN_API = 'version one', which is not a plugin API range" in broken.error


def test_entry_point_plugin_with_an_incompatible_api_is_broken(tmp_path, monkeypatch):
    (tmp_path / "future_infer_plugin.py").write_text(
        "import infer\n"
        f"INFER_PLUGIN_API = {V + 1}\n"
        "@infer.hookimpl\n"
        "def infer_register_samplers(register):\n"
        "    register('future', object)\n"
    )
    dist = tmp_path / "future_infer_plugin-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: future-infer-plugin\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[infer]\nfuture = future_infer_plugin\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    registry = PluginRegistry.load()
    assert "future" not in registry.names("sampler")
    broken = next(b for b in registry.broken if b.plugin == "future")
    assert broken.distribution == "future-infer-plugin"
    assert f"declares INFER_PLUGIN_API = {V + 1} but this infer provides plugin API {CORE}" in broken.error
    assert "vectorized" in registry.names("sampler")  # the others load as usual
