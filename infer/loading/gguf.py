"""Convert a Llama- or Qwen2-architecture GGUF file into an HF folder (config.json, model.safetensors, tokenizer).

Reads the file with the `gguf` library alone: no llama.cpp, no transformers on the weight path.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from safetensors.torch import save_file

from infer.api.errors import ModelLoadError

_MISSING = object()
# GGUF architectures read here; llama.cpp permutes Llama's q and k rows for its rotary layout, not Qwen2's
ARCHITECTURES = ("llama", "qwen2")

# GGUF per-layer tensor name (blk.N.<key>.weight) -> HF (model.layers.N.<value>.weight).
_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}  # fmt: skip
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

# Llama 3's split regex, as in its tokenizer.json (llama.cpp calls this pre-tokenizer "llama-bpe").
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def permute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """HF row order -> llama.cpp row order (as in llama.cpp's convert_hf_to_gguf.py).

    w: [n_heads * head_dim, ...]. Within each head, HF keeps the two rotary halves apart
    (rows 0..d/2-1, then d/2..d-1); llama.cpp interleaves them (row 2i, 2i+1 form pair i).
    """
    rows = w.shape[0]
    return w.reshape(n_heads, 2, rows // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Inverse of permute_qk: llama.cpp row order -> HF row order. w: [n_heads * head_dim, ...]."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _field(reader: gguf.GGUFReader, key: str, default: Any = _MISSING) -> Any:
    """One scalar or string field, read through `parts` (works on every gguf release >= 0.10)."""
    f = reader.fields.get(key)
    if f is None:
        if default is _MISSING:
            raise ModelLoadError(f"GGUF file lacks metadata key {key!r}: it is not a complete Llama GGUF")
        return default
    if f.types[0] == gguf.GGUFValueType.STRING:
        return bytes(f.parts[f.data[0]]).decode("utf-8")
    return f.parts[f.data[0]][0].item()


def _array(reader: gguf.GGUFReader, key: str) -> list[Any] | None:
    f = reader.fields.get(key)
    if f is None:
        return None
    if f.types[-1] == gguf.GGUFValueType.STRING:
        return [bytes(f.parts[i]).decode("utf-8") for i in f.data]
    return [f.parts[i][0].item() for i in f.data]


def _f32(x: float) -> float:
    """GGUF stores float32; write its shortest decimal (1e-05, not 9.999999747378752e-06)."""
    return float(str(np.float32(x)))


def _hf_name(name: str) -> str:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    parts = name.split(".")
    if (
        len(parts) == 4
        and parts[0] == "blk"
        and parts[1].isdigit()
        and parts[2] in _LAYER_NAMES
        and parts[3] in ("weight", "bias")
    ):
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
    raise ModelLoadError(
        f"GGUF tensor {name!r} has no Llama or Qwen2 equivalent: this converter reads those GGUFs only"
    )


def _config(reader: gguf.GGUFReader, tensors: dict[str, gguf.ReaderTensor], dtype: torch.dtype) -> dict[str, Any]:
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ModelLoadError(
            f"GGUF architecture is {arch!r}; only {' and '.join(map(repr, ARCHITECTURES))} can be read"
        )
    a = f"{arch}."
    hidden = int(_field(reader, a + "embedding_length"))
    n_head = int(_field(reader, a + "attention.head_count"))
    n_kv = int(_field(reader, a + "attention.head_count_kv", n_head))
    head_dim = int(_field(reader, a + "attention.key_length", hidden // n_head))
    rope_dim = int(_field(reader, a + "rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise ModelLoadError(f"GGUF uses partial rotary ({rope_dim} of {head_dim} dims), which Llama does not")
    rope_scaling = None
    scaling = _field(reader, a + "rope.scaling.type", "none")
    if scaling == "linear":
        rope_scaling = {"rope_type": "linear", "factor": _f32(_field(reader, a + "rope.scaling.factor"))}
    elif scaling != "none":
        raise ModelLoadError(f"GGUF rope scaling {scaling!r} is not supported (only none or linear)")
    qwen2 = arch == "qwen2"
    return {
        "architectures": ["Qwen2ForCausalLM" if qwen2 else "LlamaForCausalLM"],
        "model_type": arch,
        "vocab_size": int(tensors["token_embd.weight"].shape[1]),  # GGUF dims are reversed: [hidden, vocab]
        "hidden_size": hidden,
        "intermediate_size": int(_field(reader, a + "feed_forward_length")),
        "num_hidden_layers": int(_field(reader, a + "block_count")),
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "max_position_embeddings": int(_field(reader, a + "context_length")),
        "rms_norm_eps": _f32(_field(reader, a + "attention.layer_norm_rms_epsilon")),
        "rope_theta": _f32(_field(reader, a + "rope.freq_base", 10000.0)),
        "rope_scaling": rope_scaling,
        "hidden_act": "silu",
        **({} if qwen2 else {"attention_bias": False}),  # Qwen2: q, k and v have biases, o none
        "mlp_bias": False,
        "tie_word_embeddings": "output.weight" not in tensors,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id", None),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id", None),
        "pad_token_id": _field(reader, "tokenizer.ggml.padding_token_id", None),
        "torch_dtype": str(dtype).removeprefix("torch."),
        "use_cache": True,
    }


def _weights(tensors: list[gguf.ReaderTensor], config: dict[str, Any], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    n_head, n_kv = config["num_attention_heads"], config["num_key_value_heads"]
    permuted = config["model_type"] == "llama"  # llama.cpp's rotary row order (Qwen2's rows are HF's)

    def convert(t: gguf.ReaderTensor) -> tuple[str, torch.Tensor]:
        name = _hf_name(t.name)
        try:
            w = gguf.quants.dequantize(t.data, t.tensor_type)
        except NotImplementedError as e:
            raise ModelLoadError(f"{t.name} uses {t.tensor_type.name}, which the gguf library cannot dequantize") from e
        # float32 in HF layout [out, in] (GGUF lists dims innermost first).
        w = w.reshape([int(d) for d in reversed(t.shape)])
        if permuted and t.name.endswith("attn_q.weight"):
            w = unpermute_qk(w, n_head)
        elif permuted and t.name.endswith("attn_k.weight"):
            w = unpermute_qk(w, n_kv)
        if not w.flags.writeable:  # F32 tensors come back as read-only views of the file's memmap
            w = w.copy()
        return name, torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32)).to(dtype)

    # numpy releases the GIL inside dequantization, so threads use every core.
    with ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1)) as pool:
        return dict(pool.map(convert, tensors))


# the projections kept in their block formats (`infer.plugins.layer.gguf`); everything else is dequantized
_KEPT = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
_KEPT_TYPES = ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")


def _blocks(reader: gguf.GGUFReader, config: dict[str, Any], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """`_weights`, but each projection in a kept format as its raw block rows (`<name>.weight_blocks`, uint8
    [rows, row bytes], q and k rows in HF's order) and its ggml type id (`<name>.weight_type`)."""
    n_head, n_kv = config["num_attention_heads"], config["num_key_value_heads"]
    permuted = config["model_type"] == "llama"  # llama.cpp's rotary row order (Qwen2's rows are HF's)
    kept = [
        t
        for t in reader.tensors
        if t.name.endswith(".weight") and t.name.split(".")[-2] in _KEPT and t.tensor_type.name in _KEPT_TYPES
    ]
    names = {t.name for t in kept}
    out = {}
    for t in kept:
        name = _hf_name(t.name).removesuffix(".weight")
        rows = np.asarray(t.data).reshape(int(t.shape[-1]), -1)  # GGUF lists dims innermost first: [rows, bytes]
        if permuted and t.name.endswith("attn_q.weight"):
            rows = unpermute_qk(rows, n_head)
        elif permuted and t.name.endswith("attn_k.weight"):
            rows = unpermute_qk(rows, n_kv)
        out[f"{name}.weight_blocks"] = torch.from_numpy(np.array(rows, dtype=np.uint8))  # a copy: the file is a memmap
        out[f"{name}.weight_type"] = torch.tensor(int(t.tensor_type), dtype=torch.int32)
    out.update(_weights([t for t in reader.tensors if t.name not in names], config, dtype))
    return out


def gguf_folder(gguf_path: Path, out_dir: Path, dtype: torch.dtype = torch.float32) -> Path:
    """`convert_gguf`, keeping the projections quantized: an HF folder whose config.json's
    `quantization_config` is {"quant_method": "gguf"} and whose projections stay in their GGUF block
    formats (`_blocks`; Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K, others dequantized), loaded by the `gguf` layers
    plugin. The embeddings, norms and LM head are dequantized to `dtype` (float32: every GGUF value exactly;
    the engine casts them to the run's dtype)."""
    return convert_gguf(gguf_path, out_dir, dtype, keep_quantized=True)


def _pre_tokenizer(pre: str) -> Any:
    """llama.cpp's pre-tokenizer `pre` (tokenizer.ggml.pre) as an HF one; None where not mapped here."""
    from tokenizers import Regex
    from tokenizers import pre_tokenizers as pt

    byte_level = pt.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    if pre == "gpt2":
        return byte_level
    if pre in ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"):
        # llama.cpp splits every digit apart first, then applies the GPT-2 regex.
        return pt.Sequence([pt.Digits(individual_digits=True), byte_level])
    if pre == "llama-bpe":
        split = pt.Split(Regex(_LLAMA3_SPLIT), behavior="isolated", invert=False)
        return pt.Sequence([split, pt.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False)])
    return None


def _bpe_tokenizer(reader: gguf.GGUFReader, tokens: list[str]) -> Any:
    """Byte-level BPE ("gpt2" GGUF tokenizer model) rebuilt from the GGUF vocab and merges, or None."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors

    pre_name = _field(reader, "tokenizer.ggml.pre", "default")
    pre = _pre_tokenizer(pre_name)
    merges = _array(reader, "tokenizer.ggml.merges")
    if pre is None or merges is None:
        return None
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    vocab = {t: i for i, t in enumerate(tokens)}
    # llama.cpp looks whole words up before merging for Llama 3, as HF's tokenizer.json does.
    bpe = models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, ignore_merges=pre_name == "llama-bpe")
    tok = Tokenizer(bpe)
    tok.pre_tokenizer, tok.decoder = pre, decoders.ByteLevel()
    bos_id = _field(reader, "tokenizer.ggml.bos_token_id", None)
    if _field(reader, "tokenizer.ggml.add_bos_token", False) and bos_id is not None:
        bos = tokens[bos_id]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, bos_id)]
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    types = enumerate(_array(reader, "tokenizer.ggml.token_type") or [])
    control, user = gguf.TokenType.CONTROL, gguf.TokenType.USER_DEFINED
    added = [AddedToken(tokens[i], special=ty == control, normalized=False) for i, ty in types if ty in (control, user)]
    tok.add_special_tokens([a for a in added if a.special])
    tok.add_tokens([a for a in added if not a.special])
    return tok


def _write_tokenizer(reader: gguf.GGUFReader, gguf_path: Path, out: Path, config: dict[str, Any]) -> None:
    tokens = _array(reader, "tokenizer.ggml.tokens")
    if tokens is None:
        raise ModelLoadError(f"{gguf_path.name} carries no tokenizer: convert from a GGUF that includes one")
    tok = _bpe_tokenizer(reader, tokens) if _field(reader, "tokenizer.ggml.model", "") == "gpt2" else None
    if tok is not None:
        tok.save(str(out / "tokenizer.json"))
    else:
        # SentencePiece and unusual pre-tokenizers: transformers' own GGUF tokenizer conversion (slower).
        from transformers import AutoTokenizer

        with tempfile.TemporaryDirectory() as scratch:
            hf_tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
            hf_tok.save_pretrained(scratch)
            shutil.copyfile(Path(scratch) / "tokenizer.json", out / "tokenizer.json")

    def token(key: str) -> str | None:
        i = _field(reader, f"tokenizer.ggml.{key}_token_id", None)
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    tok_config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("bos"),
        "eos_token": token("eos"),
        "unk_token": token("unknown"),
        "pad_token": token("padding"),
        "clean_up_tokenization_spaces": False,
        "model_max_length": config["max_position_embeddings"],
        "chat_template": _field(reader, "tokenizer.chat_template", None),
    }
    tok_config = {k: v for k, v in tok_config.items() if v is not None}
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2, ensure_ascii=False) + "\n")


def _replace_dir(tmp: Path, out_dir: Path) -> None:
    """Move the finished tmp folder to out_dir; an existing out_dir is swapped out whole, never merged."""
    old = out_dir.with_name(f".{out_dir.name}.old-{uuid.uuid4().hex[:8]}") if out_dir.exists() else None
    if old is not None:
        out_dir.rename(old)
    try:
        tmp.rename(out_dir)
    except OSError:
        if old is not None:
            old.rename(out_dir)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def convert_gguf(
    gguf_path: Path, out_dir: Path, dtype: torch.dtype = torch.bfloat16, keep_quantized: bool = False
) -> Path:
    """Write an HF Llama folder for gguf_path at out_dir (replacing it) and return out_dir.

    Files are built in a hidden sibling folder and renamed into place, so out_dir is either
    absent, the previous folder, or complete.
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    try:
        reader = gguf.GGUFReader(gguf_path)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot read GGUF file {gguf_path} ({e}): check the file is a complete .gguf") from e
    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise ModelLoadError(f"{gguf_path.name} has no token_embd.weight: it is not a Llama GGUF")
    config = _config(reader, tensors, dtype)

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        weights = _blocks(reader, config, dtype) if keep_quantized else _weights(list(reader.tensors), config, dtype)
        if keep_quantized:
            config["quantization_config"] = {"quant_method": "gguf", "file": gguf_path.name}
        save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        del weights
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        _write_tokenizer(reader, gguf_path, tmp, config)
        for f in tmp.iterdir():
            f.chmod(0o644)
        tmp.chmod(0o755)
        _replace_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir
