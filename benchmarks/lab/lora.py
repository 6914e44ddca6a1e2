"""What serving adapters costs: time per output token of batches mixing LoRA adapters against the same
batches on the base model, in one engine (`--enable-lora`, every adapter in a device slot), runs
alternated.

    python -m benchmarks.lab.lora --model llama3-8b --load-format dummy --adapters 8 --rank 16 \
        --batches 64,1 --out lora.json

The adapters are random, rank --rank on all seven projections of every layer (PEFT's layout,
`infer.testing.lora.write_random_adapter`). A batch of B requests runs request i on adapter i mod
--adapters (batch 1: adapter 0), or all on the base model; each decodes --max-tokens tokens (EOS
ignored) after a prompt of --prompt-tokens random ids. Figures: TPOT p50 over the requests, each
(latency - time to first token) / (tokens - 1), and output tokens per second; the ratio is
adapters / base, the median of --repeat alternated pairs.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from infer.api.adapters import LoRARequest
from infer.api.config import EngineConfig
from infer.api.request import SamplingParams
from infer.core.engine import Engine
from infer.runtime.builder import make_engine
from infer.testing.lora import write_random_adapter


def run_batch(engine: Engine, prompts: list[list[int]], loras: list[LoRARequest | None], max_tokens: int) -> dict:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    outputs = engine.generate(prompts, params, lora_request=loras)
    elapsed = time.perf_counter() - start
    assert all(o.error is None for o in outputs), [o.error for o in outputs if o.error][:1]
    tpots = [
        (o.metrics["latency_s"] - o.metrics["ttft_s"]) / (len(o.outputs[0].token_ids) - 1)
        for o in outputs
        if len(o.outputs[0].token_ids) > 1
    ]
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"tpot_p50_s": statistics.median(tpots), "output_tokens_per_s": tokens / elapsed, "seconds": elapsed}


def run(args: argparse.Namespace) -> dict[str, Any]:
    config = EngineConfig(
        model=args.model,
        load_format=args.load_format,
        device=args.device,
        dtype=args.dtype,
        enable_lora=True,
        max_loras=args.adapters,
        max_lora_rank=args.rank,
        max_num_seqs=max(args.batches),
    )
    engine = make_engine(config)
    results: dict[str, Any] = {"config": {k: v for k, v in vars(args).items() if k != "out"}, "batches": {}}
    try:
        results["device"] = engine.parts.describe.get("device")
        with tempfile.TemporaryDirectory() as tmp:
            loras = [
                LoRARequest(f"a{i}", i + 1, str(write_random_adapter(engine.parts.model_config, Path(tmp) / f"a{i}",
                                                                     args.rank, seed=i)))
                for i in range(args.adapters)
            ]  # fmt: skip
            for lora in loras:
                engine.add_adapter(lora)
            rng = random.Random(args.seed)
            vocab = engine.parts.vocab_size
            for batch in args.batches:
                prompts = [[rng.randrange(vocab) for _ in range(args.prompt_tokens)] for _ in range(batch)]
                mixed = [loras[i % len(loras)] for i in range(batch)]
                run_batch(engine, prompts, [None] * batch, 8)  # warm-up: graphs, kernels, the slots loaded
                run_batch(engine, prompts, mixed, 8)
                runs: dict[str, list[dict]] = {"base": [], "adapters": []}
                for _ in range(args.repeat):
                    runs["base"].append(run_batch(engine, prompts, [None] * batch, args.max_tokens))
                    runs["adapters"].append(run_batch(engine, prompts, mixed, args.max_tokens))
                    for name in runs:
                        r = runs[name][-1]
                        print(
                            f"batch {batch:3d} {name:9s} TPOT p50 {r['tpot_p50_s'] * 1e3:7.2f} ms  "
                            f"out tok/s {r['output_tokens_per_s']:9.1f}",
                            flush=True,
                        )
                base = statistics.median(r["tpot_p50_s"] for r in runs["base"])
                mixed_tpot = statistics.median(r["tpot_p50_s"] for r in runs["adapters"])
                results["batches"][str(batch)] = {"runs": runs, "tpot_ratio": mixed_tpot / base}
                print(f"batch {batch}: TPOT adapters / base = {mixed_tpot * 1e3:.2f} / {base * 1e3:.2f} ms "
                      f"= {mixed_tpot / base:.3f}x", flush=True)  # fmt: skip
    finally:
        engine.close()
    return results


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--load-format", default="dummy")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[64, 1])
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=2, help="alternated base / adapters pairs")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None, help="write the figures as JSON")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    result = run(args)
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
