"""GGUF -> HF conversion on a tiny GGUF written here (no download): names, values, config, tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from infer.api.errors import ModelLoadError
from infer.loading import gguf as gguf_convert
from infer.loading.gguf import convert_gguf, permute_qk, unpermute_qk

HIDDEN, FFN, LAYERS, HEADS, KV_HEADS, CONTEXT = 32, 64, 2, 4, 2, 256
HEAD_DIM = HIDDEN // HEADS
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "Ġ c", "a t", "Ġc at", "Ċ Ċ", "Ġ 1"]
TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"


def _tokens() -> list[str]:
    from tokenizers import pre_tokenizers

    # 3 control tokens, the 256 byte-level symbols, then one token per merge result.
    merged = [m.replace(" ", "") for m in MERGES]
    return SPECIALS + sorted(pre_tokenizers.ByteLevel.alphabet()) + merged


def _hf_weights(tied: bool, seed: int = 0) -> dict[str, np.ndarray]:
    """Random fp32 weights in HF layout ([out, in])."""
    rng = np.random.default_rng(seed)
    vocab = len(_tokens())

    def rand(*shape: int) -> np.ndarray:
        return rng.normal(0.0, 0.1, size=shape).astype(np.float32)

    w = {"model.embed_tokens.weight": rand(vocab, HIDDEN), "model.norm.weight": 1.0 + rand(HIDDEN)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        w |= {
            p + "input_layernorm.weight": 1.0 + rand(HIDDEN),
            p + "post_attention_layernorm.weight": 1.0 + rand(HIDDEN),
            p + "self_attn.q_proj.weight": rand(HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.k_proj.weight": rand(KV_HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.v_proj.weight": rand(KV_HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.o_proj.weight": rand(HIDDEN, HEADS * HEAD_DIM),
            p + "mlp.gate_proj.weight": rand(FFN, HIDDEN),
            p + "mlp.up_proj.weight": rand(FFN, HIDDEN),
            p + "mlp.down_proj.weight": rand(HIDDEN, FFN),
        }
    if not tied:
        w["lm_head.weight"] = rand(vocab, HIDDEN)
    return w


def _gguf_name(hf: str) -> str:
    inverse = {v: k for k, v in gguf_convert._GLOBAL_NAMES.items()}
    if hf in inverse:
        return inverse[hf]
    _, _, layer, *rest = hf.split(".")
    module = ".".join(rest[:-1])
    return f"blk.{layer}.{next(k for k, v in gguf_convert._LAYER_NAMES.items() if v == module)}.weight"


def write_tiny_gguf(path: Path, weights: dict[str, np.ndarray], arch: str = "llama", pre: str = "smollm") -> Path:
    """A 2-layer Llama GGUF as llama.cpp writes it: q/k rows permuted, embedding in Q8_0."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(LAYERS)
    w.add_context_length(CONTEXT)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_rope_freq_base(50000.0)
    w.add_layer_norm_rms_eps(1e-5)
    tokens = _tokens()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(
        [gguf.TokenType.CONTROL] * len(SPECIALS) + [gguf.TokenType.NORMAL] * (len(tokens) - len(SPECIALS))
    )
    w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(False)
    w.add_chat_template(TEMPLATE)
    for hf, arr in weights.items():
        name = _gguf_name(hf)
        if name.endswith("attn_q.weight"):
            arr = permute_qk(arr, HEADS)
        elif name.endswith("attn_k.weight"):
            arr = permute_qk(arr, KV_HEADS)
        if name == "token_embd.weight":
            q8 = gguf.quants.quantize(arr, gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(name, q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _expected(weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """What conversion must give back: the HF weights, with the embedding's Q8_0 rounding."""
    out = dict(weights)
    emb = weights["model.embed_tokens.weight"]
    q8 = gguf.GGMLQuantizationType.Q8_0
    out["model.embed_tokens.weight"] = gguf.quants.dequantize(gguf.quants.quantize(emb, q8), q8).reshape(emb.shape)
    return out


@pytest.mark.parametrize(("n_heads", "head_dim", "cols"), [(9, 64, 576), (3, 64, 5), (1, 2, 1), (4, 8, 0)])
def test_unpermute_inverts_permute(n_heads: int, head_dim: int, cols: int) -> None:
    shape = (n_heads * head_dim, cols) if cols else (n_heads * head_dim,)
    w = np.random.default_rng(1).normal(size=shape).astype(np.float32)
    assert np.array_equal(unpermute_qk(permute_qk(w, n_heads), n_heads), w)
    assert np.array_equal(permute_qk(unpermute_qk(w, n_heads), n_heads), w)
    t = torch.from_numpy(w)  # works on torch tensors too
    assert torch.equal(unpermute_qk(permute_qk(t, n_heads), n_heads), t)


def test_permutation_hand_example() -> None:
    # HF head rows [r0 r1 | r2 r3] (rotary halves); llama.cpp pairs (r0, r2), (r1, r3) next to each other.
    hf = np.arange(8)
    llama_cpp = np.array([0, 2, 1, 3, 4, 6, 5, 7])
    assert np.array_equal(permute_qk(hf, 2), llama_cpp)
    assert np.array_equal(unpermute_qk(llama_cpp, 2), hf)
    assert np.array_equal(unpermute_qk(np.array([0, 3, 1, 4, 2, 5]), 1), np.arange(6))
    rows = np.arange(8)[:, None] * 10 + np.arange(3)  # a whole row moves, columns stay
    assert np.array_equal(unpermute_qk(rows[llama_cpp], 2), rows)


@pytest.mark.parametrize("tied", [True, False])
def test_convert_tiny_gguf(tmp_path: Path, tied: bool) -> None:
    weights = _hf_weights(tied)
    src = write_tiny_gguf(tmp_path / "tiny.gguf", weights)
    out = convert_gguf(src, tmp_path / "hf", dtype=torch.float32)

    assert out == tmp_path / "hf"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "tiny.gguf"]  # no temp folders left
    config = json.loads((out / "config.json").read_text())
    assert config == config | {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": len(_tokens()),
        "hidden_size": HIDDEN, "intermediate_size": FFN, "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM,
        "max_position_embeddings": CONTEXT, "rms_norm_eps": 1e-5, "rope_theta": 50000.0,
        "tie_word_embeddings": tied, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32",
    }  # fmt: skip
    got = load_file(str(out / "model.safetensors"))
    expected = _expected(weights)
    assert set(got) == set(expected)
    for name, want in expected.items():
        assert got[name].dtype == torch.float32
        assert torch.equal(got[name], torch.from_numpy(want)), name
    tok_config = json.loads((out / "tokenizer_config.json").read_text())
    assert tok_config["chat_template"] == TEMPLATE
    assert [tok_config[k] for k in ("bos_token", "eos_token", "pad_token")] == SPECIALS[1:] + ["<|im_end|>"]


def test_converted_folder_runs_like_the_original_in_transformers(tmp_path: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    weights = _hf_weights(tied=False, seed=3)
    out = convert_gguf(write_tiny_gguf(tmp_path / "t.gguf", weights), tmp_path / "hf", dtype=torch.float32)
    converted = LlamaForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    cfg = json.loads((out / "config.json").read_text())
    reference = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in cfg.items() if k != "torch_dtype"})).eval()
    reference.load_state_dict({k: torch.from_numpy(v) for k, v in _expected(weights).items()})
    ids = torch.tensor([[1, 40, 50, 260, 261, 7, 2]])
    with torch.no_grad():
        torch.testing.assert_close(converted(ids).logits, reference(ids).logits, rtol=0, atol=1e-5)


