"""GGUF weights kept in their block formats (`--model FILE.gguf`, `infer.plugins.layer.gguf`): each format
taken apart against the gguf package's own dequantization, bit for bit; a tiny Llama GGUF mixing all six
formats, and the real SmolLM2-135M GGUF (Q4_1 projections, a Q8_0 embedding), generating as HF
transformers generates from the same file (it dequantizes it as it loads)."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from infer import LLM
from infer.api.errors import ConfigError, ModelLoadError
from infer.kernels.gguf_reference import BLOCKS, take_apart
from infer.loading.gguf import permute_qk
from infer.plugins.layer.gguf import GGUFLinear
from infer.testing.model import MAX_TOKENS, PARAMS, Checkpoint, first_mismatch

# where each format keeps its float16 scales (d, and dmin or m), set to small values in random blocks
SCALE_BYTES = {"Q4_0": (0,), "Q4_1": (0, 2), "Q8_0": (0,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}
SCALE_SIZE = {"Q4_0": 0.01, "Q4_1": 0.01, "Q8_0": 0.001, "Q4_K": 2e-4, "Q5_K": 1e-4, "Q6_K": 3e-5}


def random_blocks(kind: str, rows: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """uint8 [rows, row bytes]: valid `kind` blocks, random values, scales small enough for sane weights."""
    size, values = BLOCKS[kind]
    raw = rng.integers(0, 256, (rows, k // values, size), dtype=np.uint8)
    for at in SCALE_BYTES[kind]:
        d = np.abs(rng.normal(SCALE_SIZE[kind], SCALE_SIZE[kind] / 3, (rows, k // values))).astype(np.float16)
        raw[..., at : at + 2] = d.view(np.uint8).reshape(rows, k // values, 2)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("kind", list(BLOCKS))
def test_each_format_is_taken_apart_into_the_gguf_packages_values(kind):
    raw = random_blocks(kind, 6, 512, np.random.default_rng(0))
    expected = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind]).reshape(6, 512)
    parts = take_apart(kind, torch.from_numpy(raw), 512)
    assert np.array_equal(parts.dequantize().numpy(), expected)
    assert parts.q.dtype == torch.int8 and parts.scale.shape == (6, 512 // parts.group)


def test_the_cpu_int4_product_is_the_dequantized_one_in_bf16():
    rng = np.random.default_rng(1)
    layer = GGUFLinear(256, 96)
    for offset, kind in ((0, "Q4_0"), (32, "Q4_1"), (64, "Q4_K")):  # three pieces, one per 4-bit format
        layer.load_rows("weight_blocks", offset, 32, torch.from_numpy(random_blocks(kind, 32, 256, rng)))
        type_id = int(gguf.GGMLQuantizationType[kind])
        layer.load_rows("weight_type", offset, 32, torch.tensor(type_id, dtype=torch.int32))
    x = torch.randn(3, 256, dtype=torch.bfloat16)
    exact = x.float() @ layer.dequantized().T
    fast = layer(x).float()  # torch's int4 matmul, the scales in bf16
    assert torch.allclose(fast, exact, rtol=0.02, atol=0.02 * exact.abs().max().item())


# ---------------------------------------------------------------------------------------------- a tiny GGUF

HIDDEN, FFN, LAYERS, HEADS, KV_HEADS = 256, 512, 2, 4, 2
HEAD_DIM = HIDDEN // HEADS
FORMATS = {  # a file mixing every kept format, as Q4_K_M files mix Q4_K and Q6_K
    "attn_q": "Q4_K", "attn_k": "Q6_K", "attn_v": "Q8_0", "attn_output": "Q4_0",
    "ffn_gate": "Q5_K", "ffn_up": "Q4_1", "ffn_down": "Q6_K",
}  # fmt: skip
SHAPES = {
    "attn_q": (HEADS * HEAD_DIM, HIDDEN), "attn_k": (KV_HEADS * HEAD_DIM, HIDDEN),
    "attn_v": (KV_HEADS * HEAD_DIM, HIDDEN), "attn_output": (HIDDEN, HEADS * HEAD_DIM),
    "ffn_gate": (FFN, HIDDEN), "ffn_up": (FFN, HIDDEN), "ffn_down": (HIDDEN, FFN),
}  # fmt: skip


def _tokens() -> list[str]:
    from tokenizers import pre_tokenizers

    return ["<unk>", "<s>", "</s>"] + sorted(pre_tokenizers.ByteLevel.alphabet()) + ["Ġt"]


def write_mixed_gguf(path: Path, seed: int = 0, arch: str = "llama") -> Path:
    rng = np.random.default_rng(seed)
    tokens = _tokens()
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL] * 3 + [gguf.TokenType.NORMAL] * (len(tokens) - 3))
    w.add_token_merges(["Ġ t"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    embedding = rng.normal(0, 0.5, (len(tokens), HIDDEN)).astype(np.float32)
    w.add_tensor("token_embd.weight", embedding)
    w.add_tensor("output_norm.weight", (1 + rng.normal(0, 0.1, HIDDEN)).astype(np.float32))
    w.add_tensor("output.weight", rng.normal(0, 0.1, (len(tokens), HIDDEN)).astype(np.float32))
    for i in range(LAYERS):
        for norm in ("attn_norm", "ffn_norm"):
            w.add_tensor(f"blk.{i}.{norm}.weight", (1 + rng.normal(0, 0.1, HIDDEN)).astype(np.float32))
        for name, kind in FORMATS.items():
            rows, k = SHAPES[name]
            raw = random_blocks(kind, rows, k, rng)
            if arch == "qwen2" and name in ("attn_q", "attn_k", "attn_v"):  # Qwen2's biases
                w.add_tensor(f"blk.{i}.{name}.bias", rng.normal(0, 0.1, rows).astype(np.float32))
            if arch == "llama" and name in ("attn_q", "attn_k"):  # llama.cpp's row order in Llama GGUFs
                raw = permute_qk(raw, HEADS if name == "attn_q" else KV_HEADS)
            w.add_tensor(f"blk.{i}.{name}.weight", raw, raw_dtype=gguf.GGMLQuantizationType[kind])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _check_against_transformers(file: Path, prompts: list[list[int]], architecture: str = "LlamaForCausalLM"):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(file.parent, gguf_file=file.name, dtype=torch.float32).eval()
    with LLM(model=str(file), device="cpu", dtype="float32") as llm:
        layer = llm.engine.model.layers[0].self_attn.qkv_proj
        outputs = llm.generate(prompts, PARAMS)
    assert isinstance(layer, GGUFLinear)
    results = list(zip(prompts, outputs))
    mismatch = first_mismatch(Checkpoint(architecture, file.parent, hf), results)
    assert mismatch is None, mismatch.message
    return layer


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
@pytest.mark.parametrize("arch,architecture", [("llama", "LlamaForCausalLM"), ("qwen2", "Qwen2ForCausalLM")])
def test_a_gguf_mixing_every_kept_format_generates_as_transformers_reads_it(tmp_path, arch, architecture):
    file = write_mixed_gguf(tmp_path / "tiny.gguf", arch=arch)
    rng = np.random.default_rng(3)
    prompts = [[1, *rng.integers(3, 259, n).tolist()] for n in (4, 9, 17)]
    layer = _check_against_transformers(file, prompts, architecture)
    assert [p.kind for p in layer.pieces] == ["Q4_K", "Q6_K", "Q8_0"]  # q, k, v each in its own format
    assert (layer.bias is not None) == (arch == "qwen2")


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
def test_the_real_smollm2_gguf_generates_as_transformers_reads_it():
    from infer.loading.hub import find_cached

    folder = find_cached("smollm2-135m")
    file = next(iter(sorted(folder.glob("*.gguf"))), None) if folder is not None else None
    if file is None:
        pytest.skip("the cached smollm2-135m holds no GGUF: `infer models pull smollm2-135m --force`")
    prompts = [[1, 504, 3101, 314, 253, 1345, 30], [1, 9690, 198, 2683, 359, 253, 5356, 1789]]
    layer = _check_against_transformers(file, prompts)
    assert {p.kind for p in layer.pieces} == {"Q4_1"} and MAX_TOKENS == 24


def test_gguf_files_and_layers_that_cannot_run_are_refused(tmp_path, tiny_llama_dir):
    file = write_mixed_gguf(tmp_path / "a.gguf")
    (tmp_path / "b.gguf").write_bytes(file.read_bytes())
    with pytest.raises(ModelLoadError, match="holds 2 .gguf files"):
        LLM(model=str(tmp_path), device="cpu", dtype="float32")
    with pytest.raises(ConfigError, match="GGUF weights come from a .gguf file only"):
        LLM(model=str(tiny_llama_dir), device="cpu", dtype="float32", quantization="gguf")
    layer = GGUFLinear(256, 32)
    layer.load_rows("weight_blocks", 0, 32, torch.zeros(32, 84, dtype=torch.uint8))
    with pytest.raises(ModelLoadError, match="Q2_K, which this layer does not keep"):
        layer.load_rows("weight_type", 0, 32, torch.tensor(int(gguf.GGMLQuantizationType.Q2_K)))
    partial = GGUFLinear(256, 64)
    partial.load_rows("weight", 0, 32, torch.randn(32, 256))
    with pytest.raises(ModelLoadError, match=r"has only rows \[0, 32\) loaded"):
        partial(torch.randn(1, 256))


def test_on_the_cpu_4bit_weights_run_in_bf16_unless_a_dtype_is_asked_for(tmp_path):
    """`CpuDtypePreferring`: with --dtype auto the CPU runs a GGUF in bf16, where torch's int4 matmul is fast."""
    file = write_mixed_gguf(tmp_path / "tiny.gguf")
    with LLM(model=str(file), device="cpu") as llm:
        assert llm.engine.model.embed_tokens.weight.dtype == torch.bfloat16
    with LLM(model=str(file), device="cpu", dtype="float32") as llm:
        assert llm.engine.model.embed_tokens.weight.dtype == torch.float32


