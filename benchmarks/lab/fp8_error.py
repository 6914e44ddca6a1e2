"""Where FP8's perplexity cost comes from, on real weights: the checkpoint's own HF transformers model
(float32, CPU) with its attention and MLP projections rounded in several ways, scored on the windows
`infer bench accuracy` scores (`infer.bench.texts`). The LM head and embeddings stay as they are, as
under `--quantization fp8`.

    python -m benchmarks.lab.fp8_error [--model smollm2-135m] [--windows 32] [--out fp8_error.json]

Each scheme rounds the projections' weights (and, for w8a8, each product's input per token):

    per-channel        e4m3 with a scale per output row, max |w| / 448: what --quantization fp8 stores
    per-channel-mse    e4m3 with each row's scale picked from max |w| x 0.50..1.00 for the least squared error
    per-group-128, -32 e4m3 with a scale per 128 (32) input columns of each row (the last group of a row
                       may be shorter)
    mantissa-3, -4     each weight rounded to 3 (4) significand bits after the leading one, with no exponent
                       limit: e4m3's precision without its range, and one bit more
    w8a8               per-channel weights and activations quantized per token: what the engine multiplies
    w8a8-last-kept     w8a8 with the last decoder layer's projections left unrounded
    gptq, w8a8-gptq    per-channel e4m3 rounded column by column with error compensation over calibration
                       text (`infer models quantize`'s gptq: --calibration-windows chats from the text's
                       end, none of the scored windows); w8a8 with those weights

A scheme whose ratio the scale choices do not move, and that the significand's width does, is bound by the
format. The rounding is `infer.kernels.fp8_reference`'s (the plain-torch FP8 layer's); the engine's own
figures for the same text come from `infer bench accuracy`.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from contextlib import contextmanager
from typing import Callable, Iterator

import torch

from infer.kernels.fp8_reference import FP8_MAX_INV, SCALE_MIN, quantize_rows_reference, to_e4m3
from infer.plugins.layer.fp8 import quantize_weight
from infer.tools.quantize import projections

Rounding = Callable[[torch.Tensor], torch.Tensor]  # [N, K] float32 -> the same, rounded


def per_rows(w: torch.Tensor) -> torch.Tensor:
    q, scale = quantize_weight(w)
    return q.float() * scale[:, None]


def per_rows_mse(w: torch.Tensor, steps: int = 11) -> torch.Tensor:
    amax = w.abs().amax(dim=1, keepdim=True).clamp(min=SCALE_MIN)
    best, best_err = w, torch.full_like(amax, math.inf)
    for clip in torch.linspace(0.5, 1.0, steps).tolist():
        scale = amax * clip * FP8_MAX_INV
        rounded = to_e4m3(w, scale).float() * scale
        err = (rounded - w).pow(2).sum(dim=1, keepdim=True)
        better = err < best_err  # [N, 1]: the earlier clip keeps a tie
        best, best_err = torch.where(better, rounded, best), torch.where(better, err, best_err)
    return best


def per_groups(size: int) -> Rounding:
    def rounding(w: torch.Tensor) -> torch.Tensor:
        n, k = w.shape
        padded = torch.nn.functional.pad(w, (0, -k % size))  # zeros: a shorter last group keeps its own amax
        return per_rows(padded.reshape(-1, size)).reshape(n, -1)[:, :k]

    return rounding


def significand(bits: int) -> Rounding:
    def rounding(w: torch.Tensor) -> torch.Tensor:
        m, e = torch.frexp(w)  # w = m * 2^e, 0.5 <= |m| < 1: the leading one and `bits` more
        step = 2.0 ** (bits + 1)
        return torch.ldexp(torch.round(m * step) / step, e)

    return rounding


def quantize_activation(module: torch.nn.Module, args: tuple) -> tuple:
    x = args[0]
    q, scale = quantize_rows_reference(x.reshape(-1, x.shape[-1]))
    return ((q.float() * scale).reshape(x.shape).to(x.dtype), *args[1:])


def gptq_placeholder(w: torch.Tensor) -> torch.Tensor:
    """Marks the gptq schemes: `rounded` rounds each projection with its own calibration Hessian."""
    raise AssertionError("gptq rounds with a projection's Hessian: see `rounded`")


# name -> (weight rounding, activations per token, keep the last layer)
SCHEMES: dict[str, tuple[Rounding | None, bool, bool]] = {
    "none": (None, False, False),
    "per-channel": (per_rows, False, False),
    "per-channel-mse": (per_rows_mse, False, False),
    "per-group-128": (per_groups(128), False, False),
    "per-group-32": (per_groups(32), False, False),
    "mantissa-3": (significand(3), False, False),
    "mantissa-4": (significand(4), False, False),
    "w8a8": (per_rows, True, False),
    "w8a8-last-kept": (per_rows, True, True),
    "gptq": (gptq_placeholder, False, False),
    "w8a8-gptq": (gptq_placeholder, True, False),
}


def perplexity(model: torch.nn.Module, windows: list[list[int]]) -> float:
    nll, count = 0.0, 0
    with torch.no_grad():
        for window in windows:
            logprobs = model(torch.tensor([window])).logits[0].float().log_softmax(-1)
            nll -= logprobs[torch.arange(len(window) - 1), window[1:]].sum().item()
            count += len(window) - 1
    return math.exp(nll / count)


@contextmanager
def rounded(model: torch.nn.Module, scheme: str, hessians: dict[str, torch.Tensor] | None = None) -> Iterator[None]:
    """The model's projections rounded as `scheme` (a SCHEMES name) says, restored on exit; the gptq
    schemes take each projection's calibration Hessian from `hessians` (`infer.tools.quantize.hessians`)."""
    rounding, activations, keep_last = SCHEMES[scheme]

    def round_weight(name: str, w: torch.Tensor) -> torch.Tensor:
        if rounding is not gptq_placeholder:
            return rounding(w)
        from infer.tools.quantize import gptq

        assert hessians is not None, f"{scheme} needs the projections' calibration Hessians"
        q, scale = gptq(w, hessians[name])
        return q.float() * scale[:, None]

    layers = projections(model)
    last = max(int(f".{name}".split(".layers.")[-1].split(".")[0]) for name in layers) if keep_last else None
    weights = {name: m.weight.data.clone() for name, m in layers.items()}
    hooks = []
    try:
        for name, m in layers.items():
            if keep_last and f".layers.{last}." in f".{name}":
                continue
            if rounding is not None:
                m.weight.data.copy_(round_weight(name, weights[name].float()))
            if activations:
                hooks.append(m.register_forward_pre_hook(quantize_activation))
        yield
    finally:
        for hook in hooks:
            hook.remove()
        for name, m in layers.items():
            m.weight.data.copy_(weights[name])