def test_default_dtype_is_bfloat16(tmp_path: Path) -> None:
    out = convert_gguf(write_tiny_gguf(tmp_path / "t.gguf", _hf_weights(True)), tmp_path / "hf")
    assert {t.dtype for t in load_file(str(out / "model.safetensors")).values()} == {torch.bfloat16}
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_tokenizer_follows_llama_cpp_smollm_pretokenizer(tmp_path: Path) -> None:
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    out = convert_gguf(write_tiny_gguf(tmp_path / "t.gguf", _hf_weights(True)), tmp_path / "hf")
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    enc = tok.encode("the cat 12\n\n3 the")
    # llama.cpp "smollm": every digit alone first, then the GPT-2 regex; so no "Ġ1", and "\n\n" is one piece.
    assert enc.tokens == ["t", "he", "Ġcat", "Ġ", "1", "2", "ĊĊ", "3", "Ġthe"]
    assert tok.decode(enc.ids) == "the cat 12\n\n3 the"
    assert tok.encode("<|im_start|>x<|im_end|>").ids[::2] == [1, 2]

    hf = AutoTokenizer.from_pretrained(str(out))
    assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id, hf.unk_token_id) == (1, 2, 2, 0)
    text = hf.apply_chat_template([{"role": "user", "content": "the cat"}], tokenize=False)
    assert text == "<|im_start|>user\nthe cat<|im_end|>\n"
    assert hf.decode(hf(text)["input_ids"], skip_special_tokens=True) == "user\nthe cat\n"


def test_unknown_pretokenizer_falls_back_to_transformers(tmp_path: Path) -> None:
    out = convert_gguf(write_tiny_gguf(tmp_path / "t.gguf", _hf_weights(True), pre="default"), tmp_path / "hf")
    from tokenizers import Tokenizer

    # transformers ignores the pre-tokenizer name: plain GPT-2 splitting, so " 1" merges.
    assert Tokenizer.from_file(str(out / "tokenizer.json")).encode(" the cat 12").tokens == ["Ġthe", "Ġcat", "Ġ1", "2"]


def test_existing_folder_is_replaced_whole(tmp_path: Path) -> None:
    out = tmp_path / "hf"
    out.mkdir()
    (out / "stale.bin").write_bytes(b"old")
    convert_gguf(write_tiny_gguf(tmp_path / "t.gguf", _hf_weights(True)), out)
    assert not (out / "stale.bin").exists() and (out / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "t.gguf"]


def test_failed_conversion_leaves_no_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = write_tiny_gguf(tmp_path / "t.gguf", _hf_weights(True))

    def boom(*args: object, **kwargs: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(gguf_convert, "save_file", boom)
    with pytest.raises(OSError, match="disk full"):
        convert_gguf(src, tmp_path / "cache" / "hf")
    assert list((tmp_path / "cache").iterdir()) == []


def test_rejects_other_architectures_and_non_gguf_files(tmp_path: Path) -> None:
    src = write_tiny_gguf(tmp_path / "q.gguf", _hf_weights(True), arch="gemma2")
    with pytest.raises(ModelLoadError, match="only 'llama' and 'qwen2' can be read"):
        convert_gguf(src, tmp_path / "a")
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(ModelLoadError, match="cannot read GGUF"):
        convert_gguf(tmp_path / "junk.gguf", tmp_path / "b")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
