"""`infer doctor` and `infer plugins --matrix`: impossible combinations explained before any weight
loads, with inline plugins loaded through INFER_EXTRA_PLUGINS."""

from __future__ import annotations

import pytest
from click.testing import CliRunner
from fp8_checkpoints import with_kv_scales  # tests/, on sys.path

from infer.cli.main import cli

INLINE_PLUGINS = """
import torch
import infer
from infer.plugins.attention.torch_backend import TorchAttention


class PrefillOnly(TorchAttention):
    capabilities = infer.Capabilities(phases=frozenset({"prefill"}))


class Block16Only(TorchAttention):
    capabilities = infer.Capabilities(block_sizes=frozenset({16}))


class Bf16Only(TorchAttention):
    capabilities = infer.Capabilities(dtypes=frozenset({torch.bfloat16}))


class NoFp8(TorchAttention):
    capabilities = infer.Capabilities()  # no FP8 KV cache


class NeedsLibrary(TorchAttention):
    capabilities = infer.Capabilities(available=lambda: "fancykernels is not importable: pip install fancykernels")


class NeedsGrammarLibrary:
    capabilities = infer.Capabilities(available=lambda: "fancygrammar is not importable: pip install fancygrammar")

    def __init__(self, ctx):
        pass

    def admit(self, request):
        return None

    def apply(self, logits, rows):
        pass


class Plugin:
    @staticmethod
    @infer.hookimpl
    def infer_register_logits_processors(register):
        register("needs-grammar", NeedsGrammarLibrary)

    @staticmethod
    @infer.hookimpl
    def infer_register_attention_backends(register):
        register("prefill-only", PrefillOnly)
        register("block16-only", Block16Only)
        register("bf16-only", Bf16Only)
        register("needs-library", NeedsLibrary)
        register("no-fp8", NoFp8)
"""
SHAPE = ["--model", "smollm2-135m", "--load-format", "dummy", "--device", "cpu"]

IMPOSSIBLE = {
    "CUDA-only backend on the CPU": (
        ["--attention", "paged-cuda"],
        "attention",
        "--attention paged-cuda runs only on cuda, not on cpu",
        "torch",
    ),
    "prefill-only backend as decode attention": (
        ["--attention", "prefill-only"],
        "attention",
        "--attention prefill-only serves only prefill: use it as --prefill-attention",
        "torch",
    ),
    "needs-draft decoder without --draft": (
        ["--decoding", "speculative"],
        "decoding",
        "--decoding speculative needs a draft model: add --draft NAME",
        "autoregressive",
    ),
    "unsupported block size": (
        ["--attention", "block16-only", "--block-size", "32"],
        "attention",
        "--attention block16-only does not support --block-size 32: use one of 16",
        "torch",
    ),
    "unsupported dtype": (
        ["--attention", "bf16-only", "--dtype", "float32"],
        "attention",
        "--attention bf16-only does not support dtype float32: use --dtype bfloat16",
        "torch",
    ),
    "unavailable library": (
        ["--attention", "needs-library"],
        "attention",
        "--attention needs-library cannot run here: fancykernels is not importable",
        "torch",
    ),
}


@pytest.fixture
def invoke(tmp_path, monkeypatch):
    (tmp_path / "doctor_inline_plugins.py").write_text(INLINE_PLUGINS)
    monkeypatch.syspath_prepend(str(tmp_path))

    def run(*args: str):
        return CliRunner().invoke(
            cli, list(args), env={"INFER_EXTRA_PLUGINS": "doctor_inline_plugins:Plugin"}, catch_exceptions=False
        )

    return run


@pytest.mark.parametrize("case", list(IMPOSSIBLE), ids=list(IMPOSSIBLE))
def test_doctor_explains_an_impossible_combination(invoke, case):
    flags, slot, reason, alternative = IMPOSSIBLE[case]
    result = invoke("doctor", *SHAPE, *flags)
    assert result.exit_code == 2, result.output
    lines = result.output.splitlines()
    refused = next(i for i, line in enumerate(lines) if "REFUSED" in line)
    assert lines[refused].split()[0] == slot and reason in lines[refused]
    assert "runs here instead:" in lines[refused + 1] and alternative in lines[refused + 1].split(": ")[1]
    assert lines[-1].startswith("verdict: cannot run here (1 refusal)")
    assert all(
        line.split()[2] == "OK"
        for line in lines[2:-1]
        if line.strip() and "REFUSED" not in line and "runs here instead" not in line
    )


