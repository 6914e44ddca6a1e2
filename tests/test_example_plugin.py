"""The example plugin package (examples/infer-example-plugin) as the proof that a third party can build a
strategy for every slot from the plugin API alone: its source imports nothing of infer but `infer`,
`infer.api` and `infer.kernels`; installed, its strategies pass their conformance kits; run inline,
each gives the default strategies' greedy tokens on a tiny Llama, alone and all together."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from infer import SamplingParams
from infer.api.kv_cache import FP8
from infer.api.slots import SLOTS
from infer.core.registry import PluginRegistry
from infer.llm import LLM
from infer.testing.attention import BATCH_SPECS, make_case
from infer.testing.attention_kit import check_attention
from infer.testing.constraints import kit_tokenizer
from infer.testing.decoder import prompts

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "infer-example-plugin"
PACKAGE = EXAMPLE / "infer_example_plugin"
API = ("infer.api", "infer.kernels")  # with their submodules, and the top-level `infer` itself
MODULES = (
    "attention", "kv_allocator", "scheduler", "decoder", "detokenizer", "layers", "logits_processor", "reasoning_parser",
    "pooler", "adapter",
)  # fmt: skip


# ---------------------------------------------------------------------------------------------- imports


def _is_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


def infer_imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) for every infer module the file imports: `import`, `from ... import` (the names
    of `from infer import x` that are modules too) and importlib.import_module / __import__ of a literal."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
            found += [
                (node.lineno, f"{node.module}.{a.name}") for a in node.names if _is_module(f"{node.module}.{a.name}")
            ]
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            called = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if called in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                found.append((node.lineno, node.args[0].value))
    return [(line, m) for line, m in found if m == "infer" or m.startswith("infer.")]


def test_example_imports_only_the_plugin_api():
    files = sorted(EXAMPLE.rglob("*.py"))
    assert len(files) >= len(MODULES) + 1, f"the example package's sources are not under {EXAMPLE}"
    bad = [
        f"{path.relative_to(EXAMPLE)}:{line} imports {module}"
        for path in files
        for line, module in infer_imports(path)
        if module != "infer" and not any(module == m or module.startswith(m + ".") for m in API)
    ]
    assert not bad, "the example plugin may import of infer only infer, infer.api and infer.kernels:\n" + "\n".join(bad)


def test_the_import_check_catches_internals(tmp_path):
    source = tmp_path / "bad.py"
    source.write_text("import infer.core.engine\nfrom infer.plugins.model import llama\nfrom infer import runtime\n")
    assert [m for _, m in infer_imports(source)] == [
        "infer.core.engine",
        "infer.plugins.model",
        "infer.plugins.model.llama",
        "infer",
        "infer.runtime",
    ]


# ---------------------------------------------------------------------------------------------- inline


@pytest.fixture(scope="module")
def example():
    """The example's modules, imported from its source folder (it is not installed into this venv)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(EXAMPLE))
        package = importlib.import_module("infer_example_plugin")  # the sampler and the CLI command
        modules = {name: importlib.import_module(f"infer_example_plugin.{name}") for name in (*MODULES, "arcee")}
        yield {"package": package, **modules}


def test_example_covers_every_slot(example):
    registry = PluginRegistry.load(list(example.values()), entry_points=False)  # the example's alone
    assert not registry.broken, registry.broken
    empty = [slot.name for slot in SLOTS if not registry.all(slot.name)]
    assert not empty, f"the example plugin registers nothing for {', '.join(empty)}"


@pytest.mark.parametrize("spec", [s for s in BATCH_SPECS if s.name in ("decode-mixed", "mixed")], ids=lambda s: s.name)
def test_attention_reads_and_writes_an_fp8_cache(example, spec):
    # it declares fp8_kv, which the kit does not try: its writes are quantize_fp8, its reads scaled back
    backend = example["attention"].SdpaAttention
    for heads in ((4, 4), (4, 1)):
        case = make_case(spec, *heads, block_size=4, seed=3, kv_cache_dtype=FP8, kv_scales=(0.5, 2.0))
        check_attention("example-sdpa", backend, case, f"{spec.name}, FP8 cache", 2e-3)


SMALL_CACHE = dict(num_kv_blocks=14, block_size=4, max_model_len=52, max_num_seqs=4)  # requests are preempted
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
LETTERS = [1 + ord(c) for c in "abcdefgh "]  # token ids of these bytes in the kit tokenizer (byte b is 1 + b)


