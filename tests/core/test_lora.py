"""Adapters in the engine: more adapters than device slots (LRU eviction, host copies read again), the
prefix cache kept apart per adapter, speculative decoding and structured output with an adapter, and
every way an adapter or a request for one can be wrong, each a clear error that refuses that request
alone. Equality with HF transformers + PEFT, family by family: the model kit (test_model_kit.py)."""

from __future__ import annotations

import json

import pytest
import torch

from infer import LLM, LoRARequest, SamplingParams
from infer.api.adapters import AdapterBatch
from infer.api.errors import RequestError
from infer.core.adapters import Adapters

peft = pytest.importorskip("peft")

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
PROMPTS = [[5, 9, 33, 71, 8, 12, 40, 41, 3, 99, 17, 6], [7, 7, 120, 64, 5], [11, 200, 3, 45, 6, 77, 88, 12, 34]]


def write_adapter(base_dir, folder, seed: int, targets=("q_proj", "v_proj", "down_proj"), rank: int = 8) -> str:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(targets), init_lora_weights=False)
    peft.get_peft_model(model, config).save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def adapter_dirs(tiny_llama_dir, tmp_path_factory) -> list[str]:
    root = tmp_path_factory.mktemp("adapters")
    return [write_adapter(tiny_llama_dir, root / f"a{i}", seed=i) for i in range(5)]


def lora(i: int, dirs: list[str]) -> LoRARequest:
    return LoRARequest(f"a{i}", i + 1, dirs[i])


def engine(tiny_llama_dir, **options) -> LLM:
    defaults = dict(attention="torch", enable_lora=True, block_size=4, max_model_len=128, num_kv_blocks=256)
    return LLM(model=str(tiny_llama_dir), **{**defaults, **options})


def tokens(outputs) -> list[list[int]]:
    assert all(o.error is None for o in outputs), [o.error for o in outputs]
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def alone(tiny_llama_dir, adapter_dirs) -> dict[int | None, list[list[int]]]:
    """Each adapter's (and the base's) greedy tokens on PROMPTS, one adapter a call, slots to spare."""
    with engine(tiny_llama_dir, max_loras=1) as llm:
        found = {None: tokens(llm.generate(PROMPTS, GREEDY))}
        for i in range(5):
            found[i] = tokens(llm.generate(PROMPTS, GREEDY, lora_request=lora(i, adapter_dirs)))
    assert len({json.dumps(v) for v in found.values()}) == 6  # every adapter changes the tokens
    return found


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
def test_five_adapters_through_two_slots_each_get_their_tokens(tiny_llama_dir, adapter_dirs, alone):
    """Two slots for five adapters: requests wait for a slot, adapters are evicted and loaded again."""
    with engine(tiny_llama_dir, max_loras=2, max_cpu_loras=2, max_num_batched_tokens=16) as llm:
        batch = [(p, i) for p in range(len(PROMPTS)) for i in [None, *range(5)]]  # adapters interleaved
        loras = [None if i is None else lora(i, adapter_dirs) for _, i in batch]
        outputs = llm.generate([PROMPTS[p] for p, _ in batch], GREEDY, lora_request=loras)
        for (p, i), got in zip(batch, tokens(outputs)):
            assert got == alone[i][p], (p, i)
        adapters = llm.engine.parts.adapters
        assert adapters.num_loads >= 5 and len(adapters.slots) == 2  # five adapters through two slots


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
def test_the_prefix_cache_never_shares_blocks_across_adapters(tiny_llama_dir, adapter_dirs, alone):
    with engine(tiny_llama_dir, max_loras=2) as llm:
        first = tokens(llm.generate(PROMPTS[:1], GREEDY, lora_request=lora(0, adapter_dirs)))
        hits = llm.engine.kv_usage().prefix_hit_tokens
        other = tokens(llm.generate(PROMPTS[:1], GREEDY, lora_request=lora(1, adapter_dirs)))
        assert llm.engine.kv_usage().prefix_hit_tokens == hits  # adapter 1 found none of adapter 0's blocks
        base = tokens(llm.generate(PROMPTS[:1], GREEDY))
        assert llm.engine.kv_usage().prefix_hit_tokens == hits
        again = tokens(llm.generate(PROMPTS[:1], GREEDY, lora_request=lora(0, adapter_dirs)))
        assert llm.engine.kv_usage().prefix_hit_tokens > hits  # its own blocks, found again
    assert (first, other, base, again) == (alone[0][:1], alone[1][:1], alone[None][:1], alone[0][:1])


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
@pytest.mark.parametrize("draft", ["ngram", "self"])
def test_speculative_decoding_with_an_adapter_is_lossless(tiny_llama_dir, adapter_dirs, alone, draft):
    options = dict(decoding="speculative", draft=draft, num_speculative_tokens=3)
    if draft == "self":
        options["exit_layer"] = 1
    with engine(tiny_llama_dir, max_loras=2, **options) as llm:
        loras = [lora(2, adapter_dirs), None, lora(3, adapter_dirs)]
        got = tokens(llm.generate(PROMPTS, GREEDY, lora_request=loras))
    assert got == [alone[2][0], alone[None][1], alone[3][2]]


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
def test_structured_output_with_an_adapter(tiny_chat_dir, tmp_path):
    pytest.importorskip("xgrammar")
    from infer.api.structured import StructuredOutputs

    adapter = LoRARequest("json", 1, write_adapter(tiny_chat_dir, tmp_path / "json", seed=3))
    schema = {"type": "object", "properties": {"n": {"enum": [1, 22, 333]}}, "required": ["n"]}
    params = SamplingParams(max_tokens=60, temperature=0, structured=StructuredOutputs(json=schema))
    free = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    with engine(tiny_chat_dir, max_loras=1) as llm:
        out, base = llm.generate(["Answer:"] * 2, [params, free], lora_request=[adapter, None])
        changed = llm.generate(["Answer:"], free, lora_request=adapter)[0]
    assert out.error is None and json.loads(out.outputs[0].text)["n"] in (1, 22, 333), out.outputs[0].text
    assert changed.outputs[0].token_ids != base.outputs[0].token_ids  # the adapter did run


