"""What do speculative decoding, early exit and prefix caching buy on a GPU? Measured in one process.

    python -m benchmarks.lab.features --out features.json [--only spec,early,prefix]

Dummy weights throughout (timing does not depend on the values). Speculative decoding: the
draft/target step-time ratio and the verify overhead are measured, and the speedup they predict for
acceptance rates 0.6 and 0.8 is printed beside the measured speedup of `ngram`. Speculative decoding
on real weights (agreement with a CPU fp32 reference, acceptance, speed-up): `benchmarks.lab.speculative`.
"""

from __future__ import annotations

import argparse
import json
import random
from typing import Any

import torch

from infer.api.config import EngineConfig
from infer.api.request import SamplingParams
from infer.bench.engines import release_memory
from infer.bench.report import run_workload, warm_up
from infer.bench.workloads import Workload
from infer.runtime.builder import make_engine


def run(label: str, workload: Workload, keep_outputs: bool = False, **opts: Any) -> dict[str, Any]:
    opts.setdefault("load_format", "dummy")
    engine = make_engine(EngineConfig(dtype="bfloat16", kv_cache_memory_gib=8.0, **opts))
    try:
        warm = Workload("warm", [list(range(100, 164))], [8], ignore_eos=True)
        warm_up(engine, warm)  # count the measured run only
        record, outputs = run_workload(engine, workload, SamplingParams(temperature=0), label)
        out = record.to_dict()
        if keep_outputs:
            out["token_ids"] = [o.outputs[0].token_ids for o in outputs]
        out["engine_stats"] = engine.stats()
        print(
            f"{label:48s} out tok/s {out['output_tokens_per_s']:8.1f}  TPOT p50 {out['tpot_p50_s'] * 1e3:7.2f} ms  "
            f"steps {out['steps']}  {json.dumps({k: round(v, 3) for k, v in out['engine_stats'].items() if isinstance(v, float)})}"
        )
        return out
    finally:
        engine.close()
        del engine
        release_memory()


def latency_workload(vocab: int, out_tokens: int = 128) -> Workload:
    rng = random.Random(0)
    return Workload("latency-1", [[rng.randrange(10, vocab) for _ in range(128)]], [out_tokens], ignore_eos=True)


def repetitive_workload(vocab: int, n: int = 8, out_tokens: int = 128) -> Workload:
    """Prompts that repeat a random 24-token phrase eight times: what prompt lookup is for."""
    rng = random.Random(1)
    prompts: list[str | list[int]] = []
    for _ in range(n):
        phrase = [rng.randrange(10, vocab) for _ in range(24)]
        prompts.append(phrase * 8)
    return Workload("repetitive", prompts, [out_tokens] * n, ignore_eos=True)


def predicted_speedup(alpha: float, k: int, t_target: float, t_draft: float, t_verify: float) -> float:
    expected_tokens = (1 - alpha ** (k + 1)) / (1 - alpha)  # accepted drafts + the target's own token
    return expected_tokens * t_target / (k * t_draft + t_verify)


def measure_spec(k: int) -> dict[str, Any]:
    """Draft model: the draft/target step-time ratio, the verify overhead and the speedup they predict,
    beside the measured one; prompt lookup (`ngram`) on prompts that repeat themselves."""
    wl = latency_workload(32000)
    target = run("llama2-13b autoregressive", wl, model="llama2-13b")
    draft = run("llama2-7b autoregressive (the draft alone)", wl, model="llama2-7b")
    spec = run(
        "llama2-13b speculative, draft llama2-7b, K=4",
        wl,
        model="llama2-13b",
        decoding="speculative",
        draft="llama2-7b",
        num_speculative_tokens=k,
    )
    stats = spec["engine_stats"]
    steps = max(spec["steps"], 1)
    t_t, t_d = target["tpot_p50_s"], draft["tpot_p50_s"]
    t_verify = stats.get("spec_verify_s", 0.0) / steps
    t_draft_step = stats.get("spec_draft_s", 0.0) / steps
    summary = {
        "target_step_s": t_t,
        "draft_step_s": t_d,
        "draft_target_ratio": t_d / t_t,
        "verify_step_s": t_verify,
        "verify_overhead": t_verify / t_t,
        "draft_k_tokens_s": t_draft_step,
        "predicted_speedup_0.6": predicted_speedup(0.6, k, t_t, t_d, t_verify),
        "predicted_speedup_0.8": predicted_speedup(0.8, k, t_t, t_d, t_verify),
        "measured_draft_model": spec["output_tokens_per_s"] / target["output_tokens_per_s"],
        "draft_model_acceptance": stats.get("acceptance_rate"),
    }
    rep = repetitive_workload(32000)
    base = run("llama2-7b autoregressive, repetitive", rep, model="llama2-7b")
    ngram = run(
        "llama2-7b speculative ngram K=4, repetitive",
        rep,
        model="llama2-7b",
        decoding="speculative",
        draft="ngram",
        num_speculative_tokens=k,
    )
    summary.update(
        ngram_speedup=ngram["output_tokens_per_s"] / base["output_tokens_per_s"],
        ngram_acceptance=ngram["engine_stats"].get("acceptance_rate"),
        ngram_mean_tokens_per_step=ngram["engine_stats"].get("mean_tokens_per_step"),
    )
    return {"spec": summary, "spec_runs": [target, draft, spec, base, ngram]}


def measure_early_exit() -> dict[str, float]:
    """Output tokens/s of llama2-7b latency-1 with all 32 layers and exiting at 8, 16 and 24."""
    wl = latency_workload(32000, 256)
    full = run("llama2-7b all 32 layers", wl, model="llama2-7b")
    rows = {"32": full["output_tokens_per_s"]}
    for layers in (8, 16, 24):
        r = run(f"llama2-7b early exit at {layers}/32", wl, model="llama2-7b", decoding="early-exit", exit_layer=layers)
        rows[str(layers)] = r["output_tokens_per_s"]
    return rows


def measure_prefix_caching() -> dict[str, Any]:
    """256 prompts sharing a 1024-token system prompt, prefix caching on against off."""
    rng = random.Random(2)
    system = [rng.randrange(10, 32000) for _ in range(1024)]
    prompts: list[str | list[int]] = [system + [rng.randrange(10, 32000) for _ in range(32)] for _ in range(256)]
    wl = Workload("shared-system-prompt", prompts, [32] * len(prompts), ignore_eos=True)
    on = run("llama2-7b shared 1024-token prompt, prefix caching on", wl, model="llama2-7b")
    off = run(
        "llama2-7b shared 1024-token prompt, prefix caching off", wl, model="llama2-7b", enable_prefix_caching=False
    )
    return {"on": on, "off": off, "speedup": on["total_tokens_per_s"] / off["total_tokens_per_s"]}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.lab.features",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--out", default="features.json")
    ap.add_argument("--only", default="spec,early,prefix")
    args = ap.parse_args(argv)
    parts = set(args.only.split(","))
    results: dict[str, Any] = {"device": torch.cuda.get_device_name()}
    k = 4
    if "spec" in parts:
        results.update(measure_spec(k))
    if "early" in parts:
        results["early_exit_tokens_per_s"] = measure_early_exit()
    if "prefix" in parts:
        results["prefix"] = measure_prefix_caching()
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2, default=str)
    print(
        "\n"
        + json.dumps(
            {k: v for k, v in results.items() if k in ("spec", "early_exit_tokens_per_s")}, indent=1, default=str
        )
    )
    if "prefix" in results:
        print(f"prefix caching on/off total tok/s: {results['prefix']['speedup']:.2f}x")


if __name__ == "__main__":
    main()
