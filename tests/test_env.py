"""`infer/common/env.py` is the one reader of the environment: nothing else in `infer/` reads `os.environ`,
its functions read at call time with the documented defaults, and the per-launch paths do not read
it at all."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

import infer
from infer.common import env

ROOT = Path(infer.__file__).parent


def environ_reads(source: str) -> list[int]:
    """Lines of `source` that read the environment: any use of `os.environ` except assigning or
    deleting one of its keys, `os.getenv`, and importing `environ` or `getenv` from os."""
    tree = ast.parse(source)
    writes = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and isinstance(node.ctx, (ast.Store, ast.Del)):
            writes.add(id(node.value))
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "os":
            if node.attr == "getenv" or (node.attr == "environ" and id(node) not in writes):
                lines.append(node.lineno)
        elif (
            isinstance(node, ast.ImportFrom)
            and node.module == "os"
            and any(alias.name in ("environ", "getenv") for alias in node.names)
        ):
            lines.append(node.lineno)
    return sorted(lines)


@pytest.mark.parametrize(
    "source",
    [
        'os.environ.get("X")',
        'os.environ["X"]',
        '"X" in os.environ',
        'os.getenv("X")',
        "dict(os.environ)",
        'os.environ.setdefault("X", "1")',
        "from os import environ",
        "from os import getenv",
    ],
)
def test_the_check_sees_reads(source):
    assert environ_reads(f"import os\n{source}\n") == [2]


@pytest.mark.parametrize("source", ['os.environ["X"] = "1"', 'del os.environ["X"]', "os.cpu_count()"])
def test_the_check_lets_writes_be(source):
    assert environ_reads(f"import os\n{source}\n") == []


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
def test_only_env_reads_the_environment():
    found = {}
    for path in sorted(ROOT.rglob("*.py")):
        if path == ROOT / "common" / "env.py":
            continue
        if lines := environ_reads(path.read_text()):
            found[str(path.relative_to(ROOT.parent))] = lines
    assert found == {}, f"read these variables through infer/common/env.py: {found}"


def test_defaults(monkeypatch, tmp_path):
    for name in (
        "INFER_PDL",
        "INFER_GEMV_PUSH",
        "TRITON_INTERPRET",
        "INFER_CACHE_DIR",
        "XDG_CACHE_HOME",
        "INFER_EXTRA_PLUGINS",
        "HF_HUB_CACHE",
        "HUGGINGFACE_HUB_CACHE",
        "HF_HOME",
        "HF_HUB_OFFLINE",
        "TRANSFORMERS_OFFLINE",
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert env.pdl() and env.gemv_push() and not env.triton_interpret()
    assert env.cache_dir() == tmp_path / ".cache" / "infer"
    assert env.extra_plugins() == []
    assert env.hf_hub_cache() is None and not env.hf_offline()
    assert env.torchrun() is None


@pytest.mark.parametrize("value, on", [("0", False), ("1", True), ("", True), ("yes", True)])
def test_switches_are_off_only_at_zero(monkeypatch, value, on):
    monkeypatch.setenv("INFER_PDL", value)
    monkeypatch.setenv("INFER_GEMV_PUSH", value)
    assert env.pdl() is on and env.gemv_push() is on


@pytest.mark.parametrize("value, on", [("1", True), ("0", False), ("true", False), ("", False)])
def test_triton_interpret_is_one(monkeypatch, value, on):
    monkeypatch.setenv("TRITON_INTERPRET", value)
    assert env.triton_interpret() is on


def test_extra_plugins_are_split_and_stripped(monkeypatch):
    monkeypatch.setenv("INFER_EXTRA_PLUGINS", " a.b:C , ,d ,")
    assert env.extra_plugins() == ["a.b:C", "d"]


def test_hf_hub_cache_precedence(monkeypatch, tmp_path):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    assert env.hf_hub_cache() == tmp_path / "home" / "hub"
    monkeypatch.setenv("HUGGINGFACE_HUB_CACHE", str(tmp_path / "old"))
    assert env.hf_hub_cache() == tmp_path / "old"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "new"))
    assert env.hf_hub_cache() == tmp_path / "new"


@pytest.mark.parametrize(
    "hub, transformers, offline",
    [
        ("1", None, True),
        ("on", None, True),
        ("TRUE", None, True),
        ("0", "1", False),
        ("", "yes", True),
        (None, "1", True),
        (None, "no", False),
    ],
)
def test_hf_offline_as_huggingface_hub_reads_it(monkeypatch, hub, transformers, offline):
    for name, value in (("HF_HUB_OFFLINE", hub), ("TRANSFORMERS_OFFLINE", transformers)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    assert env.hf_offline() is offline


def test_torchrun_placement(monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setenv("RANK", "3")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert env.torchrun() is None  # both RANK and WORLD_SIZE, or not torchrun
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert env.torchrun() == env.Torchrun(rank=3, world_size=4, local_rank=3, local_world_size=4)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert env.torchrun() == env.Torchrun(rank=3, world_size=4, local_rank=1, local_world_size=2)


def _unreadable(*args):
    raise AssertionError("the environment was read on a per-launch path")


def test_launch_paths_do_not_read_the_environment(monkeypatch):
    pytest.importorskip("triton")
    from infer.kernels import gemv as triton_gemv
    from infer.plugins.attention.paged_cuda.kernels import dot_config

    for name in ("triton_interpret", "pdl"):
        monkeypatch.setattr(env, name, _unreadable)
    x, weight = torch.zeros(1, 64), torch.zeros(32, 64)
    expected = triton_gemv.INTERPRETER_TILE if triton_gemv._INTERPRETED else None
    if expected is not None:  # on a GPU the first call tunes instead
        assert triton_gemv._tile(x, weight, gated=False) == expected
    assert dot_config(torch.float16)[1] == "tf32"


def test_pdl_reads_its_variables_once_per_gpu(monkeypatch):
    from infer.kernels import pdl

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: (9, 0))
    monkeypatch.setattr(env, "triton_interpret", lambda: False)
    monkeypatch.setattr(env, "pdl", lambda: True)
    pdl.reset()
    try:
        assert pdl.enabled(torch.device("cuda", 0))
        monkeypatch.setattr(env, "pdl", _unreadable)
        monkeypatch.setattr(env, "triton_interpret", _unreadable)
        assert pdl.enabled(torch.device("cuda", 0))
    finally:
        pdl.reset()
