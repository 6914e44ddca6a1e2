"""What each family reads from its config, what it refuses, its named shapes, and an oracle that
sees every feature the parity tests rely on."""

from __future__ import annotations

import json

import pytest
from families import FAMILIES, PLUGINS, WINDOW, check_against_hf, hf_config, hf_logprobs, hf_model, prompts

import infer
from infer import SamplingParams
from infer.api import Capabilities
from infer.api.errors import IncompatiblePluginsError, ModelLoadError, PluginNotFoundError
from infer.core.registry import PluginRegistry
from infer.llm import LLM
from infer.loading.config import model_config_from_hf
from infer.loading.loader import meta_model, resolve_source
from infer.plugins.attention.torch_backend import TorchAttention

W = WINDOW
WINDOWS = {  # transformers' layer_types, as layer_windows
    "llama": (),
    "qwen2": (None, W, W),  # max_window_layers=1: layers from 1 on
    "qwen3": (None, None, W),
    "mistral": (W, W, W),  # no layer_types: every layer
    "phi3": (W, W, W),
    "gemma2": (W, None, W),  # alternating, from layer 0
}


@pytest.mark.parametrize("family", FAMILIES)
def test_config_fields_a_family_needs(family):
    config = model_config_from_hf(hf_config(family))
    assert config.architecture == f"{FAMILIES[family][0].removesuffix('Config')}ForCausalLM"
    assert config.layer_windows == WINDOWS[family]
    if family == "gemma2":
        assert config.attention_scale == 24**-0.5 and config.attention_soft_cap == 2.0
        assert (
            config.extra["final_logit_softcapping"] == 3.0 and config.extra["hidden_activation"] == "gelu_pytorch_tanh"
        )
    else:
        assert config.attention_scale is None and config.attention_soft_cap is None
    if family == "qwen3":
        assert config.head_dim == 32
    if family == "phi3":
        assert config.rope().rotary_dim == 8 and config.rope().attention_scaling > 1.1
    assert model_config_from_hf(hf_config(family, sliding_window=None)).layer_windows == ()


def test_qwen_windows_only_when_asked():
    assert model_config_from_hf(hf_config("qwen2", use_sliding_window=False)).layer_windows == ()


# published parameter counts of the checkpoints the named shapes copy
PUBLISHED = {
    "qwen2.5-7b": ("qwen2", 7_615_616_512),
    "qwen3-8b": ("qwen3", 8_190_735_360),
    "mistral-7b": ("mistral", 7_241_732_096),
    "phi3-mini": ("phi3", 3_821_079_552),
    "gemma2-9b": ("gemma2", 9_241_705_984),
}


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
@pytest.mark.parametrize("shape", PUBLISHED)
def test_named_shapes_have_the_published_sizes(shape):
    registry = PluginRegistry.load(PLUGINS)
    source = resolve_source(shape, registry, "dummy")
    assert source.architecture.name == PUBLISHED[shape][0]
    config = source.model_config()
    model = meta_model(source, config, registry.layers("cpu"))
    assert sum(p.numel() for p in model.parameters()) == PUBLISHED[shape][1]
    if shape in ("mistral-7b", "phi3-mini", "gemma2-9b"):
        assert config.sliding_windows() == ({"mistral-7b": 4096, "phi3-mini": 2047, "gemma2-9b": 4096}[shape],)


@pytest.mark.parametrize(
    "family, change",
    [
        ("qwen2", dict(use_sliding_window=False)),
        ("mistral", dict(sliding_window=None)),
        ("phi3", dict(rope_scaling=None)),
        ("phi3", dict(partial_rotary_factor=1.0, rope_scaling=None)),
        ("gemma2", dict(attn_logit_softcapping=None)),
        ("gemma2", dict(final_logit_softcapping=None)),
        ("gemma2", dict(query_pre_attn_scalar=16)),
    ],
)
def test_the_oracle_sees_each_feature(family, change):
    """The same weights without the feature give other log-probabilities (far beyond the parity
    tests' 1e-4) on the sequences those tests check: a plugin that ignored it would fail them."""
    seqs = [(p[:-8], p[-8:]) for p in prompts()[3:7]]  # windows of 10 are exceeded, caps bite
    with_it, without = hf_model(hf_config(family)), hf_model(hf_config(family, **change))
    gap = max((hf_logprobs(with_it, *s) - hf_logprobs(without, *s)).abs().max().item() for s in seqs)
    assert gap > 1e-2


def test_unknown_architecture_is_refused_naming_the_supported_ones(tmp_path):
    from transformers import GPT2Config

    config = GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)
    config.architectures = ["GPT2LMHeadModel"]
    config.save_pretrained(tmp_path)
    with pytest.raises(PluginNotFoundError, match=r"'GPT2LMHeadModel'.*Gemma2ForCausalLM.*Qwen3ForCausalLM") as err:
        LLM(model=str(tmp_path), device="cpu", plugins=PLUGINS)
    assert "\n" not in str(err.value)


class PlainAttention(TorchAttention):  # the same kernels, declaring no sliding window
    capabilities = Capabilities()


class Plain:
    @staticmethod
    @infer.hookimpl
    def infer_register_attention_backends(register):
        register("plain", PlainAttention)


def test_windowed_mistral_is_refused_by_a_backend_without_windows(checkpoints):
    folder = checkpoints("mistral").folder
    with pytest.raises(IncompatiblePluginsError, match=r"sliding-window .*window 10 .*--attention plain"):
        LLM(model=str(folder), device="cpu", attention="plain", plugins=[*PLUGINS, Plain])
    with LLM(model=str(folder), device="cpu", attention="plain", max_model_len=W, plugins=[*PLUGINS, Plain]) as llm:
        assert len(llm.generate([[5, 6, 7]], infer.SamplingParams(max_tokens=4))[0].outputs[0].token_ids) == 4


class WindowedCopy(TorchAttention):  # a second backend with windows, to compose with torch
    pass


class Copy:
    @staticmethod
    @infer.hookimpl
    def infer_register_attention_backends(register):
        register("torch-copy", WindowedCopy)


def test_windows_reach_both_backends_of_a_composed_pair(checkpoints):
    """--prefill-attention X --attention Y: each half gets the layer's window."""
    ckpt = checkpoints("mistral")
    options = dict(model=str(ckpt.folder), device="cpu", dtype="float32", block_size=4)
    with LLM(prefill_attention="torch-copy", attention="torch", plugins=[*PLUGINS, Copy], **options) as llm:
        assert llm.engine.parts.describe["prefill_attention"] == "torch-copy"
        outs = llm.generate(prompts(), SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    check_against_hf(ckpt.model, prompts(), [o.outputs[0] for o in outs])


def test_family_refusals_name_the_setting(tmp_path, checkpoints):
    folder = checkpoints("gemma2").folder
    config = json.loads((folder / "config.json").read_text())
    bad = tmp_path / "gelu-exact"
    bad.mkdir()
    for f in folder.iterdir():
        (bad / f.name).symlink_to(f)
    (bad / "config.json").unlink()
    (bad / "config.json").write_text(json.dumps({**config, "hidden_activation": "gelu"}))
    with pytest.raises(ModelLoadError, match=r"hidden_activation 'gelu'.*use one of silu, gelu_pytorch_tanh"):
        LLM(model=str(bad), device="cpu", plugins=PLUGINS)
