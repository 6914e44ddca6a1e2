"""A checkpoint's calibrated FP8 KV-cache scales, in each layout quantizers write them."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from infer.api.errors import ModelLoadError
from infer.loading.kv_scales import read_kv_scales


def _folder(tmp_path, *files: dict[str, torch.Tensor]):
    for i, tensors in enumerate(files):
        save_file(tensors, str(tmp_path / f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"))
    return tmp_path


def test_each_layout_gives_its_layers_scales(tmp_path):
    weight = {"model.layers.0.self_attn.k_proj.weight": torch.zeros(4, 4)}
    folder = _folder(
        tmp_path,
        {
            **weight,
            "model.layers.0.self_attn.k_scale": torch.tensor(0.5),  # llm-compressor's kv_cache_scheme
            "model.layers.0.self_attn.v_scale": torch.tensor([0.25]),
            "model.layers.1.self_attn.k_proj.output_scale": torch.tensor([2.0]),  # older compressed-tensors
            "model.layers.1.self_attn.v_proj.output_scale": torch.tensor([3.0]),
        },
        {
            "model.layers.2.self_attn.k_scale": torch.tensor(6.0),  # the layer's own k and v scales win,
            "model.layers.2.self_attn.kv_scale": torch.tensor(5.0),  # AutoFP8's one for both, whatever the order
            "model.layers.2.self_attn.v_scale": torch.tensor(7.0),
            "model.layers.3.self_attn.qkv_proj.v_scale": torch.tensor(9.0),  # a fused qkv's
            "model.layers.4.self_attn.k_proj.k_scale": torch.tensor([0.1, 0.7]),  # ModelOpt, one a head: the max
            "model.layers.4.self_attn.v_proj.v_scale": torch.tensor(0.3, dtype=torch.bfloat16),
            "model.layers.9.self_attn.k_scale": torch.tensor(-1.0),  # past the layers that run: not read
        },
    )
    scales = read_kv_scales(folder, 5)
    assert scales == [(0.5, 0.25), (2.0, 3.0), (6.0, 7.0), (1.0, 9.0), (pytest.approx(0.7), pytest.approx(0.30078125))]
    assert read_kv_scales(folder, 2) == [(0.5, 0.25), (2.0, 3.0)]  # layers past those that run are not read


def test_a_checkpoint_without_kv_scales_gives_none(tmp_path):
    folder = _folder(tmp_path, {"model.layers.0.self_attn.k_proj.weight": torch.zeros(4, 4)})
    assert read_kv_scales(folder, 2) is None


@pytest.mark.parametrize(
    "value", [0.0, -0.5, float("nan"), float("inf"), []], ids=["zero", "negative", "nan", "inf", "empty"]
)
def test_a_scale_that_is_no_positive_number_is_refused_naming_it(tmp_path, value):
    folder = _folder(tmp_path, {"model.layers.1.self_attn.v_scale": torch.tensor(value, dtype=torch.float32)})
    with pytest.raises(ModelLoadError) as refused:
        read_kv_scales(folder, 2)
    message = str(refused.value)
    assert "model.layers.1.self_attn.v_scale" in message and "positive, finite" in message
    assert message.endswith("or drop --kv-cache-dtype fp8 (its cache then keeps the model's dtype)")


def test_two_different_scales_for_one_layer_are_refused(tmp_path):
    folder = _folder(
        tmp_path,
        {
            "model.layers.0.self_attn.k_scale": torch.tensor(0.5),
            "model.layers.0.self_attn.k_proj.output_scale": torch.tensor([0.5]),  # the same value: taken
            "model.layers.1.self_attn.v_scale": torch.tensor(0.5),
            "model.layers.1.self_attn.v_proj.output_scale": torch.tensor([0.75]),
        },
    )
    assert read_kv_scales(folder, 1) == [(0.5, 1.0)]
    with pytest.raises(ModelLoadError, match="two v_scale values for layer 1") as refused:
        read_kv_scales(folder, 2)
    assert "model.layers.1.self_attn.v_proj.output_scale = 0.75" in str(refused.value)
