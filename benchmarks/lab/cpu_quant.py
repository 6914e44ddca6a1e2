"""4-bit weights on the CPU, batch 1: SmolLM2-135M's GGUF kept quantized (Q4_1, its Q8_0 tensors), the same
model as a bf16 folder, and llama.cpp on the same GGUF file with the same threads (`llama-cpp-python`,
built from its sdist: `pip install llama-cpp-python`), in one run, rounds alternated.

    python -m benchmarks.lab.cpu_quant [--gguf FILE] [--folder DIR] [--threads 2] [--tokens 128] [--rounds 3]

Each round generates --tokens greedy tokens (EOS ignored) after the same prompt in each engine; the
figure is output tokens per second over the whole generation (the short prompt's prefill included),
best round of each. The defaults are `infer models pull smollm2-135m`'s files.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any, Callable

PROMPT = "Write a short story about a robot who learns to paint."


def _infer(model: str, threads: int, tokens: int, dtype: str) -> tuple[Callable[[], float], list[int], Any]:
    import torch

    from infer import LLM, SamplingParams

    torch.set_num_threads(threads)
    llm = LLM(model=model, attention="torch", dtype=dtype, max_model_len=512, cpu_threads=threads)
    ids = llm.tokenizer(PROMPT)["input_ids"]
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    out: list[int] = []

    def once() -> float:
        started = time.perf_counter()
        result = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
        seconds = time.perf_counter() - started
        out[:] = result[0].outputs[0].token_ids
        return seconds

    return once, out, llm


def _llama_cpp(gguf: str, threads: int, tokens: int, ids: list[int]) -> tuple[Callable[[], float], list[int], Any]:
    from llama_cpp import Llama

    llm = Llama(model_path=gguf, n_threads=threads, n_threads_batch=threads, n_ctx=512, verbose=False, seed=0)
    out: list[int] = []

    def once() -> float:
        llm.reset()
        got: list[int] = []
        started = time.perf_counter()
        for token in llm.generate(ids, temp=0.0, top_k=1, reset=True):
            got.append(token)
            if len(got) == tokens:
                break
        seconds = time.perf_counter() - started
        out[:] = got
        return seconds

    return once, out, llm


def main(argv: list[str] | None = None) -> None:
    cache = Path(os.environ.get("INFER_CACHE_DIR", Path.home() / ".cache" / "infer")) / "models" / "smollm2-135m"
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", default=str(cache / "SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--folder", default=str(cache))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)

    gguf_run, gguf_out, gguf_llm = _infer(args.gguf, args.threads, args.tokens, "bfloat16")
    bf16_run, bf16_out, _ = _infer(args.folder, args.threads, args.tokens, "bfloat16")
    ids = gguf_llm.tokenizer(PROMPT)["input_ids"]
    engines: dict[str, Callable[[], float]] = {"infer GGUF Q4_1 (kept), bf16": gguf_run, "infer bf16 folder": bf16_run}
    outputs: dict[str, list[int]] = {"infer GGUF Q4_1 (kept), bf16": gguf_out, "infer bf16 folder": bf16_out}
    try:
        cpp_run, cpp_out, _ = _llama_cpp(args.gguf, args.threads, args.tokens, ids)
        engines["llama.cpp, same GGUF"] = cpp_run
        outputs["llama.cpp, same GGUF"] = cpp_out
    except ImportError:
        print("llama.cpp left out: pip install llama-cpp-python (it builds from source)")
    for run in engines.values():  # warm: first calls allocate and pick kernels
        run()
    seconds: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(args.rounds):
        for name, run in engines.items():
            seconds[name].append(run())
    best = {name: args.tokens / min(s) for name, s in seconds.items()}
    base = best["infer bf16 folder"]
    print(f"SmolLM2-135M, batch 1, {args.tokens} tokens, {args.threads} threads, best of {args.rounds}:")
    for name, rate in best.items():
        rounds = ", ".join(f"{args.tokens / s:.1f}" for s in seconds[name])
        print(f"  {name:32s} {rate:7.1f} tok/s  ({rate / base:.2f}x bf16; rounds {rounds})")
    cpp = outputs.get("llama.cpp, same GGUF")
    if cpp:
        same = next((i for i, (a, b) in enumerate(zip(cpp, gguf_out)) if a != b), min(len(cpp), len(gguf_out)))
        print(f"  infer's GGUF run and llama.cpp's: the same greedy tokens for the first {same} of {len(cpp)}")
    if args.out is not None:
        args.out.write_text(
            json.dumps({"args": vars(args) | {"out": str(args.out)}, "tok_s": best, "seconds": seconds})
        )


if __name__ == "__main__":
    main()
