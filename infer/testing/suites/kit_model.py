"""Model conformance: for each HF architecture the plugin claims, a tiny random checkpoint that HF
transformers builds and saves; greedy tokens and logprobs through infer equal to HF's own model's at
tp 1, with prefix caching, chunked prefill, preemption, at tp 2 and at pp 2 (gloo). A failure names the first
layer whose output differs from HF's (for a model that is a `DecoderStack`)."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

from infer.api import AdaptableModel, HFArchitectures
from infer.core.registry import Strategy
from infer.testing import kit
from infer.testing.lora import check_lora
from infer.testing.model import (
    SETTINGS,
    Checkpoint,
    Setting,
    check_embeddings,
    check_model,
    kit_overrides,
    write_checkpoint,
)


def _skip(strategy: Strategy, setting: Setting) -> str | None:
    caps = strategy.capabilities
    if "cpu" not in caps.devices:
        return f"model {strategy.name} does not run on the CPU, where the kit runs it beside HF transformers"
    if (reason := strategy.unavailable_reason()) is not None:
        return f"model {strategy.name} cannot run here: {reason}"
    if setting.tp > 1 and not caps.distributed:
        return f"model {strategy.name} declares distributed=False"
    if setting.tp > 1 and "parallel" not in inspect.signature(strategy.factory).parameters:
        return f"model {strategy.name} takes no parallel= argument: it has no tensor-parallel form"
    if setting.pp > 1 and not caps.distributed:
        return f"model {strategy.name} declares distributed=False"
    if setting.pp > 1 and "stage" not in inspect.signature(strategy.factory).parameters:
        return f"model {strategy.name} takes no stage= argument: it has no pipeline-parallel form"
    return None


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "strategy" not in metafunc.fixturenames or "architecture" not in metafunc.fixturenames:
        return
    settings = SETTINGS if "setting" in metafunc.fixturenames else SETTINGS[:1]  # embeddings: tp 1 alone
    params = []
    for strategy in kit.strategies(metafunc.config, "model"):
        claimed = strategy.factory.hf_architectures if isinstance(strategy.factory, HFArchitectures) else ()
        if not claimed:
            reason = f"model {strategy.name} claims no HF architecture (hf_architectures): there is nothing to compare"
            values = (strategy, "", SETTINGS[0])[: 2 + ("setting" in metafunc.fixturenames)]
            params.append(pytest.param(*values, id=strategy.name, marks=pytest.mark.skip(reason=reason)))
        for architecture in claimed:
            for setting in settings:
                reason = _skip(strategy, setting)
                marks = [pytest.mark.skip(reason=reason)] if reason else []
                if "setting" in metafunc.fixturenames:
                    ident = f"{strategy.name}-{architecture}-{setting.name}"
                    params.append(pytest.param(strategy, architecture, setting, id=ident, marks=marks))
                else:
                    params.append(
                        pytest.param(strategy, architecture, id=f"{strategy.name}-{architecture}", marks=marks)
                    )
    names = (
        ("strategy", "architecture", "setting") if "setting" in metafunc.fixturenames else ("strategy", "architecture")
    )
    metafunc.parametrize(names, params)


@pytest.fixture(scope="session")
def checkpoints() -> dict[tuple[str, str], Checkpoint]:
    return {}  # (model plugin, architecture) -> its checkpoint, written once


def test_matches_hf_transformers(strategy, architecture, setting, checkpoints, tmp_path_factory) -> None:
    key = (strategy.name, architecture)
    if key not in checkpoints:
        folder: Path = tmp_path_factory.mktemp(f"infer-kit-{strategy.name}-{architecture}")
        checkpoints[key] = write_checkpoint(architecture, folder, kit_overrides(strategy.factory, architecture))
    check_model(checkpoints[key], strategy.name, setting)


def test_embeddings_match_hf_transformers(strategy, architecture, checkpoints, tmp_path_factory) -> None:
    """Pooled hidden states (`LLM.embed`, `/v1/embeddings`) equal HF's, per pooler, at tp 1."""
    key = (strategy.name, architecture)
    if key not in checkpoints:
        folder: Path = tmp_path_factory.mktemp(f"infer-kit-{strategy.name}-{architecture}")
        checkpoints[key] = write_checkpoint(architecture, folder, kit_overrides(strategy.factory, architecture))
    check_embeddings(checkpoints[key], strategy.name)


@pytest.mark.parametrize("tp", [1, 2])
def test_lora_adapters_match_hf_peft(strategy, architecture, tp, checkpoints, tmp_path_factory) -> None:
    """Three PEFT LoRA adapters served at once (`--enable-lora`), each equal to HF + PEFT merged, and a
    batch mixing them with the base giving each request its tokens alone; at tp 1 and 2 (gloo). A model
    plugin that is no `AdaptableModel` must refuse --enable-lora with a ConfigError instead."""
    if tp > 1 and (reason := _skip(strategy, SETTINGS[-1])) is not None:
        pytest.skip(reason)
    key = (strategy.name, architecture)
    if key not in checkpoints:
        folder: Path = tmp_path_factory.mktemp(f"infer-kit-{strategy.name}-{architecture}")
        checkpoints[key] = write_checkpoint(architecture, folder, kit_overrides(strategy.factory, architecture))
    if not isinstance(strategy.factory, type) or not issubclass(strategy.factory, AdaptableModel):
        # a model that serves no adapters refuses them before any weight loads, naming why
        from infer.api.errors import ConfigError
        from infer.llm import LLM

        with pytest.raises(ConfigError, match="AdaptableModel"):
            LLM(model=str(checkpoints[key].folder), model_impl=strategy.name, device="cpu", enable_lora=True,
                tensor_parallel_size=tp)  # fmt: skip
        return
    pytest.importorskip("peft", reason="the adapter check compares against PEFT: pip install peft")
    check_lora(checkpoints[key], strategy.name, tmp_path_factory.mktemp(f"lora-{strategy.name}-tp{tp}"), tp)