def test_doctor_passes_a_runnable_combination_and_checks_every_slot(invoke):
    result = invoke("doctor", *SHAPE, "--prefill-attention", "prefill-only", "--scheduler", "static")
    assert result.exit_code == 0, result.output
    slots = [line.split()[0] for line in result.output.splitlines()[2:-1]]
    assert slots == [
        "model",
        "attention",
        "prefill_attention",
        "kv_allocator",
        "scheduler",
        "sampler",
        "decoding",
        "detokenizer",
        "logits_processor",
    ]
    assert "(llama, 30 layers, 9/3 heads, dummy weights)" in result.output
    assert result.output.splitlines()[-1] == "verdict: runs here"


def test_doctor_reports_several_refusals_and_bad_names(invoke):
    result = invoke("doctor", *SHAPE, "--attention", "paged-cuda", "--sampler", "nope", "--decoding", "speculative")
    assert result.exit_code == 2
    assert "unknown --sampler 'nope': valid names are" in result.output
    assert "runs here instead: naive, vectorized" in result.output
    assert "verdict: cannot run here (3 refusals)" in result.output


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
@pytest.mark.parametrize("flag", ["--attention", "--prefill-attention"])
def test_doctor_refuses_fp8_kv_where_a_backend_has_none(invoke, flag):
    result = invoke("doctor", *SHAPE, flag, "no-fp8", "--kv-cache-dtype", "fp8")
    assert result.exit_code == 2, result.output
    refused = [line for line in result.output.splitlines() if "REFUSED" in line]
    assert len(refused) == 1 and refused[0].split()[0] == "combination", result.output
    assert (
        f"REFUSED: --kv-cache-dtype fp8 needs an attention backend with an FP8 KV cache and {flag} no-fp8 has "
        f"none: use {flag} with one that has it (flashinfer, paged-cuda, torch), or --kv-cache-dtype auto"
    ) in refused[0]
    assert invoke("doctor", *SHAPE, flag, "no-fp8").exit_code == 0
    assert invoke("doctor", *SHAPE, "--kv-cache-dtype", "fp8").exit_code == 0  # auto picks torch here


BUILTIN_PROCESSORS = ("allowed-tokens", "bad-words", "logit-bias", "min-tokens", "xgrammar")


def test_doctor_and_plugins_name_the_logits_processors_and_why_one_cannot_run(invoke):
    result = invoke("doctor", *SHAPE)
    assert result.exit_code == 0, result.output  # a processor that cannot run refuses nothing: it is left out
    (row,) = [line for line in result.output.splitlines() if line.split()[0] == "logits_processor"]
    assert row.split()[1:3] == ["all", "OK"], row
    ready = row.split(" ready: ")[1].split(";")[0].split(", ")
    assert set(BUILTIN_PROCESSORS) <= set(ready) and "needs-grammar" not in ready, row
    assert "; needs-grammar unavailable: fancygrammar is not importable: pip install fancygrammar)" in row
    rows = {line.split()[1]: line for line in invoke("plugins").output.splitlines() if line.startswith("logits_")}
    assert set(BUILTIN_PROCESSORS) | {"needs-grammar"} <= set(rows), rows
    assert rows["needs-grammar"].endswith("[unavailable: fancygrammar is not importable: pip install fancygrammar]")
    assert not any("unavailable" in rows[name] for name in BUILTIN_PROCESSORS)


def test_plugins_lists_the_backends_with_fp8_kv(invoke):
    lines = invoke("plugins").output.splitlines()
    for name in ("torch", "paged-cuda", "flashinfer"):
        assert any(name in line.split() and "fp8-kv" in line for line in lines), name
    assert not any("no-fp8" in line.split() and "fp8-kv" in line for line in lines)


def test_matrix_lists_the_combinations_that_run_here(invoke):
    result = invoke("plugins", "--matrix", "--device", "cpu")
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    runs = [line.split() for line in lines[2 : lines.index("refused (combinations: reason):")]]
    assert ["torch", "vectorized", "fcfs", "autoregressive"] in runs
    assert ["block16-only", "naive", "static", "autoregressive"] in runs
    assert not any(r[0] in ("paged-cuda", "prefill-only", "needs-library") or r[3] == "speculative" for r in runs)
    assert lines[0].startswith(f"{len(runs)} of ") and lines[0].endswith("run on cpu:")
    reasons = "\n".join(lines[lines.index("refused (combinations: reason):") :])
    for reason in (
        "--attention paged-cuda runs only on cuda",
        "--attention prefill-only serves only prefill",
        "fancykernels is not importable",
        "--decoding speculative needs a draft model",
    ):
        assert reason in reasons


def test_bad_extra_plugins_variable_is_one_line(tmp_path):
    result = CliRunner().invoke(cli, ["plugins"], env={"INFER_EXTRA_PLUGINS": "no_such_module:Plugin"})
    assert result.exit_code == 2
    assert "INFER_EXTRA_PLUGINS names 'no_such_module:Plugin', which cannot be loaded" in result.output


def test_all_reduce_verdict_names_missing_peer_access(monkeypatch):
    import torch

    from infer.api.config import EngineConfig
    from infer.tools import doctor

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b: False)
    cuda = torch.device("cuda", 0)
    auto = doctor._all_reduce(EngineConfig(tensor_parallel_size=2), cuda, torch.bfloat16)
    assert auto.ok and auto.note.startswith("auto picks nccl") and "GPU 0 has no peer access to GPU 1" in auto.note
    asked = doctor._all_reduce(EngineConfig(tensor_parallel_size=2, all_reduce="flashinfer"), cuda, torch.bfloat16)
    assert not asked.ok and "no peer access" in asked.reason and "nccl" in asked.alternatives


def test_doctor_names_the_linear_layer_of_a_quantization_and_refuses_an_unknown_one(invoke):
    result = invoke("doctor", *SHAPE, "--quantization", "fp8")
    assert result.exit_code == 0, result.output
    (row,) = [line for line in result.output.splitlines() if line.split()[0] == "quantization"]
    assert row.split()[1] == "fp8" and row.endswith("OK  (fp8: infer.plugins.layer.fp8.Fp8Linear)"), row
    result = invoke("doctor", *SHAPE, "--quantization", "int3")
    assert result.exit_code == 2, result.output
    assert "REFUSED: unknown --quantization 'int3': use one of awq, fp8, gguf, gptq, w4a16" in result.output
    result = invoke("doctor", *SHAPE, "--quantization", "fp8", "--tp", "2")  # the shards hold FP8 weights too
    assert "OK  (fp8: infer.plugins.layer.fp8.Fp8Linear)" in result.output, result.output


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
def test_doctor_says_which_scales_an_fp8_kv_cache_reads_with(invoke, tiny_llama_dir, tmp_path):
    def row(*args):
        result = invoke("doctor", "--device", "cpu", "--kv-cache-dtype", "fp8", "--model", *args)
        (line,) = [line for line in result.output.splitlines() if line.split()[0] == "kv_cache"]
        return result.exit_code, line

    code, line = row(str(tiny_llama_dir))
    assert code == 0 and line.endswith("OK  (scales 1.0: the checkpoint holds no calibrated KV scales)"), line
    code, line = row("smollm2-135m", "--load-format", "dummy")
    assert code == 0 and line.endswith("OK  (scales 1.0: dummy weights)"), line
    calibrated = with_kv_scales(tiny_llama_dir, tmp_path / "calibrated", [(0.5, 0.02), (2.0, 0.3), (1.0, 0.125)])
    code, line = row(str(calibrated))
    assert code == 0 and line.endswith("OK  (the checkpoint's calibrated scales, k 0.5-2, v 0.02-0.3)"), line
    broken = with_kv_scales(tiny_llama_dir, tmp_path / "broken", [(0.5, 0.02), (-2.0, 0.3)])
    code, line = row(str(broken))
    assert code == 2 and "REFUSED: tensor model.layers.1.self_attn.k_scale in " in line, line
    assert "kv_cache" not in invoke("doctor", "--device", "cpu", "--model", str(broken)).output  # a bf16 cache
