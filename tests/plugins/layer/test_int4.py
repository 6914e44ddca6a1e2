"""4-bit weights (`infer.plugins.layer.int4`): the packings against their writers, the layer against its
dequantized values, and whole models in GPTQ's, AWQ's and compressed-tensors' layouts against HF
transformers on the same values: the dequantized checkpoint for every layout, and for compressed-tensors
also transformers loading the 4-bit folder itself through the compressed-tensors package."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from infer import LLM, SamplingParams
from infer.api.errors import ConfigError, ModelLoadError
from infer.kernels.int4_reference import AWQ_ORDER, pack_int32, pack_nibbles, quantize_rtn, unpack_int32, unpack_nibbles
from infer.plugins.layer.int4 import GPTQLinear, Int4Scheme
from infer.testing.int4 import quantize_checkpoint
from infer.testing.model import Checkpoint, Setting, first_mismatch, generate, hf_class, write_checkpoint

TP1 = Setting("tp1", "tp 1")
# 8 heads of 16 and intermediate 256: every projection's input divides into groups of 32, 64 and 128
WIDE = dict(hidden_size=128, intermediate_size=256, num_attention_heads=8, num_key_value_heads=2, head_dim=16)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Checkpoint:
    return write_checkpoint("LlamaForCausalLM", tmp_path_factory.mktemp("int4") / "model", WIDE)


def test_int32_packing_round_trips_in_each_order():
    values = torch.randint(0, 16, (16, 24))
    for dim in (0, 1):
        for order in (None, AWQ_ORDER):
            packed = pack_int32(values, dim, order)
            assert packed.dtype == torch.int32 and packed.shape[dim] == values.shape[dim] // 8
            assert torch.equal(unpack_int32(packed, dim, order), values.to(torch.int16))
    assert torch.equal(unpack_nibbles(pack_nibbles(values)), values.to(torch.uint8))
    # AWQ's interleave: nibble i of a word holds column AWQ_ORDER[i]
    row = torch.arange(8)[None, :]
    word = int(pack_int32(row, 1, AWQ_ORDER)[0, 0])
    assert [(word >> (4 * i)) & 0xF for i in range(8)] == list(AWQ_ORDER)


def test_the_packing_is_compressed_tensors_own():
    helpers = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
    values = torch.randint(0, 16, (16, 32))
    for dim in (0, 1):
        theirs = helpers.pack_to_int32((values - 8).to(torch.int8), 4, packed_dim=dim)
        assert torch.equal(theirs, pack_int32(values, dim))


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("group", [32, -1])
def test_round_to_nearest_is_within_half_a_step(group, symmetric):
    torch.manual_seed(0)
    w = torch.randn(8, 64) * torch.logspace(-2, 1, 8)[:, None]
    q, s, z = quantize_rtn(w, group, symmetric)
    g = 64 if group == -1 else group
    assert q.dtype == torch.uint8 and int(q.max()) <= 15 and s.shape == (8, 64 // g)
    if symmetric:
        assert torch.equal(z, torch.full_like(z, 8))
    deq = (q.float() - z.float().repeat_interleave(g, 1)) * s.repeat_interleave(g, 1)
    step = s.repeat_interleave(g, 1)  # half a step; asymmetric: the zero point's rounding may clamp one step
    assert ((deq - w).abs() <= (step / 2 if symmetric else step) + 1e-6).all()


def test_the_layer_multiplies_by_its_dequantized_values():
    torch.manual_seed(0)
    layer = GPTQLinear(64, 24, bias=True, scheme=Int4Scheme(32, symmetric=False))
    w = torch.randn(24, 64)
    assert set(layer.load_rows("weight", 0, 24, w)) == {"qweight", "scales", "zeros", "g_idx"}
    layer.load_rows("bias", 0, 24, torch.randn(24))
    x = torch.randn(5, 64)
    deq = layer.dequantized()
    # asymmetric: the rounded zero point may clamp an extreme value by up to one step
    assert ((deq - w).abs() <= layer.scales.repeat_interleave(32, 1)).all() and not torch.equal(deq, w)
    torch.testing.assert_close(layer(x), x @ deq.T + layer.bias, rtol=1e-5, atol=1e-5)


CASES = [  # layout, group, symmetric, act-order
    ("gptq", 32, True, False),
    ("gptq", 128, False, False),
    ("gptq", 64, True, True),
    ("gptq", -1, False, True),
    ("awq", 32, False, False),
    ("awq", 64, False, False),
    ("awq", 128, False, False),
    ("w4a16", 32, True, False),
    ("w4a16", 64, False, False),
    ("w4a16", 128, True, True),
    ("w4a16", -1, False, False),
]


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
@pytest.mark.parametrize("layout,group,symmetric,act_order", CASES, ids=["-".join(map(str, c)) for c in CASES])
def test_a_4bit_checkpoint_generates_as_hf_on_its_values(tiny, tmp_path, layout, group, symmetric, act_order):
    folder = tmp_path / layout
    reference = quantize_checkpoint(tiny.folder, folder, layout, group, symmetric, act_order)
    hf = hf_class("LlamaForCausalLM").from_pretrained(reference, dtype=torch.float32).eval()
    results, _ = generate(folder, "llama", TP1)
    mismatch = first_mismatch(Checkpoint("LlamaForCausalLM", reference, hf), results)
    assert mismatch is None, mismatch.message
    assert first_mismatch(tiny, results) is not None  # 4 bits are not the float weights: the check can fail


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
@pytest.mark.parametrize("group", [32, 128, -1])
def test_compressed_tensors_checkpoints_generate_as_transformers_loads_them(tiny, tmp_path, group):
    """transformers reads the 4-bit folder itself through the compressed-tensors package (symmetric:
    this transformers and compressed-tensors pair refuses its own packed zero points for asymmetric ones)."""
    pytest.importorskip("compressed_tensors")
    folder = tmp_path / "w4a16"
    quantize_checkpoint(tiny.folder, folder, "w4a16", group, symmetric=True)
    hf = hf_class("LlamaForCausalLM").from_pretrained(folder, dtype=torch.float32).eval()
    results, _ = generate(folder, "llama", TP1)
    mismatch = first_mismatch(Checkpoint("LlamaForCausalLM", folder, hf), results)
    assert mismatch is None, mismatch.message


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
@pytest.mark.parametrize("architecture", ["Qwen2ForCausalLM", "MistralForCausalLM", "Phi3ForCausalLM"])
def test_other_families_load_4bit_projections(tmp_path, architecture):
    """Biased q, k, v (Qwen2), and Phi-3's checkpoint-fused qkv_proj and gate_up_proj (quantized as one)."""
    wide = {k: v for k, v in WIDE.items() if k != "head_dim"}  # 128 / 8 heads: 16 all the same
    checkpoint = write_checkpoint(architecture, tmp_path / "model", wide)
    folder = tmp_path / "gptq"
    reference = quantize_checkpoint(checkpoint.folder, folder, "gptq", 32, symmetric=False, act_order=True)
    hf = hf_class(architecture).from_pretrained(reference, dtype=torch.float32).eval()
    name = {"Qwen2ForCausalLM": "qwen2", "MistralForCausalLM": "mistral", "Phi3ForCausalLM": "phi3"}[architecture]
    results, _ = generate(folder, name, TP1)
    mismatch = first_mismatch(Checkpoint(architecture, reference, hf), results)
    assert mismatch is None, mismatch.message


