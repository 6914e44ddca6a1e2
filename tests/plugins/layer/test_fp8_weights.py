"""FP8 weights (`--quantization fp8`): the layer against its dequantized reference, and whole models loaded
three ways (a float checkpoint quantized at load, llm-compressor's compressed-tensors layout, the per-tensor
`fp8` layout) against HF transformers' own model on the dequantized weights, its projections' inputs
quantized per token as the FP8 layer quantizes them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from fp8_checkpoints import PROJECTIONS, is_projection, stored
from safetensors.torch import load_file, save_file

from infer import LLM, SamplingParams
from infer.api.errors import ModelLoadError, PluginNotFoundError
from infer.kernels.fp8_reference import quantize_rows_reference as quantize_rows
from infer.plugins.layer.fp8 import FP8, Fp8Linear, quantize_weight

PROMPTS = [[1, 17, 93, 5], [1, 200, 3], [1, 44, 45, 46, 47, 9], [1, 128]]


def test_quantized_weights_round_to_nearest_with_a_scale_per_row():
    w = torch.randn(24, 40) * torch.logspace(-3, 1, 24)[:, None]  # rows of very different ranges
    w[5] = 0.0
    q, scale = quantize_weight(w)
    assert q.dtype == FP8 and scale.shape == (24,)
    assert torch.equal(q.float().abs().amax(dim=1)[torch.arange(24) != 5], torch.full((23,), 448.0))
    assert scale[5] == 1.0 and not q[5].float().any()
    # e4m3 keeps 3 mantissa bits: at most half a step (2^-4 of the value) off, for values above 2^-6 * scale
    deq = q.float() * scale[:, None]
    normal = w.abs() >= 2**-6 * scale[:, None]
    assert ((deq - w).abs() <= w.abs() * 2**-4 + 1e-12)[normal].all()


@pytest.mark.parametrize("rows", [1, 2, 37])
def test_the_linear_layer_is_the_product_of_the_dequantized_values(rows):
    torch.manual_seed(0)
    layer = Fp8Linear(40, 24, bias=True)
    w, b = torch.randn(24, 40), torch.randn(24)
    assert layer.load_rows("weight", 0, 24, w) == ["weight", "weight_scale"]
    layer.load_rows("bias", 0, 24, b)
    x = torch.randn(rows, 40)
    deq = layer.weight.float() * layer.weight_scale[:, None]
    q, s = quantize_rows(x)  # activations quantized per row too (W8A8)
    x_used = q.float() * s
    assert not torch.equal(x_used, x)
    expected = x_used.double() @ deq.double().T + b.double()
    torch.testing.assert_close(layer(x).double(), expected, rtol=1e-5, atol=1e-5)  # float32 sums


def test_rows_of_a_fused_projection_load_piece_by_piece_with_their_own_scales():
    layer = Fp8Linear(16, 12)
    pieces = [torch.randn(4, 16) * 10**i for i in range(3)]  # q, k, v of very different ranges
    for i, piece in enumerate(pieces):
        layer.load_rows("weight", 4 * i, 4, piece)
    q, scale = quantize_weight(torch.cat(pieces))
    assert torch.equal(layer.weight.view(torch.uint8), q.view(torch.uint8)) and torch.equal(layer.weight_scale, scale)
    # an FP8 checkpoint: values as they are, one scale for a tensor's rows or one per row ([N, 1] or [N])
    layer.load_rows("weight", 0, 12, q)
    layer.load_rows("weight_scale", 0, 4, torch.tensor(0.5))
    layer.load_rows("weight_scale", 4, 8, torch.arange(8.0).view(8, 1))
    assert layer.weight_scale.tolist() == [0.5] * 4 + list(range(8))
    assert layer.load_rows("input_scale", 0, 12, torch.tensor(1.0)) == []


def _save(folder: Path, source: Path, tensors: dict, quantization: dict | None = None) -> Path:
    folder.mkdir()
    for f in source.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, folder / f.name)
    save_file(tensors, str(folder / "model.safetensors"))
    if quantization is not None:
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, "quantization_config": quantization}))
    return folder


def _checkpoints(source: Path, tmp: Path, per_tensor: bool, scale_dtype=torch.float32) -> tuple[Path, Path]:
    """(an FP8 checkpoint, the same values dequantized in float32 for HF transformers)."""
    tensors = load_file(str(source / "model.safetensors"))
    fp8, dequantized = {}, {}
    for name, t in tensors.items():
        if not is_projection(name):
            fp8[name] = dequantized[name] = t
            continue
        q, scale = stored(t, per_tensor)
        scale = scale.to(scale_dtype)
        fp8[name], fp8[name + "_scale"] = q, scale
        fp8[name.removesuffix("weight") + "input_scale"] = torch.tensor([1.0])  # static scales are not read
        dequantized[name] = q.float() * scale.float()
    if per_tensor:
        config = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    else:
        weights = {"type": "float", "num_bits": 8, "strategy": "channel", "symmetric": True, "dynamic": False}
        config = {
            "quant_method": "compressed-tensors",
            "format": "float-quantized",
            "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}},
        }
    return _save(tmp / "fp8", source, fp8, config), _save(tmp / "dequantized", source, dequantized)


def _greedy(llm: LLM, n: int = 12) -> list[list[int]]:
    sp = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    return [llm.generate([{"prompt_token_ids": p}], sp)[0].outputs[0].token_ids for p in PROMPTS]


def _quantize_inputs(module, args):
    """HF's projections given what an FP8 layer multiplies: x quantized per token, dequantized."""
    x = args[0].reshape(-1, args[0].shape[-1])
    q, scale = quantize_rows(x)
    return ((q.float() * scale).view_as(args[0]),)