def test_requests_for_adapters_fail_alone_with_clear_errors(tiny_llama_dir, adapter_dirs, tmp_path):
    other = tmp_path / "other"  # an adapter of a wider model: its shapes name the mismatch
    from transformers import LlamaConfig, LlamaForCausalLM

    from infer.testing.decoder import TINY_LLAMA

    LlamaForCausalLM(LlamaConfig(**{**TINY_LLAMA, "hidden_size": 96})).save_pretrained(tmp_path / "wide")
    write_adapter(tmp_path / "wide", other, seed=1)
    wide = tmp_path / "r32"
    write_adapter(tiny_llama_dir, wide, seed=2, rank=32)
    (tmp_path / "dora").mkdir()
    (tmp_path / "dora" / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 8, "use_dora": true}')
    (tmp_path / "ia3").mkdir()
    (tmp_path / "ia3" / "adapter_config.json").write_text('{"peft_type": "IA3"}')
    bad = {
        "no adapter_config.json": LoRARequest("empty", 10, str(tmp_path)),
        "another base model": LoRARequest("other", 11, str(other)),
        "--max-lora-rank 32": LoRARequest("r32", 12, str(wide)),
        "use_dora": LoRARequest("dora", 13, str(tmp_path / "dora")),
        "IA3 adapter, not LORA": LoRARequest("ia3", 14, str(tmp_path / "ia3")),
        "id 0 must be an integer >= 1": LoRARequest("zero", 0, adapter_dirs[0]),
        "served already as id 1": LoRARequest("a0", 7, adapter_dirs[1]),
    }
    with engine(tiny_llama_dir, max_loras=2) as llm:
        llm.add_lora(lora(0, adapter_dirs))
        loras = [*bad.values(), lora(0, adapter_dirs)]
        outputs = llm.generate([PROMPTS[0]] * len(loras), GREEDY, lora_request=loras)
        for (what, _), out in zip(bad.items(), outputs):
            assert out.error is not None and what in out.error, (what, out.error)
        assert outputs[-1].error is None and len(outputs[-1].outputs[0].token_ids) == 12
        assert [x.lora_name for x in llm.list_loras()] == ["a0"]
        with pytest.raises(RequestError, match="one per prompt"):
            llm.generate(PROMPTS, GREEDY, lora_request=[None])
    with engine(tiny_llama_dir, enable_lora=False) as plain:
        out = plain.generate(PROMPTS[:1], GREEDY, lora_request=lora(0, adapter_dirs))[0]
        assert out.error is not None and "enable_lora=True (--enable-lora)" in out.error


class Kind:  # a recording stand-in for an adapter kind
    def __init__(self) -> None:
        self.loaded: list[tuple[int, str]] = []
        self.planned: list[AdapterBatch] = []
        self.reads: list[str] = []

    def read(self, path: str, name: str) -> str:
        self.reads.append(name)
        return name

    def load(self, slot: int, adapter: str) -> None:
        self.loaded.append((slot, adapter))

    def plan(self, batch: AdapterBatch) -> None:
        self.planned.append(batch)


def test_slots_go_to_the_least_recently_used_adapter_a_forward_does_not_run():
    kind = Kind()
    adapters = Adapters(kind, max_adapters=2)
    keys = [adapters.add(LoRARequest(f"x{i}", i + 1, f"/x{i}")) for i in range(3)]
    assert adapters.assign([keys[0], None, keys[1]]) == ([0, -1, 1], [(0, 0, "x0", "/x0"), (1, 1, "x1", "/x1")])
    assert adapters.assign([keys[1]]) == ([1], [])  # x1 used last: x0 is the least recently used
    assert adapters.assign([keys[2], keys[1]]) == ([0, 1], [(0, 2, "x2", "/x2")])
    with pytest.raises(RuntimeError, match="--max-loras is 2"):
        adapters.assign(keys)
    adapters.prepare([(0, 2, "x2", "/x2")], [0, 1], [3, 1], num_rows=8)  # a graph's bucket of 8 rows
    assert kind.loaded == [(0, "x2")]
    assert kind.planned[-1].token_slots() == [0, 0, 0, 1] + [-1] * 4 and kind.planned[-1].query_lens == [1] * 4


