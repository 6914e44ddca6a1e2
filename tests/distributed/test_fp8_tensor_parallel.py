"""FP8 weights under tensor parallelism (`--quantization fp8 --tp 2`, CPU ranks over gloo): the sharded
projections hold e4m3 values with tp = 1's scales (column-parallel: their rows'; row-parallel: each full
row's), and row-parallel shards quantize their own columns of the input per row: tp = 2 holds tp = 1's weights
and gives the tokens and logprobs of tp = 1 computing each row-parallel product as the two ranks do, for a float
checkpoint quantized at load, an FP8 checkpoint (llm-compressor's compressed-tensors layout, or a scale per
tensor) and dummy weights."""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import pytest
import torch
from fp8_checkpoints import is_projection, stored
from safetensors.torch import load_file, save_file

from infer import LLM, SamplingParams
from infer.api.errors import ConfigError
from infer.distributed import layers as tp
from infer.distributed.state import ParallelState
from infer.loading.shards import shard_of
from infer.plugins.layer.fp8 import FP8, Fp8Linear

PROMPTS = [[5, 6, 7, 8, 9], [10, 11], list(range(20, 60)), [100, 7, 200, 13, 99, 42]]
LOGPROBS = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=5)


def _fp8_checkpoint(source, folder, per_tensor: bool):
    """The tiny Llama's projections stored in FP8: a scale per output channel ([N, 1], compressed-tensors)
    or one per tensor (the `fp8` layout)."""
    tensors = {}
    for name, t in load_file(str(source / "model.safetensors")).items():
        if not is_projection(name):
            tensors[name] = t
            continue
        tensors[name], tensors[name + "_scale"] = stored(t, per_tensor)
    weights = {"type": "float", "num_bits": 8, "strategy": "channel", "symmetric": True, "dynamic": False}
    groups = {"group_0": {"targets": ["Linear"], "weights": weights}}
    quantization = (
        {"quant_method": "fp8", "activation_scheme": "dynamic"}
        if per_tensor
        else {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": groups}
    )
    shutil.copytree(source, folder)
    save_file(tensors, str(folder / "model.safetensors"))
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "quantization_config": quantization}))
    return folder


def _as_ranks(linear: Fp8Linear, tp: int) -> None:
    """Make tp = 1's row-parallel projection compute as `tp` ranks do: each quantizes its own columns of x
    per row and multiplies them by its columns of the weights; the partial sums, each in x's dtype, are added."""
    columns = linear.in_features // tp
    ranks = []
    for r in range(tp):
        rank = Fp8Linear(columns, linear.out_features)
        rank.weight.data.copy_(linear.weight[:, r * columns : (r + 1) * columns])
        rank.weight_scale.data.copy_(linear.weight_scale)
        ranks.append(rank)
    linear.forward = lambda x: sum(rank(part) for rank, part in zip(ranks, x.split(columns, dim=-1)))


def _run(tp: int, as_ranks: int = 1, **options):
    """(outputs, rank 0's parameters, rank 0's model); `as_ranks`: tp = 1's row-parallel products computed
    as that many ranks compute them (`_as_ranks`)."""
    with LLM(tensor_parallel_size=tp, device="cpu", dtype="float32", block_size=4, **options) as llm:
        model = llm.engine.decoder.runner.model  # rank 0's
        if as_ranks > 1:
            for layer in model.layers:
                _as_ranks(layer.self_attn.o_proj, as_ranks)
                _as_ranks(layer.mlp.down_proj, as_ranks)
        qkv, down = model.layers[0].self_attn.qkv_proj, model.layers[0].mlp.down_proj
        assert isinstance(qkv, Fp8Linear) and qkv.weight.dtype == FP8 and down.weight.dtype == FP8
        assert down.weight_scale.shape == (down.out_features,)  # a row-parallel shard keeps every row's scale
        params = {name: p.detach().float().clone() for name, p in model.named_parameters()}
        return llm.generate([{"prompt_token_ids": p} for p in PROMPTS], LOGPROBS), params, model


def _assert_same(expected, actual, atol=1e-5):
    for e, a in zip(expected, actual, strict=True):
        e, a = e.outputs[0], a.outputs[0]
        assert e.token_ids == a.token_ids
        for step_e, step_a in zip(e.logprobs, a.logprobs, strict=True):
            assert step_e.keys() == step_a.keys()
            assert max(abs(step_e[t] - step_a[t]) for t in step_e) < atol


def _assert_shards_of(full: dict, sharded: dict, model) -> None:
    """Rank 0's parameters are its slices of tp = 1's, bit for bit (e4m3 values and scales)."""
    for name, param in sharded.items():
        shard = shard_of(model, name)
        expected = full[name] if shard is None else torch.empty_like(param)
        if shard is not None:
            shard.take(expected, full[name])
        assert torch.equal(param, expected), name


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
@pytest.mark.parametrize("weights", ["quantized-at-load", "compressed-tensors", "per-tensor"])
def test_fp8_tp2_gives_tp1s_tokens_and_logprobs(tiny_llama_dir, tmp_path, weights):
    options = dict(model=str(tiny_llama_dir), quantization="fp8")
    if weights != "quantized-at-load":
        options = dict(model=str(_fp8_checkpoint(tiny_llama_dir, tmp_path / "fp8", weights == "per-tensor")))
    (expected, full, _), (actual, sharded, model) = _run(1, as_ranks=2, **options), _run(2, **options)
    _assert_shards_of(full, sharded, model)
    _assert_same(expected, actual)


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
def test_dummy_fp8_weights_are_tp1s_at_tp2(tiny_llama_dir):
    options = dict(model=str(tiny_llama_dir), quantization="fp8", load_format="dummy", seed=3)
    (expected, full, _), (actual, sharded, model) = _run(1, as_ranks=2, **options), _run(2, **options)
    _assert_shards_of(full, sharded, model)
    _assert_same(expected, actual)


def test_a_quantized_linear_that_cannot_hold_columns_is_refused_under_tp():
    class RowsOnly(torch.nn.Module):  # a `QuantizedLinear` with no `load_columns`
        quantization = "rows-only"

        def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
            super().__init__()

        def load_rows(self, name, offset, size, tensor):
            return []

    config = SimpleNamespace(hidden_size=64, intermediate_size=160)
    with pytest.raises(ConfigError, match="cannot hold a row-parallel shard.*use --tp 1"):
        tp.mlp_projections(config, ParallelState(rank=0, world_size=2), quantized=RowsOnly)
    gate_up, down = tp.mlp_projections(config, ParallelState(rank=1, world_size=2), quantized=Fp8Linear)
    assert gate_up.weight.shape == (160, 64) and down.weight.shape == (64, 80) and down.weight_scale.shape == (64,)
