"""What serving adapters costs: time per output token of batches mixing LoRA adapters (an engine with
`--enable-lora`, every adapter in a device slot) against the same batches on the base model in an engine
without adapters, both engines built side by side (--kv-cache-memory each) and their runs alternated.

    python -m benchmarks.lab.lora --model llama3-8b --load-format dummy --adapters 8 --rank 16 \
        --batches 64,1 --out lora.json

The adapters are random, rank --rank on all seven projections of every layer (PEFT's layout,
`infer.testing.lora.write_random_adapter`). A batch of B requests runs request i on adapter i mod
--adapters (batch 1: adapter 0) in the adapters' engine, on the base model in the plain one, and (for
what enabling adapters costs requests that use none) on the base model in the adapters' engine; each
decodes --max-tokens tokens (EOS ignored) after a prompt of --prompt-tokens random ids. Figures: TPOT
p50 over the requests, each (latency - time to first token) / (tokens - 1), and output tokens per
second; the ratios are over the plain engine's, each the median of --repeat alternated rounds.
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
        max_num_seqs=max(args.batches),
        kv_cache_memory_gib=args.kv_cache_memory,
        max_model_len=args.max_model_len,
    )
    plain = make_engine(config)
    engine = make_engine(config.replace(enable_lora=True, max_loras=args.adapters, max_lora_rank=args.rank))
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
                cases = {  # name -> (engine, each request's adapter)
                    "plain": (plain, [None] * batch),
                    "adapters": (engine, mixed),
                    "lora-base": (engine, [None] * batch),
                }
                for e, loras_of in cases.values():  # warm-up: graphs, kernels, the slots loaded
                    run_batch(e, prompts, loras_of, 8)
                runs: dict[str, list[dict]] = {name: [] for name in cases}
                for _ in range(args.repeat):
                    for name, (e, loras_of) in cases.items():
                        r = run_batch(e, prompts, loras_of, args.max_tokens)
                        runs[name].append(r)
                        print(
                            f"batch {batch:3d} {name:9s} TPOT p50 {r['tpot_p50_s'] * 1e3:7.2f} ms  "
                            f"out tok/s {r['output_tokens_per_s']:9.1f}",
                            flush=True,
                        )
                tpot = {name: statistics.median(r["tpot_p50_s"] for r in rs) for name, rs in runs.items()}
                ratios = {name: tpot[name] / tpot["plain"] for name in ("adapters", "lora-base")}
                results["batches"][str(batch)] = {"runs": runs, "tpot_p50_s": tpot, "tpot_ratio": ratios}
                print(f"batch {batch}: TPOT adapters {tpot['adapters'] * 1e3:.2f} ms, base in the adapters' engine "
                      f"{tpot['lora-base'] * 1e3:.2f} ms, plain {tpot['plain'] * 1e3:.2f} ms: "
                      f"{ratios['adapters']:.3f}x, {ratios['lora-base']:.3f}x", flush=True)  # fmt: skip
    finally:
        engine.close()
        plain.close()
    return results


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--load-format", default="dummy")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--kv-cache-memory", type=float, default=8.0, help="GiB of KV cache for each engine")
    ap.add_argument("--max-model-len", type=int, default=2048)
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