def test_dummy_weights_fill_a_gguf_models_layers(tmp_path):
    file = write_mixed_gguf(tmp_path / "tiny.gguf")
    with LLM(model=str(file), device="cpu", dtype="float32", load_format="dummy") as llm:
        layer = llm.engine.model.layers[1].mlp.gate_up_proj
        out = llm.generate([[1, 5, 6, 7]], PARAMS)[0].outputs[0].token_ids
    assert [p.kind for p in layer.pieces] == ["float"] and len(out) == MAX_TOKENS


def test_pieces_are_parameters_and_4bit_ones_are_two_values_a_byte(tmp_path):
    rng = np.random.default_rng(2)
    layer = GGUFLinear(256, 40)
    for offset, kind, rows in ((0, "Q4_K", 32), (32, "Q6_K", 8)):  # 8 rows: no int4 matmul, dequantized
        layer.load_rows("weight_blocks", offset, rows, torch.from_numpy(random_blocks(kind, rows, 256, rng)))
        names = layer.load_rows("weight_type", offset, rows, torch.tensor(int(gguf.GGMLQuantizationType[kind])))
    assert set(names) == {n for n, _ in layer.named_parameters()}
    assert layer.pieces[0].values.shape == (32, 128) and layer.pieces[1].values.shape == (8, 256)
    x = torch.randn(2, 256, dtype=torch.bfloat16)
    assert torch.allclose(layer(x).float(), x.float() @ layer.dequantized().T, rtol=0.02, atol=0.5)


def test_the_doctor_reports_the_dtype_the_engine_takes(tmp_path):
    from click.testing import CliRunner

    from infer.cli.main import cli

    file = write_mixed_gguf(tmp_path / "tiny.gguf")
    result = CliRunner().invoke(cli, ["doctor", "--model", str(file), "--device", "cpu"])
    assert result.output.startswith("infer doctor: device cpu, dtype bfloat16"), result.output
