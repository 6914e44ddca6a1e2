"""What do micro-batches buy a pipeline? The same requests through `--pp 1` and through `--pp N` with
1, then more, micro-batches a step, each engine warmed up on prompts of its own and then timed; the
rounds alternate the configurations.

    python -m benchmarks.lab.pipeline [--model smollm2-135m] [--pp 2] [--micro 1 2 4] [--prompts 16]
        [--prompt-len 256] [--max-tokens 16] [--rounds 2] [--device cpu] [--out pipeline.json]

With one micro-batch a step, a stage waits while the others run its step's layers: N stages do the work
of one, one at a time. With M micro-batches, stage i runs micro-batch m while stage i + 1 runs m - 1.
On the CPU the stages share the machine's cores (each rank gets cores / N threads), so `--pp 1` on all
the cores is the ceiling; the ratios are to it. Tokens/s counts prompt and output tokens.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from typing import Any

from infer.api.request import SamplingParams
from infer.common.log import configure
from infer.llm import LLM


def prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab - 10) for _ in range(length)] for _ in range(count)]


def run(options: dict[str, Any], batch: list[list[int]], warm: list[list[int]], max_tokens: int) -> dict[str, Any]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    with LLM(**options) as llm:
        llm.generate(warm, params)
        started = time.perf_counter()
        outs = llm.generate(batch, params)
        seconds = time.perf_counter() - started
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    computed = generated + sum(map(len, batch))
    return {"seconds": seconds, "tokens_per_s": computed / seconds, "output_tokens": generated, "tokens": [
        o.outputs[0].token_ids for o in outs
    ]}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--micro", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--out")
    args = parser.parse_args()
    configure(level="warning")
    base = dict(model=args.model, device=args.device, dtype=args.dtype, max_num_batched_tokens=8192)
    batch = prompts(args.prompts, args.prompt_len, 49152, seed=0)
    warm = prompts(2, 32, 49152, seed=1)  # never the measured prompts: the prefix cache stays honest
    configs = {"pp 1": dict(base)}
    for m in args.micro:
        configs[f"pp {args.pp}, {m} micro-batch{'es' if m > 1 else ''}"] = dict(
            base, pipeline_parallel_size=args.pp, pipeline_micro_batches=m
        )
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in configs}
    for round_ in range(args.rounds):
        for name, options in configs.items():
            results[name].append(run(options, batch, warm, args.max_tokens))
            print(f"round {round_ + 1} {name}: {results[name][-1]['tokens_per_s']:.0f} tok/s", flush=True)
    reference = results["pp 1"][0]["tokens"]
    ceiling = max(r["tokens_per_s"] for r in results["pp 1"])
    print(f"\n{args.model}, {args.prompts} prompts x {args.prompt_len} tokens + {args.max_tokens} new, best of rounds")
    for name, runs in results.items():
        best = max(r["tokens_per_s"] for r in runs)
        same = all(r["tokens"] == reference for r in runs)
        print(f"  {name:<26} {best:8.0f} tok/s  {best / ceiling:5.2f}x pp 1   tokens as pp 1: {same}")
    if args.out:
        summary = {
            name: [{k: v for k, v in r.items() if k != "tokens"} for r in runs] for name, runs in results.items()
        }
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "results": summary}, f, indent=2)


if __name__ == "__main__":
    main()
