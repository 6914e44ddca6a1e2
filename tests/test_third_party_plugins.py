"""Third-party plugins: the example package installed beside the venv and run through the CLI; a broken one isolated."""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import subprocess
import sys

import pytest


def infer_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "infer.cli.main", *args], capture_output=True, text=True, env=env, timeout=300
    )


@pytest.mark.slow  # three CLI processes; the conformance kit test finds the same install quickly
def test_example_plugin_is_listed_and_runs(example_plugin_env, tiny_llama_dir, tmp_path):
    with pytest.raises(md.PackageNotFoundError):  # installed for the subprocesses only, not into this venv
        md.distribution("infer-example-plugin")
    listed = infer_cli("plugins", env=example_plugin_env)
    assert listed.returncode == 0, listed.stderr
    row = next(line.split() for line in listed.stdout.splitlines() if "temperature-only" in line)
    assert row[:4] == ["sampler", "temperature-only", "infer-example-plugin", "0.1.0"]
    row = next(line.split() for line in listed.stdout.splitlines() if "arcee" in line)
    assert row[:4] == ["model", "arcee", "infer-example-plugin", "0.1.0"]

    data = tmp_path / "p.json"
    data.write_text(json.dumps([[5, 6, 7], [8, 9]]))
    out = tmp_path / "r.json"
    ran = infer_cli(
        "run",
        "--model",
        str(tiny_llama_dir),
        "--sampler",
        "temperature-only",
        "--dataset",
        str(data),
        "--max-tokens",
        "4",
        "--no-progress",
        "--json-out",
        str(out),
        env=example_plugin_env,
    )
    assert ran.returncode == 0, ran.stderr
    record = json.loads(out.read_text())["records"][0]
    assert record["config"]["sampler"] == "temperature-only" and record["output_tokens"] == 8

    hello = infer_cli("example-hello", env=example_plugin_env)  # a command added through infer_register_commands
    assert hello.returncode == 0 and "hello from infer-example-plugin" in hello.stdout


@pytest.fixture
def broken_plugin_env(tmp_path) -> dict[str, str]:
    """A distribution whose entry-point module raises at import, found through PYTHONPATH."""
    (tmp_path / "broken_infer_plugin.py").write_text("raise RuntimeError('this plugin is broken on purpose')\n")
    dist = tmp_path / "broken_infer_plugin-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-infer-plugin\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[infer]\nbroken = broken_infer_plugin\n")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tmp_path), env.get("PYTHONPATH")]))
    return env


@pytest.mark.slow
def test_broken_plugin_is_reported_and_does_not_break_a_run(broken_plugin_env, tiny_llama_dir, tmp_path):
    listed = infer_cli("plugins", env=broken_plugin_env)
    assert listed.returncode == 0
    assert "broken-infer-plugin" in listed.stderr and "broken on purpose" in listed.stderr
    data = tmp_path / "p.json"
    data.write_text(json.dumps([[5, 6, 7]]))
    ran = infer_cli(
        "run",
        "--model",
        str(tiny_llama_dir),
        "--dataset",
        str(data),
        "--max-tokens",
        "3",
        "--no-progress",
        env=broken_plugin_env,
    )
    assert ran.returncode == 0, ran.stderr
    assert "Traceback" not in ran.stderr


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
def test_asking_for_a_strategy_of_a_broken_plugin_fails_clearly(broken_plugin_env, tiny_llama_dir):
    ran = infer_cli(
        "run", "--model", str(tiny_llama_dir), "--sampler", "from-broken", "--no-progress", env=broken_plugin_env
    )
    assert ran.returncode == 2
    assert "Traceback" not in ran.stderr
    line = ran.stderr.strip().splitlines()[-1]
    assert "unknown --sampler 'from-broken'" in line and "broken-infer-plugin" in line and "broken on purpose" in line


def test_inline_plugin_registered_per_engine(tiny_llama_dir):
    """simonw/llm style: register an inline plugin class for one engine only."""
    import infer
    from infer import SamplingParams
    from infer.api import SamplerOutput
    from infer.api.errors import PluginNotFoundError
    from infer.llm import LLM

    class AlwaysSeven:
        def __init__(self, vocab_size, device):
            pass

        def sample(self, logits, requests, positions=None):
            return SamplerOutput([7] * logits.shape[0])

    class Plugin:
        @staticmethod
        @infer.hookimpl
        def infer_register_samplers(register):
            register("always-seven", AlwaysSeven)

    llm = LLM(model=str(tiny_llama_dir), sampler="always-seven", plugins=[Plugin])
    out = llm.generate([[5, 6]], SamplingParams(max_tokens=3, ignore_eos=True))
    assert out[0].outputs[0].token_ids == [7, 7, 7]
    with pytest.raises(PluginNotFoundError, match="always-seven"):
        LLM(model=str(tiny_llama_dir), sampler="always-seven")  # not registered for this engine
