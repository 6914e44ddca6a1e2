"""Does an LLM give its GPU memory back at close? Builds, uses and closes engines in turn and prints
the device memory after each; with --why, names what still holds CUDA tensors after close.

    python -m benchmarks.lab.memory --model llama2-7b --load-format dummy [--why] [--vary cuda_graphs=False ...]
"""

from __future__ import annotations

import argparse
import gc
import sys
import types

import torch


def used_gib() -> float:
    free, total = torch.cuda.mem_get_info()
    return (total - free) / 2**30


def holders(limit: int = 6) -> None:
    """Live CUDA tensors and a referrer chain from each of the largest towards a root."""
    gc.collect()
    tensors = [o for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.is_cuda]
    tensors.sort(key=lambda t: -t.untyped_storage().nbytes())
    print(f"  live CUDA tensors: {len(tensors)}, {sum(t.untyped_storage().nbytes() for t in tensors) / 2**30:.2f} GiB")
    ignore = {id(tensors)}
    for t in tensors[:limit]:
        chain, obj = [], t
        for _ in range(12):
            refs = [
                r
                for r in gc.get_referrers(obj)
                if id(r) not in ignore and not isinstance(r, types.FrameType) and r is not chain
            ]
            if not refs:
                break
            obj = refs[0]
            ignore.add(id(obj))
            desc = type(obj).__name__
            if isinstance(obj, dict):
                desc += f" keys~{list(obj)[:4]}"
            elif isinstance(obj, types.FunctionType):
                desc += f" {obj.__qualname__}"
            elif hasattr(obj, "__class__") and not isinstance(obj, (list, tuple)):
                desc += f" ({type(obj).__module__})"
            chain.append((desc, obj))
        print(
            f"  {tuple(t.shape)} {t.dtype} {t.untyped_storage().nbytes() / 2**20:.0f} MiB <- "
            + " <- ".join(d for d, _ in chain)
        )
    del tensors


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.lab.memory",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default="llama2-7b")
    p.add_argument("--load-format", default="dummy")
    p.add_argument("--engines", type=int, default=3)
    p.add_argument("--why", action="store_true")
    p.add_argument(
        "--text", action="store_true", help="text prompts and a mix of sampling settings (needs a tokenizer)"
    )
    p.add_argument("--single", action="store_true", help="one prompt (batch-1 decode: the GEMV path)")
    p.add_argument(
        "--keep-memory",
        action="store_true",
        help="close() without releasing the runners (ModelRunner.release made a no-op)",
    )
    p.add_argument("--vary", nargs="*", default=[], help="FIELD=VALUE overrides (Python literals)")
    args = p.parse_args(argv)
    import ast

    from infer import LLM, SamplingParams

    overrides = {k: ast.literal_eval(v) for k, v in (s.split("=", 1) for s in args.vary)}
    if args.keep_memory:
        from infer.runtime.runner import ModelRunner

        ModelRunner.release = lambda self: None
    start = used_gib()
    print(f"start {start:.2f} GiB used; overrides {overrides}")
    worst = 0.0
    for i in range(args.engines):
        llm = LLM(model=args.model, load_format=args.load_format, **overrides)
        built = used_gib()
        if args.single:
            outs = llm.generate(
                [[(13 * k) % 30000 + 10 for k in range(128)]],
                SamplingParams(max_tokens=64, temperature=0, ignore_eos=True),
            )
        elif args.text:
            mix = [
                SamplingParams(max_tokens=24, temperature=0),
                SamplingParams(max_tokens=24, temperature=0.8, seed=1),
                SamplingParams(max_tokens=24, n=2, temperature=1.0),
                SamplingParams(max_tokens=24, logprobs=3),
                SamplingParams(max_tokens=24, stop=["e"]),
                SamplingParams(max_tokens=16, use_beam_search=True, best_of=3),
            ]
            outs = llm.generate([f"Tell me about the number {j}." for j in range(len(mix))], mix)
            outs += llm.chat([{"role": "user", "content": "Hello!"}], SamplingParams(max_tokens=16))
            assert not any(o.error for o in outs), [o.error for o in outs]
        else:
            prompts = [[(7 * j + k) % 30000 + 10 for k in range(40 + j)] for j in range(8)]
            outs = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
            assert all(len(o.outputs[0].token_ids) == 24 for o in outs)
        llm.close()
        del llm, outs
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        after = used_gib()
        worst = max(worst, after - start)
        print(f"engine {i}: built {built:.2f} GiB, after close {after:.2f} GiB (+{after - start:.2f} over start)")
        if args.why and after - start > 1.0:
            holders()
    print(f"worst {worst:.2f} GiB over start")
    return 0 if worst < 1.0 else 1


if __name__ == "__main__":
    sys.exit(main())