def test_a_random_adapter_at_a_models_shapes_loads_and_runs(tiny_llama_dir, tmp_path, alone):
    """`write_random_adapter`, what the GPU benchmark serves at Llama-3-8B's shapes (benchmarks/lab/lora.py)."""
    from infer.testing.lora import write_random_adapter

    with engine(tiny_llama_dir, max_loras=1) as llm:
        folder = write_random_adapter(llm.engine.parts.model_config, tmp_path / "random", rank=16, scale=0.2)
        got = tokens(llm.generate(PROMPTS, GREEDY, lora_request=LoRARequest("random", 1, str(folder))))
    assert got != alone[None]


def test_fp8_base_weights_with_adapters(tiny_llama_dir, tmp_path, adapter_dirs):
    """--quantization fp8 (its torch reference on the CPU) with bf16 adapters: a zero adapter (PEFT's own
    init, B = 0) leaves the FP8 model's tokens exactly; each target projection's output is the FP8
    product plus the adapter's delta of the unquantized input."""
    from transformers import AutoModelForCausalLM

    zero = tmp_path / "zero"
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    peft.get_peft_model(model, peft.LoraConfig(r=8, target_modules=["q_proj", "o_proj", "down_proj"])).save_pretrained(
        zero
    )
    with engine(tiny_llama_dir, max_loras=2, quantization="fp8", dtype="bfloat16") as llm:
        base = tokens(llm.generate(PROMPTS, GREEDY))
        assert tokens(llm.generate(PROMPTS, GREEDY, lora_request=LoRARequest("zero", 9, str(zero)))) == base
        adapted = tokens(llm.generate(PROMPTS, GREEDY, lora_request=lora(0, adapter_dirs)))
        assert adapted != base
        attn = llm.engine.model.layers[0].self_attn
        x = torch.randn(3, llm.engine.parts.model_config.hidden_size).bfloat16()
        kind = llm.engine.parts.adapters.kind
        slot = llm.engine.parts.adapters.slots[llm.engine.parts.adapters.key_of("a0")]
        kind.plan(AdapterBatch([slot], [3], 3))
        with torch.no_grad():
            y = attn.qkv_adapter(x, attn.qkv_proj(x))
            a, b = kind.a["layers.0.self_attn.qkv_proj"][slot], kind.b["layers.0.self_attn.qkv_proj"][slot]
            want = attn.qkv_proj(x) + (x @ a.t()) @ b.t()
    torch.testing.assert_close(y, want)


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
def test_the_kernels_path_gives_the_references_tokens(tiny_llama_dir, adapter_dirs, alone):
    """The plugin's CUDA path (BGMV for a few rows, SGMV grouped by slot, through its static buffers) run on
    the CPU under Triton's interpreter, in a batch mixing adapters: the torch reference's tokens."""
    pytest.importorskip("triton")
    with engine(tiny_llama_dir, max_loras=3, max_num_batched_tokens=8) as llm:
        llm.engine.parts.adapters.kind.kernels = True  # what a CUDA device chooses
        batch = [(0, 0), (1, None), (2, 1), (1, 2)]
        loras = [None if i is None else lora(i, adapter_dirs) for _, i in batch]
        got = tokens(llm.generate([PROMPTS[p] for p, _ in batch], GREEDY, lora_request=loras))
        single = tokens(llm.generate(PROMPTS[:1], GREEDY, lora_request=lora(0, adapter_dirs)))  # batch 1: BGMV
    assert got == [alone[i][p] for p, i in batch]
    assert single == alone[0][:1]


def test_host_copies_of_adapters_requests_run_with_stay():
    kind = Kind()
    adapters = Adapters(kind, max_adapters=1, max_cpu=2)
    live: set[int] = set()
    adapters.live = lambda: live
    x0 = adapters.add(LoRARequest("x0", 1, "/x0"))
    live.add(x0)  # a request runs with x0
    adapters.add(LoRARequest("x1", 2, "/x1"))
    adapters.add(LoRARequest("x2", 3, "/x2"))  # x1, the least recently used not running, leaves host memory
    assert list(adapters.host) == [x0, 2] and kind.reads == ["x0", "x1", "x2"]
    adapters.remove("x0")  # unloaded while its request runs: still loads without a read
    _, loads = adapters.assign([x0])
    adapters.prepare(loads, [0], [1])
    assert kind.reads == ["x0", "x1", "x2"] and kind.loaded == [(0, "x0")]
    live.clear()  # its request ended: the next copy kept pushes it out for good
    adapters.load(0, 1, "x1", "/x1")
    assert x0 not in adapters.host and x0 not in adapters.known and kind.reads[-1] == "x1"