def test_a_float_checkpoint_quantizes_as_it_loads(tiny):
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    with LLM(model=str(tiny.folder), device="cpu", dtype="float32", quantization="gptq") as llm:
        layer = llm.engine.model.layers[0].self_attn.qkv_proj
        assert isinstance(layer, GPTQLinear) and layer.group == 128
        out = llm.generate([[1, 17, 93, 5]], params)[0].outputs[0].token_ids
    assert len(out) == 8


def test_dummy_weights_quantize_as_they_load(tiny):
    with LLM(model=str(tiny.folder), load_format="dummy", device="cpu", dtype="float32", quantization="awq") as llm:
        out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4


def _rewrite_config(folder: Path, **changes) -> None:
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"].update(changes)
    (folder / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(
    "layout,changes,words",
    [
        ("gptq", {"bits": 8}, ["8-bit GPTQ", "4-bit"]),
        ("awq", {"version": "gemv"}, ["'gemv' layout", "GEMM"]),
        ("gptq", {"checkpoint_format": "marlin"}, ["'marlin' format", "gptq_v2"]),
        ("gptq", {"group_size": 48}, ["group size", "48"]),
    ],
)
def test_checkpoints_no_layer_reads_are_refused_by_name(tiny, tmp_path, layout, changes, words):
    folder = tmp_path / layout
    quantize_checkpoint(tiny.folder, folder, layout, 32)
    _rewrite_config(folder, **changes)
    with pytest.raises(ModelLoadError) as err:
        LLM(model=str(folder), device="cpu", dtype="float32")
    for word in words:
        assert word in str(err.value)


def test_a_fused_projection_whose_pieces_order_columns_differently_is_refused(tiny, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "gptq"
    quantize_checkpoint(tiny.folder, folder, "gptq", 32, act_order=True)
    tensors = load_file(folder / "model.safetensors")
    name = "model.layers.0.self_attn.k_proj.g_idx"
    tensors[name] = tensors[name].flip(0).contiguous()
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="order their input columns differently"):
        LLM(model=str(folder), device="cpu", dtype="float32")


def test_a_quantization_other_than_the_checkpoints_is_refused(tiny, tmp_path):
    folder = tmp_path / "awq"
    quantize_checkpoint(tiny.folder, folder, "awq", 32)
    with pytest.raises(ConfigError, match="stores as awq"):
        LLM(model=str(folder), device="cpu", dtype="float32", quantization="gptq")


def test_the_packings_are_the_tools_own_words():
    """Words written by hand from the tools' conventions: GPTQ packs 8 input rows of a column into one int32,
    value i in bits 4i (qweight [K/8, N]); AutoAWQ packs 8 output columns of a row, column AWQ_ORDER[i] =
    (0, 2, 4, 6, 1, 3, 5, 7)[i] in bits 4i, so values 0..7 of columns 0..7 read 0x75316420."""
    column = unpack_int32(torch.tensor([[0x76543210]], dtype=torch.int32), 0)  # [8, 1]
    assert column[:, 0].tolist() == list(range(8))
    row = unpack_int32(torch.tensor([[0x75316420]], dtype=torch.int32), 1, AWQ_ORDER)
    assert row[0].tolist() == list(range(8))


def test_a_tensor_parallel_4bit_run_is_refused_by_name():
    from infer.api.errors import ConfigError as Refused
    from infer.distributed.layers import quantized_shard
    from infer.loading.shards import Shard

    factory = GPTQLinear.for_checkpoint({"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": True})
    assert issubclass(factory, GPTQLinear) and factory.default_scheme.group_size == 32
    with pytest.raises(Refused, match=r"int4.GPTQLinear cannot hold a row-parallel shard.*use --tp 1"):
        quantized_shard(factory, 64, Shard(dim=1, full_sizes=(64,), ranges=((0, 32),)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rows_the_cpu_int4_matmul_cannot_take_are_dequantized(dtype):
    layer = GPTQLinear(64, 24, scheme=Int4Scheme(32, symmetric=True))  # 24 rows: not a multiple of 16
    layer.load_rows("weight", 0, 24, torch.randn(24, 64))
    x = torch.randn(1, 64, dtype=dtype)
    torch.testing.assert_close(layer(x).float(), (x.float() @ layer.dequantized().T), rtol=0.02, atol=0.05)