def _hf(folder: Path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    for name, module in model.named_modules():
        if name.split(".")[-1] in PROJECTIONS:
            module.register_forward_pre_hook(_quantize_inputs)
    return model


def _assert_hf_greedy(folder: Path, outputs: list[list[int]]) -> None:
    """Each engine token is HF's greedy pick given the same prefix (one forward over prompt + output: every
    row is quantized on its own, as in decode), or within 1e-4 of it: a float32 sum taken in another order
    can move an activation across an e4m3 rounding boundary, which near-ties feel."""
    model = _hf(folder)
    for prompt, out in zip(PROMPTS, outputs, strict=True):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + out])).logits[0, len(prompt) - 1 : -1].double()
        picked = logits.gather(1, torch.tensor(out)[:, None])[:, 0]
        assert (logits.max(dim=1).values - picked < 1e-4).all(), (prompt, out, logits.argmax(dim=1).tolist())


def _model(llm: LLM) -> torch.nn.Module:
    return llm.engine.decoder.runner.model


def _llm(folder: Path, **kwargs) -> LLM:
    return LLM(str(folder), dtype="fp32", device="cpu", num_kv_blocks=64, **kwargs)


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
@pytest.mark.parametrize("per_tensor", [False, True], ids=["compressed-tensors", "per-tensor"])
def test_an_fp8_checkpoint_runs_as_hf_transformers_runs_its_dequantized_weights(tiny_llama_dir, tmp_path, per_tensor):
    fp8, dequantized = _checkpoints(tiny_llama_dir, tmp_path, per_tensor)
    _assert_hf_greedy(dequantized, _greedy(_llm(fp8)))  # no --quantization: the checkpoint's


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
def test_quantizing_at_load_stores_what_an_fp8_checkpoint_stores(tiny_llama_dir, tmp_path):
    fp8, _ = _checkpoints(tiny_llama_dir, tmp_path, per_tensor=False)
    at_load = _llm(tiny_llama_dir, quantization="fp8")
    saved = _llm(fp8, quantization="fp8")
    state = [_model(llm).state_dict() for llm in (at_load, saved)]
    for name, tensor in state[0].items():
        assert torch.equal(tensor.view(torch.uint8), state[1][name].view(torch.uint8)), name
    assert state[0]["layers.0.self_attn.qkv_proj.weight"].dtype == FP8
    assert state[0]["lm_head.weight"].dtype == torch.float32  # the LM head keeps the model's dtype
    assert _greedy(at_load) == _greedy(saved)


def test_a_bf16_scale_checkpoint_and_a_long_prefill_run_as_hf_transformers_does(tiny_llama_dir, tmp_path):
    fp8, dequantized = _checkpoints(tiny_llama_dir, tmp_path, per_tensor=False, scale_dtype=torch.bfloat16)
    _assert_hf_greedy(dequantized, _greedy(_llm(fp8)))
    # a 40-token prompt's next-token distribution, as HF's model given the same quantized inputs
    prompt = [1, *range(100, 139)]
    hf = _hf(dequantized)
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0, -1].double(), -1)
    sp = SamplingParams(max_tokens=1, temperature=0, logprobs=5)
    out = _llm(fp8).generate([{"prompt_token_ids": prompt}], sp)[0].outputs[0]
    assert out.token_ids[0] == int(ref.argmax())
    for token, lp in out.logprobs[0].items():  # float32 sums in another order
        assert abs(lp - float(ref[token])) < 1e-5, (token, lp, float(ref[token]))


def test_dummy_fp8_weights_run(tiny_llama_dir):
    llm = _llm(tiny_llama_dir, load_format="dummy", quantization="fp8")
    weight = _model(llm).state_dict()["layers.0.mlp.gate_up_proj.weight"]
    assert weight.dtype == FP8 and weight.float().abs().amax() == 448.0
    assert len(_greedy(llm, 4)[0]) == 4