def measure(
    model: torch.nn.Module,
    windows: list[list[int]],
    schemes: list[str],
    calibration: list[list[int]] | None = None,
) -> list[dict]:
    """Perplexity over `windows` under each scheme; the gptq ones calibrate on `calibration` (token ids)."""
    rows: list[dict] = []
    hessians = None
    if any(SCHEMES[s][0] is gptq_placeholder for s in schemes):
        from infer.tools.quantize import hessians as collect

        assert calibration, "the gptq schemes need calibration windows"
        hessians = collect(model, calibration)
    for scheme in ["none", *(s for s in schemes if s != "none")]:
        started = time.perf_counter()
        with rounded(model, scheme, hessians):
            ppl = perplexity(model, windows)
        rows.append({"scheme": scheme, "perplexity": ppl, "wall_s": time.perf_counter() - started})
        print(f"{scheme:16s} {ppl:10.4f} {ppl / rows[0]['perplexity']:8.4f}", flush=True)
    for row in rows:
        row["ratio"] = row["perplexity"] / rows[0]["perplexity"]
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.lab.fp8_error",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default="smollm2-135m", help="a named model or an HF model folder")
    p.add_argument("--windows", type=int, default=32)
    p.add_argument("--window-tokens", type=int, default=512)
    p.add_argument("--schemes", nargs="+", default=list(SCHEMES), choices=list(SCHEMES))
    p.add_argument("--calibration-windows", type=int, default=16, help="the gptq schemes' calibration windows")
    p.add_argument("--out", help="write the figures as JSON here")
    args = p.parse_args(argv)

    from transformers import AutoModelForCausalLM

    from infer.bench.texts import calibration_windows, load_text_set
    from infer.loading.hub import resolve_model_path
    from infer.loading.loader import load_tokenizer

    folder = resolve_model_path(args.model)
    if folder is None:
        print(f"no model folder for {args.model!r}: pass a folder, or `infer models pull {args.model}` first")
        return 2
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tokenizer = load_tokenizer(folder)  # None for a folder without one (a test model): the text's bytes
    text = load_text_set(tokenizer, model.config.vocab_size, args.windows, args.window_tokens, 0, 1)
    calibration = None
    if any(SCHEMES[s][0] is gptq_placeholder for s in args.schemes):
        found = calibration_windows(tokenizer, model.config.vocab_size, args.calibration_windows, args.window_tokens)
        print(f"gptq calibrates on {found.name}", flush=True)
        calibration = found.windows
    print(f"{folder}: perplexity over {text.name}\n{'scheme':16s} {'perplexity':>10s} {'ratio':>8s}", flush=True)
    rows = measure(model, text.windows, args.schemes, calibration)
    if args.out:
        record = {"model": str(folder), "text": text.name, "scored_tokens": sum(len(w) - 1 for w in text.windows)}
        with open(args.out, "w") as f:
            json.dump({**record, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
