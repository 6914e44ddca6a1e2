"""`python -m benchmarks.lab.fp8_error`: its roundings are the FP8 layer's and e4m3's, and its w8a8 scheme on
HF transformers' model scores what the engine's `--quantization fp8` scores on the same windows."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks.lab import fp8_error
from infer import LLM, SamplingParams
from infer.plugins.layer.fp8 import quantize_weight

WINDOWS = ["--windows", "3", "--window-tokens", "96"]


def test_per_channel_rounding_is_what_the_fp8_layer_stores():
    w = torch.randn(48, 80, generator=torch.Generator().manual_seed(0)) * 0.05
    q, scale = quantize_weight(w)
    assert torch.equal(fp8_error.per_rows(w), q.float() * scale[:, None])
    assert torch.equal(fp8_error.per_groups(80)(w), fp8_error.per_rows(w))  # one group per row is per channel
    grouped = fp8_error.per_groups(32)(w)  # 80 columns: groups of 32, 32 and 16
    for start, stop in ((0, 32), (32, 64), (64, 80)):
        assert torch.equal(grouped[:, start:stop], fp8_error.per_rows(w[:, start:stop]))


def test_a_group_takes_its_own_scale():
    w = torch.randn(4, 64, generator=torch.Generator().manual_seed(1))
    w[:, :32] *= 1000  # the first half's amax would push the second half's values down to subnormals
    grouped = fp8_error.per_groups(32)(w)
    torch.testing.assert_close(grouped[:, 32:], fp8_error.per_rows(w[:, 32:]), rtol=0, atol=0)
    assert (grouped - w).abs()[:, 32:].max() < (fp8_error.per_rows(w) - w).abs()[:, 32:].max()


def test_three_significand_bits_are_e4m3_inside_its_normal_range():
    w = torch.empty(4096).uniform_(-8, 8, generator=torch.Generator().manual_seed(2))
    w = w[w.abs() >= 2**-6]  # e4m3's normals: below them it has fewer bits, and the rounding here does not
    assert torch.equal(fp8_error.significand(3)(w), w.to(torch.float8_e4m3fn).float())
    for bits in (3, 4):  # half a step of the significand: 2^-(bits + 1) of |w| at most
        assert ((fp8_error.significand(bits)(w) - w).abs() <= w.abs() * 2.0 ** -(bits + 1)).all()


def test_mse_scales_never_round_a_row_worse_than_the_amax_scale():
    w = torch.randn(64, 96, generator=torch.Generator().manual_seed(3))
    amax_err = (fp8_error.per_rows(w) - w).pow(2).sum(dim=1)
    mse_err = (fp8_error.per_rows_mse(w) - w).pow(2).sum(dim=1)
    assert (mse_err <= amax_err).all() and (mse_err < amax_err).any()


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
def test_the_bench_scores_every_scheme(tiny_llama_dir, tmp_path):
    out = tmp_path / "fp8_error.json"
    args = ["--model", str(tiny_llama_dir), *WINDOWS, "--calibration-windows", "2", "--out", str(out)]
    assert fp8_error.main(args) == 0
    rows = {r["scheme"]: r for r in json.loads(out.read_text())["rows"]}
    assert list(rows) == list(fp8_error.SCHEMES)
    assert rows["none"]["ratio"] == 1.0
    assert all(rows[s]["perplexity"] != rows["none"]["perplexity"] for s in list(rows)[1:])  # each rounds


def test_w8a8_on_hf_transformers_is_the_engines_fp8_model(tiny_llama_dir):
    """HF's model rounded as `w8a8` gives each token the logprob `--quantization fp8` gives it (float32
    products here, float64 sums of the same e4m3 values in the engine's reference layer), and rounding
    the weights alone does not: the check tells the two apart."""
    from transformers import AutoModelForCausalLM

    window = [(7 * i + 3) % 256 for i in range(64)]
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
    with LLM(model=str(tiny_llama_dir), quantization="fp8", device="cpu", dtype="float32") as llm:
        out = llm.generate([{"prompt_token_ids": window}], params)[0]
    engine = torch.tensor([scores[t] for scores, t in zip(out.prompt_logprobs[1:], window[1:], strict=True)])

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()

    def logprobs(scheme: str) -> torch.Tensor:
        with torch.no_grad(), fp8_error.rounded(model, scheme):
            lp = model(torch.tensor([window])).logits[0, :-1].log_softmax(-1)
        return lp[torch.arange(len(window) - 1), window[1:]]

    unrounded = logprobs("none")
    assert (logprobs("w8a8") - engine).abs().max() < 1e-5  # measured 1e-6
    assert (logprobs("per-channel") - engine).abs().max() > 1e-2
    assert torch.equal(logprobs("none"), unrounded)  # each scheme leaves the model as it found it


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
def test_the_gptq_scheme_rounds_as_the_quantize_command_writes(tiny_llama_dir, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from infer.tools import quantize

    windows = [[(5 * i + j) % 250 for j in range(48)] for i in range(3)]
    out = quantize.quantize_folder(tiny_llama_dir, tmp_path / "gptq", "gptq", windows, progress=lambda msg: None)
    stored = load_file(str(out / "model.safetensors"))
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    with fp8_error.rounded(model, "gptq", quantize.hessians(model, windows)):
        for name, m in fp8_error.projections(model).items():
            expected = stored[f"{name}.weight"].float() * stored[f"{name}.weight_scale"]
            assert torch.equal(m.weight.data, expected), name