def test_unknown_conflicting_and_unloadable_quantizations_are_refused(tiny_llama_dir, tmp_path):
    with pytest.raises(
        PluginNotFoundError, match="unknown --quantization 'int3': use one of awq, fp8, gguf, gptq, w4a16"
    ):
        _llm(tiny_llama_dir, quantization="int3")
    bnb = _save(
        tmp_path / "bnb",
        tiny_llama_dir,
        load_file(str(tiny_llama_dir / "model.safetensors")),
        {"quant_method": "bitsandbytes"},
    )
    with pytest.raises(ModelLoadError, match="quantized with 'bitsandbytes'.*use the model's bf16 checkpoint"):
        _llm(bnb)
    blocks = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    blocked = _save(tmp_path / "blocked", tiny_llama_dir, {}, blocks)
    with pytest.raises(ModelLoadError, match=r"scale per \[128, 128\] block"):
        _llm(blocked)


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
@pytest.mark.parametrize("rows", [1, 2, 19])
def test_the_fused_fp8_layer_runs_the_reference_math_in_its_kernels(rows):
    """Under Triton's interpreter on the CPU (fp16: it multiplies bf16 wrongly): the quantizing kernels (norm,
    activation, plain), then the GEMV over e4m3 x and weights for one row, the scaled product for more."""
    from infer.plugins.layer.fp8_fused import FusedFp8Linear
    from infer.plugins.layer.fused import FusedRMSNorm
    from infer.plugins.layer.torch_layers import RMSNorm, SiluAndMul

    torch.manual_seed(0)
    ref, fused = Fp8Linear(64, 48), FusedFp8Linear(64, 48)
    w = torch.randn(48, 64)
    for layer in (ref, fused):
        layer.load_rows("weight", 0, 48, w)
    x = torch.randn(rows, 64, dtype=torch.float16)
    torch.testing.assert_close(fused(x), ref(x), rtol=2e-3, atol=2e-3)  # an fp16 rounding step apart
    h = torch.randn(rows, 128, dtype=torch.float16)
    torch.testing.assert_close(fused.gated(h), ref(SiluAndMul()(h)), rtol=2e-3, atol=2e-3)
    norm = FusedRMSNorm(64, 1e-5).to(torch.float16)
    norm.quantize_output = fused.takes_quantized_input
    r = torch.randn(rows, 64, dtype=torch.float16)
    normed, residual = norm(x, r)
    expected, expected_residual = RMSNorm.forward(norm, x, r)
    assert torch.equal(residual, expected_residual)
    assert not isinstance(normed, torch.Tensor)  # quantized in the norm's kernel: `QuantizedRows`
    torch.testing.assert_close(fused(normed), ref(expected), rtol=2e-3, atol=2e-3)


def test_speculative_decoding_of_an_fp8_model_gives_its_autoregressive_tokens(tiny_llama_dir):
    """Every row is quantized on its own and its sums are exact, so K + 1 verified rows give what K + 1
    one-row steps give where attention gives the same bits both ways (it does here; on SmolLM2 decode and
    verify attention differ by float32 rounding, which e4m3 rounding can amplify: docs/performance.md, "FP8")."""
    prompts = [{"prompt_token_ids": [1, 5, 6, 7, 5, 6, 7, 5, 6]}, {"prompt_token_ids": [1, 9, 9, 9, 9, 9, 9]}]
    sp = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    plain = _llm(tiny_llama_dir, quantization="fp8").generate(prompts, sp)
    spec = _llm(tiny_llama_dir, quantization="fp8", decoding="speculative", draft="ngram").generate(prompts, sp)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]


def test_an_fp8_tensor_for_a_layer_left_unquantized_is_refused(tiny_llama_dir, tmp_path):
    fp8, _ = _checkpoints(tiny_llama_dir, tmp_path, per_tensor=False)
    tensors = load_file(str(fp8 / "model.safetensors"))
    q, scale = quantize_weight(tensors["lm_head.weight"])  # a checkpoint that quantized its LM head too
    tensors["lm_head.weight"], tensors["lm_head.weight_scale"] = q, scale[:, None]
    save_file(tensors, str(fp8 / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="lm_head.weight is stored in FP8 but the layer it fills is not quantized"):
        _llm(fp8)


def test_gemma2_quantizes_the_mlp_input_at_its_pre_feedforward_norm():
    """Gemma 2's post-attention norm norms the attention output; the MLP's input is the pre-feedforward norm's."""
    from infer.api import Layers
    from infer.loading.config import model_config_from_hf
    from infer.plugins.layer import torch_layers as plain
    from infer.plugins.layer.fp8_fused import FusedFp8Linear
    from infer.plugins.layer.fused import FusedRMSNorm
    from infer.plugins.model.gemma2 import Gemma2

    hf = dict(model_type="gemma2", architectures=["Gemma2ForCausalLM"], vocab_size=256, hidden_size=64)
    hf |= dict(intermediate_size=160, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    hf |= dict(head_dim=16, max_position_embeddings=128, hidden_activation="gelu_pytorch_tanh")
    layers = Layers(
        rms_norm=FusedRMSNorm,
        rotary_embedding=plain.RotaryEmbedding,
        silu_and_mul=plain.SiluAndMul,
        linear=plain.Linear,
        gelu_and_mul=plain.GeluAndMul,
        quantized_linear=FusedFp8Linear,
    )
    with torch.device("meta"):
        layer = Gemma2(model_config_from_hf(hf), layers, None).layers[0]
    assert layer.input_layernorm.quantize_output and layer.pre_feedforward_layernorm.quantize_output
    assert not layer.post_attention_layernorm.quantize_output and not layer.post_feedforward_layernorm.quantize_output
