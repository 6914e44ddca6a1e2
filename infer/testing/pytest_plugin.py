"""The pytest plugin behind `pytest --infer-kit SLOT=NAME`: run the conformance kit against an
installed strategy.

    pytest --infer-kit attention=my-attn                  # the attention suite against my-attn
    pytest --infer-kit sampler=a --infer-kit decoding=b    # several slots (or names: sampler=a,b)
    pytest --infer-kit model=my-model                     # a model plugin beside HF transformers' own
    pytest --infer-kit logits_processor=my-constraint     # a logits processor (declares `kit_params`)

Without `--infer-kit` the plugin does nothing. With it, the kit's suites for the named slots are
collected (in place of the configured test paths, or beside paths given on the command line).
Registered under `pytest11`, so installing infer is enough; nothing is imported until asked for.
"""

from __future__ import annotations

import fnmatch
from pathlib import Path

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("infer", "infer plugin conformance kit")
    group.addoption(
        "--infer-kit",
        action="append",
        default=[],
        metavar="SLOT=NAME",
        help="run infer's conformance suite for SLOT (attention, sampler, kv_allocator, decoding, model, reasoning_parser, "
        "logits_processor) against the installed strategy NAME; repeatable",
    )


def pytest_configure(config: pytest.Config) -> None:
    specs = config.getoption("infer_kit", default=[])
    if not specs:
        return
    from infer.testing import kit

    selection = kit.select(specs)
    config.stash[kit.SELECTION] = selection
    explicit = config.args_source == pytest.Config.ArgsSource.ARGS and config.args
    config.args = [*config.args, str(kit.SUITES)] if explicit else [str(kit.SUITES)]


def pytest_collect_file(file_path: Path, parent: pytest.Collector) -> pytest.Module | None:
    """The selected suites (kit_<slot>.py, named so that no ordinary run collects them)."""
    if not parent.config.getoption("infer_kit", default=[]):
        return None
    from infer.testing import kit

    if str(file_path) not in kit.suite_paths(parent.config.stash[kit.SELECTION]):
        return None
    if any(fnmatch.fnmatch(file_path.name, pattern) for pattern in parent.config.getini("python_files")):
        return None  # the python plugin collects it already
    return pytest.Module.from_parent(parent, path=file_path)


def pytest_report_header(config: pytest.Config) -> str | None:
    if not config.getoption("infer_kit", default=[]):
        return None
    from infer.testing import kit

    return f"infer kit: {config.stash[kit.SELECTION].describe()}"