@pytest.fixture(scope="module")
def model_dir(tiny_llama_dir, tmp_path_factory) -> Path:
    """The tests' tiny Llama with a tokenizer (the kit's byte-level BPE), so that requests get text."""
    folder = tmp_path_factory.mktemp("tiny-llama-with-tokenizer")
    shutil.copytree(tiny_llama_dir, folder, dirs_exist_ok=True)
    kit_tokenizer().save_pretrained(folder)
    return folder


def workload() -> tuple[list[list[int]], list[SamplingParams]]:
    """Six greedy prompts, two parallel samples (forked blocks), a beam search (blocks reassigned) and
    two greedy requests held to a few letters (text without partial characters)."""
    p = prompts()
    letters = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, allowed_token_ids=LETTERS)
    return [*p, p[5], p[2], p[3], p[4]], [
        *[GREEDY] * len(p),
        SamplingParams(n=2, max_tokens=8, temperature=0.0, ignore_eos=True),
        SamplingParams(use_beam_search=True, best_of=2, max_tokens=6, ignore_eos=True),
        letters,
        letters,
    ]


BEAM = 7  # the beam search's index in workload()


def generate(model: Path, prompt_ids, params, plugins=(), **options):
    """(outputs, engine stats, run description) of one engine on the CPU in float32."""
    llm = LLM(model=str(model), plugins=plugins, device="cpu", dtype="float32", **{**SMALL_CACHE, **options})
    try:
        return llm.generate(prompt_ids, params), llm.engine.stats(), llm.engine.parts.describe
    finally:
        llm.close()


def tokens(outputs) -> list:
    return [o.error or [c.token_ids for c in o.outputs] for o in outputs]


@pytest.fixture(scope="module")
def reference(model_dir):
    """The default strategies' outputs of the workload."""
    outputs, stats, _ = generate(model_dir, *workload())
    assert not any(o.error for o in outputs), [o.error for o in outputs]
    return outputs


SWAPPED = {  # strategy -> (its module, the option that picks it)
    "example-sdpa": ("attention", {"attention": "example-sdpa"}),
    "example-refcount": ("kv_allocator", {"kv_allocator": "example-refcount"}),
    "example-fifo": ("scheduler", {"scheduler": "example-fifo"}),
    "example-split": ("decoder", {"decoding": "example-split"}),
    "rms_norm": ("layers", {}),  # a layer kind: chosen by its priority, not by name
}


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
@pytest.mark.parametrize("name", list(SWAPPED))
def test_strategy_gives_the_default_greedy_tokens(example, model_dir, reference, name, monkeypatch):
    module, options = SWAPPED[name]
    calls = {"rms_norm": 0, "copies": 0}
    if name == "rms_norm":  # count the example's norm at work
        forward = example["layers"].RMSNorm.forward

        def counted(self, *args, **kwargs):
            calls["rms_norm"] += 1
            return forward(self, *args, **kwargs)

        monkeypatch.setattr(example["layers"].RMSNorm, "forward", counted)
    if name == "example-refcount":  # count its copy-on-write copies
        take = example["kv_allocator"].RefCountAllocator.take_block_ops

        def taken(self):
            ops = take(self)
            calls["copies"] += len(ops.copies)
            return ops

        monkeypatch.setattr(example["kv_allocator"].RefCountAllocator, "take_block_ops", taken)

    outputs, stats, describe = generate(model_dir, *workload(), plugins=[example[module]], **options)
    got, want = tokens(outputs), tokens(reference)
    if name == "example-fifo":  # it does no beam search, and says so
        assert "beam search" in got[BEAM], got[BEAM]
        got[BEAM] = want[BEAM]
        assert stats["preemptions"] > 0, "the small KV cache should have made it preempt"
    if name == "example-split":
        assert stats["split_steps"] > 0, "no step mixed decodes and prompts: nothing was split"
    assert got == want
    for field, value in options.items():
        assert describe[field] == value
    if name == "rms_norm":
        assert calls["rms_norm"] > 0, "the layers hook did not put the example's rms_norm into the model"
    if name == "example-refcount":
        assert calls["copies"] > 0, "the forked samples should have copied a shared block before writing it"


def test_detokenizer_cuts_at_stop_strings_as_the_default(example, model_dir, reference):
    texts = [reference[i].outputs[0].text for i in (8, 9)]  # letters only: every token one character
    assert all(len(t) == 12 for t in texts), texts
    stops = [[texts[0][5:7]], [texts[1][8:11], "zz"]]
    params = [
        SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, allowed_token_ids=LETTERS, stop=s)
        for s in stops
    ]
    ids = [prompts()[3], prompts()[4]]
    default, _, _ = generate(model_dir, ids, params)
    mine, _, describe = generate(
        model_dir, ids, params, plugins=[example["detokenizer"]], detokenizer="example-redecode"
    )
    assert describe["detokenizer"] == "example-redecode"
    for d, m, text, stop in zip(default, mine, texts, stops):
        cut = min(i for i in (text.find(s) for s in stop) if i >= 0)
        assert (m.outputs[0].text, m.outputs[0].finish_reason) == (text[:cut], "stop")
        assert (m.outputs[0].text, m.outputs[0].token_ids) == (d.outputs[0].text, d.outputs[0].token_ids)


