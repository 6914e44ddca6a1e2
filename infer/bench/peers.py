"""Peers run beside infer in the same process: HF transformers generate (static batches) and
HF continuous batching, on the same model shape and the same token-id workload."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from infer.bench.ceilings import kv_bytes_per_token
from infer.loading.config import kv_layout


@dataclass(slots=True)
class PeerRecord:
    label: str
    num_requests: int
    prompt_tokens: int
    output_tokens: int
    wall_s: float
    error: str | None = None

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "num_requests": self.num_requests,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "wall_s": self.wall_s,
            "error": self.error,
            "output_tokens_per_s": self.output_tokens_per_s,
        }


def build_hf_model(
    hf_config: dict[str, Any], dtype: torch.dtype, device: torch.device, folder: str | None = None, seed: int = 0
):
    """The HF LlamaForCausalLM for a folder, or with random weights for a named shape."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if folder is not None:
        return LlamaForCausalLM.from_pretrained(folder, torch_dtype=dtype).to(device).eval()
    config = LlamaConfig(**{k: v for k, v in hf_config.items() if k != "architectures"})
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM._from_config(config, torch_dtype=dtype)
    return model.eval()


@torch.inference_mode()
def hf_static(model: Any, prompts: list[list[int]], max_tokens: list[int], batch_size: int) -> PeerRecord:
    """Padded static batches through `generate`: each batch runs until its longest request ends."""
    weight = next(model.parameters())
    device = weight.device

    def record(out_tokens: int = 0, wall_s: float = 0.0, error: str | None = None) -> PeerRecord:
        return PeerRecord(f"hf-static-{batch_size}", len(prompts), sum(map(len, prompts)), out_tokens, wall_s, error)

    if device.type == "cuda":  # a batch that cannot fit is known before minutes of generating into it
        need = static_kv_bytes(model.config, weight.dtype, prompts, max_tokens, batch_size)
        free = torch.cuda.mem_get_info(device)[0]
        if need > KV_SHARE_OF_FREE * free:
            return record(
                error=f"out of memory at batch {batch_size} (its padded KV cache needs {need / 2**30:.1f} "
                f"GiB, {free / 2**30:.1f} GiB free)"
            )
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    started = time.perf_counter()
    try:
        out_tokens = _static_batches(model, prompts, max_tokens, batch_size, device)
    except torch.OutOfMemoryError:  # padded batches hold every row at the longest prompt + output: reported, not fatal
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return record(error=f"out of memory at batch {batch_size}")
    sync()
    return record(out_tokens, time.perf_counter() - started)


# HF's cache grows by concatenation, so a step briefly holds the old and the new tensors: a padded
# batch's full KV cache must fit in under half of the free memory.
KV_SHARE_OF_FREE = 0.45


def static_kv_bytes(
    config: Any, dtype: torch.dtype, prompts: list[list[int]], max_tokens: list[int], batch_size: int
) -> int:
    """The largest KV cache one padded static batch reaches: rows x (longest prompt + longest output)."""
    kv_heads, head_dim = kv_layout(config)
    per_token = kv_bytes_per_token(config.num_hidden_layers, kv_heads, head_dim, dtype)
    worst = 0
    for i in range(0, len(prompts), batch_size):
        rows = prompts[i : i + batch_size]
        worst = max(worst, len(rows) * (max(map(len, rows)) + max(max_tokens[i : i + batch_size])))
    return worst * per_token


def _static_batches(
    model: Any, prompts: list[list[int]], max_tokens: list[int], batch_size: int, device: torch.device
) -> int:
    out_tokens = 0
    for i in range(0, len(prompts), batch_size):
        batch = prompts[i : i + batch_size]
        width = max(len(p) for p in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long, device=device)
        mask = torch.zeros_like(ids)
        for row, p in enumerate(batch):  # left padding, as decoder-only generation needs
            ids[row, width - len(p) :] = torch.tensor(p, device=device)
            mask[row, width - len(p) :] = 1
        n = max(max_tokens[i : i + batch_size])
        y = model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
        out_tokens += sum(min(m, y.shape[1] - width) for m in max_tokens[i : i + batch_size])
        del y
    return out_tokens


def hf_continuous(model: Any, prompts: list[list[int]], max_tokens: int, attn: str = "paged|sdpa") -> PeerRecord:
    """HF transformers' own continuous batching (`generate_batch`)."""
    from transformers import GenerationConfig

    device = next(model.parameters()).device
    try:
        model.set_attn_implementation(attn)
        config = GenerationConfig(
            max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False, eos_token_id=None, pad_token_id=0
        )
        if device.type == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        results = model.generate_batch(inputs=prompts, generation_config=config)
        if device.type == "cuda":
            torch.cuda.synchronize()
        wall = time.perf_counter() - started
        out = sum(len(r.generated_tokens) for r in results.values())
        error = None if out else "generate_batch returned no tokens"
        return PeerRecord("hf-continuous", len(prompts), sum(map(len, prompts)), out, wall, error=error)
    except Exception as exc:  # a peer that cannot run here is reported, not fatal
        return PeerRecord("hf-continuous", len(prompts), 0, 0, 0.0, error=f"{type(exc).__name__}: {exc}")
    finally:
        try:
            model.set_attn_implementation("sdpa")
        except Exception:
            pass
