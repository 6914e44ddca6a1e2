"""The conformance kit: the example plugin passes it through `pytest --infer-kit`; deliberately broken
strategies fail it with messages that point at the fault."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import infer
from infer.api import Capabilities, SamplerOutput
from infer.core.registry import PluginRegistry
from infer.plugins.attention.torch_backend import TorchAttention
from infer.plugins.kv_allocator.paged import PagedAllocator
from infer.testing import kit
from infer.testing.allocator import check_allocator
from infer.testing.attention import BATCH_SPECS, make_case
from infer.testing.attention_kit import check_attention, kit_cases, specs_for
from infer.testing.decoder import check_lossless
from infer.testing.sampling import check_distribution, check_seeds, distribution_cases

BROKEN_PLUGIN = '''
import torch
import infer
from infer.api import SamplerOutput
from infer.api.kv_cache import write_kv
from infer.plugins.model.llama import Llama


class MisreadTable:
    """Reads every position through block_tables[seq, 0]: right only for one-block sequences."""

    capabilities = infer.Capabilities(devices=frozenset({"cpu"}), block_sizes=frozenset({16}))

    def __init__(self, spec):
        self.spec = spec

    def plan(self, batch):
        self.batch = batch

    def forward(self, q, k, v, kv_cache):
        batch, spec = self.batch, self.spec
        write_kv(kv_cache, k, v, batch.slot_mapping)
        group = spec.num_heads // spec.num_kv_heads
        outs, t = [], 0
        for i, (q_len, seq_len) in enumerate(zip(batch.query_lens, batch.seq_lens)):
            pos = torch.arange(seq_len)
            block = batch.block_tables_t[i, 0].long()
            keys = kv_cache[0][block, pos % batch.block_size].repeat_interleave(group, 1)
            values = kv_cache[1][block, pos % batch.block_size].repeat_interleave(group, 1)
            scores = torch.einsum("qhd,khd->hqk", q[t : t + q_len], keys) * spec.scale
            mask = pos[None, :] > (pos[seq_len - q_len :])[:, None]
            outs.append(torch.einsum("hqk,khd->qhd", scores.masked_fill(mask, float("-inf")).softmax(-1), values))
            t += q_len
        return torch.cat(outs)


class IgnoresTemperature:
    supported_params = frozenset({"temperature", "seed"})

    def __init__(self, vocab_size, device):
        pass

    def sample(self, logits, requests, positions=None):
        positions = positions or [len(r.output_token_ids) for r in requests]
        tokens = []
        for row, r, p in zip(logits, requests, positions):
            gen = torch.Generator().manual_seed(hash((r.seed, p)) & (2**63 - 1))
            greedy = r.params.temperature == 0
            tokens.append(int(row.argmax()) if greedy else int(torch.multinomial(row.softmax(-1), 1, generator=gen)))
        return SamplerOutput(tokens)


class SwappedNorms(Llama):
    """Layer 2's input and post-attention norms each load the other's weight."""

    def _target(self, hf_name):
        found = super()._target(hf_name)
        if found is None or not found[0].startswith("layers.2."):
            return found
        other = {"input_layernorm": "post_attention_layernorm", "post_attention_layernorm": "input_layernorm"}
        parts = found[0].split(".")
        parts[2] = other.get(parts[2], parts[2])
        return ".".join(parts), found[1]


@infer.hookimpl
def infer_register_attention_backends(register):
    register("misread-table", MisreadTable)


@infer.hookimpl
def infer_register_models(register):
    register("swapped-norms", SwappedNorms)


@infer.hookimpl
def infer_register_samplers(register):
    register("ignores-temperature", IgnoresTemperature)
'''


def run_kit(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "pytest", *args, "-q", "-p", "no:cacheprovider"]
    return subprocess.run(command, capture_output=True, text=True, cwd=cwd, env=env, timeout=300)


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
def test_example_plugin_passes_the_kit(example_plugin_env, tmp_path):
    ran = run_kit("--infer-kit", "sampler=temperature-only", cwd=tmp_path, env=example_plugin_env)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert "passed" in ran.stdout and "failed" not in ran.stdout


@pytest.mark.slow
def test_example_model_passes_the_model_kit(example_plugin_env, tmp_path):
    # ArceeForCausalLM beside transformers' own: tp 1, prefix caching, chunked prefill, preemption, tp 2, pp 2
    ran = run_kit("--infer-kit", "model=arcee", "-rs", cwd=tmp_path, env=example_plugin_env)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    # 6 settings, the embeddings, and --enable-lora refused at tp 1 and 2 (it serves no adapters)
    assert "9 passed" in ran.stdout and "skipped" not in ran.stdout, ran.stdout


def builtin_models() -> list[str]:
    """Every model plugin the `infer` distribution itself registers: a new built-in is kit-tested unasked."""
    return sorted(s.name for s in PluginRegistry.load().all("model") if s.distribution == "infer")


@pytest.mark.slow
def test_every_builtin_model_passes_the_model_kit(tmp_path):
    # each beside HF transformers' own: tp 1, prefix caching, chunked prefill, preemption, tp 2 and pp 2 (gloo)
    models = builtin_models()
    assert {"llama", "qwen2", "qwen3", "mistral", "phi3", "gemma2"} <= set(models)
    ran = run_kit("--infer-kit", "model=" + ",".join(models), "-rs", cwd=tmp_path)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    # 6 settings, the embeddings, the adapters at tp 1 and 2
    assert f"{9 * len(models)} passed" in ran.stdout and "skipped" not in ran.stdout, ran.stdout


@pytest.mark.slow
def test_builtin_strategies_pass_the_kit(tmp_path):
    ran = run_kit(
        "--infer-kit",
        "attention=torch",
        "--infer-kit",
        "kv_allocator=paged,contiguous",
        "--infer-kit",
        "decoding=speculative,early-exit",
        "--infer-kit",
        "sampler=vectorized,naive",
        "-rs",
        cwd=tmp_path,
    )
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert "failed" not in ran.stdout
    assert "decoder early-exit declares lossy=True" in ran.stdout  # exempt, and says why


@pytest.fixture
def broken_plugin_env(tmp_path) -> dict[str, str]:
    """A distribution with a broken attention backend and a broken sampler, found through PYTHONPATH."""
    (tmp_path / "broken_kit_plugin.py").write_text(BROKEN_PLUGIN)
    dist = tmp_path / "broken_kit_plugin-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-kit-plugin\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[infer]\nbroken-kit = broken_kit_plugin\n")
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))}


@pytest.mark.slow
def test_broken_plugins_fail_the_kit_pointing_at_the_fault(broken_plugin_env, tmp_path):
    ran = run_kit(
        "--infer-kit",
        "attention=misread-table",
        "--infer-kit",
        "sampler=ignores-temperature",
        cwd=tmp_path,
        env=broken_plugin_env,
    )
    out = ran.stdout
    assert ran.returncode == 1, out + ran.stderr
    assert (
        "attention backend misread-table: batch spec 'decode-mixed' (block tables randomly permuted; mha: 4 query "
        "heads, 4 KV heads; block size 16; float32): output of sequence 2"
    ) in out
    assert "is the block table read through block_tables[seq, pos // block_size]" in out
    assert "test_matches_the_reference[misread-table-decode-1-mha-bs16] PASSED" not in out  # -q: failures only
    assert "sampler ignores-temperature: SamplingParams(temperature=0.7)" in out
    assert "are the logits divided by the temperature before the softmax?" in out
    assert "top_k" not in out.split("short test summary")[-1]  # undeclared parameters are not tested
    model = run_kit("--infer-kit", "model=swapped-norms", "-k", "tp1", cwd=tmp_path, env=broken_plugin_env)
    assert model.returncode == 1 and "1 failed, 8 deselected" in model.stdout, model.stdout + model.stderr
    assert "model swapped-norms (LlamaForCausalLM: 4 layers, hidden 64, 4 heads over 2 KV heads" in model.stdout
    assert "layer 2 (of 4) differs first: max abs diff" in model.stdout and "layers 0-1 agree" in model.stdout
    unknown = run_kit("--infer-kit", "sampler=no-such-sampler", cwd=tmp_path, env=broken_plugin_env)
    assert unknown.returncode == 4 and "unknown --sampler 'no-such-sampler': valid names are" in unknown.stderr


# --------------------------------------------------------------------------- the checks, in process


class MisreadTable(TorchAttention):
    def plan(self, batch):  # every position read through block_tables[seq, 0]
        first = batch.block_tables_t[:, :1].expand_as(batch.block_tables_t).contiguous()
        super().plan(dataclasses.replace(batch, block_tables_t=first))


def test_attention_message_names_the_sequence_and_the_block_table():
    spec = next(s for s in BATCH_SPECS if s.name == "decode-mixed")
    case = make_case(spec, num_heads=4, num_kv_heads=2, block_size=16, seed=7)
    with pytest.raises(AssertionError) as info:
        check_attention(
            "misread", MisreadTable, case, "batch spec 'decode-mixed' (block tables randomly permuted)", 2e-3
        )
    message = str(info.value)
    assert message.startswith(
        "attention backend misread: batch spec 'decode-mixed' (block tables randomly permuted): "
        "output of sequence 2 (query length 1, 17 tokens in context) differs from the reference"
    )
    assert "(sequences 2, 3 of 4 differ)" in message and "block_tables[seq, pos // block_size]" in message


def test_attention_cases_follow_declared_phases_and_block_sizes():
    prefill_only = Capabilities(phases=frozenset({"prefill"}), block_sizes=frozenset({8, 16, 32}))
    names = {c.batch_spec.name for c in kit_cases(prefill_only, torch.float32)}
    assert names == {"prefill-1", "prefill-varlen", "extend"}
    assert {c.block_size for c in kit_cases(prefill_only, torch.float32)} == {8, 16}
    assert {s.name for s in specs_for(frozenset({"decode"}))} == {"decode-1", "decode-mixed"}


class NoisyTemperature:
    """Honours only temperature and seed, but reads the seed from the first row for the whole batch."""

    supported_params = frozenset({"temperature", "seed"})

    def __init__(self, vocab_size, device):
        pass

    def sample(self, logits, requests, positions=None):
        gen = torch.Generator().manual_seed(requests[0].seed)
        probs = torch.softmax(logits / requests[0].params.temperature, dim=-1)
        return SamplerOutput(torch.multinomial(probs, 1, generator=gen).squeeze(-1).tolist())


def test_sampler_kit_tests_only_declared_params_and_catches_batch_dependent_seeds():
    assert distribution_cases(NoisyTemperature) == ["temperature"]
    check_distribution("noisy", NoisyTemperature, "temperature", "seed")  # the distribution itself is right
    with pytest.raises(
        AssertionError,
        match=r"sampler noisy: request r\d \(seed \d+, position \d+\) drew token \d+ in a "
        r"batch of 8 but token \d+ when sampled alone; seeded sampling must depend",
    ):
        check_seeds("noisy", NoisyTemperature)


def test_sampler_kit_catches_sample_tokens_that_differ_from_sample():
    from infer.plugins.sampler.vectorized import VectorizedSampler
    from infer.testing.sampling import check_sample_tokens

    class Drifting(VectorizedSampler):  # pipelined steps would take the argmax where sample() draws
        def sample_tokens(self, logits, requests, positions=None):
            return logits.argmax(dim=-1)

    check_sample_tokens("vectorized", VectorizedSampler)
    with pytest.raises(AssertionError, match="must be one computation"):
        check_sample_tokens("drifting", Drifting)


class LeakyAllocator(PagedAllocator):
    def free(self, request):  # forgets to return the last block
        self.pool.release(request.block_ids[:-1])
        request.block_ids = []
        self.owners.pop(request.request_id, None)


class GreedyRefusal(PagedAllocator):
    def allocate_slots(self, request, num_tokens):  # takes a block even when it then refuses
        got = super().allocate_slots(request, num_tokens)
        if got is None and self.pool.num_free():
            request.block_ids.append(self.pool.take(1)[0])
        return got


@pytest.mark.parametrize(
    "factory,fault",
    [(LeakyAllocator, "every freed block must be free again"), (GreedyRefusal, "a refusal must change nothing")],
)
@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
def test_allocator_kit_names_the_broken_invariant(factory, fault):
    with pytest.raises(AssertionError, match=fault):
        check_allocator("broken", factory)


class SilentEarlyExit:
    """Runs two of the three layers but does not declare itself lossy."""

    capabilities = Capabilities()
    num_lookahead_tokens = 0

    def __init__(self, ctx):
        self.runner = ctx.runner
        self.runner.num_layers = 2

    def execute(self, out):
        return self.runner.execute(out)


class SilentEarlyExitPlugin:
    @staticmethod
    @infer.hookimpl
    def infer_register_decoders(register):
        register("silent-early-exit", SilentEarlyExit)


def test_decoder_kit_catches_an_undeclared_lossy_decoder(tiny_llama_dir):
    with pytest.raises(
        AssertionError,
        match=r"decoder silent-early-exit: greedy decoding of a tiny random Llama \(3 layers; "
        r"roomy KV cache\): prompt \d \(of 6, \d+ tokens\) differs from autoregressive "
        r"at output token \d+",
    ):
        check_lossless(
            "silent-early-exit",
            False,
            tiny_llama_dir,
            tiny_llama_dir,
            torch.device("cpu"),
            "roomy KV cache",
            plugins=[SilentEarlyExitPlugin],
        )


def test_kit_option_parsing():
    assert kit.parse(["attention=a", "decoding=b,c", "kv-allocator=d"]) == {
        "attention": ["a"],
        "decoding": ["b", "c"],
        "kv_allocator": ["d"],
    }
    with pytest.raises(pytest.UsageError, match="SLOT one of attention, sampler, kv_allocator, decoding, model"):
        kit.parse(["scheduler=fcfs"])