def test_all_example_strategies_together(example, model_dir, reference):
    options = dict(
        attention="example-sdpa",
        kv_allocator="example-refcount",
        scheduler="example-fifo",
        decoding="example-split",
        detokenizer="example-redecode",
    )
    prompt_ids, params = workload()
    choice = SamplingParams(
        max_tokens=8, temperature=0.0, structured={"choice": ["yes", "no"], "backend": "example-choice"}
    )
    outputs, stats, describe = generate(
        model_dir, [*prompt_ids, prompt_ids[0]], [*params, choice], plugins=list(example.values()), **options
    )
    for field, name in options.items():
        assert describe[field] == name
    got, want = tokens(outputs[:-1]), tokens(reference)
    assert "beam search" in got[BEAM]
    got[BEAM] = want[BEAM]
    assert got == want
    assert [o.outputs[0].text for o in outputs[8:10]] == [o.outputs[0].text for o in reference[8:10]]
    answer = outputs[-1].outputs[0]  # the logits processor held it to a choice, then EOS
    assert answer.text in ("yes", "no") and answer.finish_reason == "stop", answer
    assert stats["split_steps"] > 0 and stats["forwards"] > stats["steps"], stats  # the decoder split mixed steps


# ---------------------------------------------------------------------------------------------- installed


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
def test_installed_example_passes_the_kits(example_plugin_env, tmp_path):
    kits = ["attention=example-sdpa", "kv_allocator=example-refcount", "decoding=example-split"]
    kits += ["logits_processor=example-choice", "reasoning_parser=example-labels"]
    command = [sys.executable, "-m", "pytest", *(f"--infer-kit={k}" for k in kits), "-q", "-p", "no:cacheprovider"]
    ran = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, env=example_plugin_env, timeout=300)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert "failed" not in ran.stdout and " passed" in ran.stdout, ran.stdout


def test_pooler_is_the_max_of_hf_hidden_states(example, tiny_llama_dir):
    """`example-max`, inline: each dimension's largest hidden value over the prompt, as HF computes the states."""
    import torch
    from transformers import LlamaModel

    from infer.api.pooling import PoolingParams

    ids = [5, 17, 99, 3, 42, 8, 61]
    with LLM(str(tiny_llama_dir), plugins=[example["pooler"]], device="cpu", dtype="float32") as llm:
        (out,) = llm.embed([ids], PoolingParams("example-max", normalize=False))
    with torch.no_grad():
        hf = LlamaModel.from_pretrained(tiny_llama_dir, dtype=torch.float32)
        hidden = hf(torch.tensor([ids])).last_hidden_state[0]
    torch.testing.assert_close(torch.tensor(out.outputs.embedding), hidden.max(0).values, rtol=1e-5, atol=1e-5)


def test_the_example_adapter_kind_gives_the_builtin_lora_tokens(example, tiny_llama_dir, tmp_path):
    """`example-lora` (plain torch, the plugin API alone) against the built-in `lora` on a PEFT adapter."""
    peft = pytest.importorskip("peft")
    import torch
    from transformers import AutoModelForCausalLM

    from infer import LoRARequest

    torch.manual_seed(5)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    config = peft.LoraConfig(
        r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False
    )
    peft.get_peft_model(model, config).save_pretrained(tmp_path / "adapter")
    lora = LoRARequest("a", 1, str(tmp_path / "adapter"))
    batch = prompts(seed=2)[:3]
    outs = {}
    for kind in ("lora", "example-lora"):
        options = dict(attention="torch", enable_lora=True, adapter=kind, num_kv_blocks=64, max_model_len=128)
        with LLM(model=str(tiny_llama_dir), plugins=[example["adapter"]], **options) as llm:
            got = llm.generate(batch, GREEDY, lora_request=[lora, None, lora])
            outs[kind] = [o.outputs[0].token_ids for o in got]
    assert outs["example-lora"] == outs["lora"]
    with LLM(model=str(tiny_llama_dir), attention="torch", num_kv_blocks=64, max_model_len=128) as llm:
        base = [o.outputs[0].token_ids for o in llm.generate(batch, GREEDY)]
    assert outs["lora"][0] != base[0] and outs["lora"][1] == base[1]  # the adapter ran, the base row kept
