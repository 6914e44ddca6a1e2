"""Running a workload through an engine and reporting it the way the inference community reads it."""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

from infer.api.errors import RequestError
from infer.api.request import RequestOutput, SamplingParams
from infer.bench.workloads import Workload
from infer.core.engine import Engine


@dataclass(slots=True)
class RunRecord:
    label: str
    config: dict[str, Any]  # plugin set, model, device, dtype
    num_requests: int
    prompt_tokens: int
    output_tokens: int
    wall_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    tpot_p50_s: float  # time per output token after the first
    tpot_p99_s: float
    kv_utilisation: float  # mean over steps: token slots holding tokens / slots in used blocks
    preemptions: int
    steps: int
    speedup: float | None = None  # total tokens/s against the baseline of the same run
    finish_reasons: dict[str, int] = field(default_factory=dict)
    decoding: dict[str, float] = field(default_factory=dict)  # the decoder's stats (speculative: acceptance, ...)
    prefix_hit_rate: float = 0.0  # prompt tokens found in the prefix cache / prompt tokens looked up
    preemptions_swap: int = 0  # of `preemptions`, those that swapped to the CPU pool (the rest recomputed)
    preemptions_recompute: int = 0
    blocks_saved_by_sharing: int = 0  # peak over steps: block-table entries minus physical blocks
    build_s: float | None = None  # the engine's build (weights, KV cache, CUDA graphs), before the timed part
    warm_up_s: float | None = None  # the warm-up on prompts of its own (`warm_up_shaped`); None: none ran
    build_phases: dict[str, float] | None = None  # build_s by phase (`EngineParts.build_phases`)

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.output_tokens

    @property
    def requests_per_s(self) -> float:
        return self.num_requests / self.wall_s

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s

    @property
    def total_tokens_per_s(self) -> float:
        return self.total_tokens / self.wall_s

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(
            total_tokens=self.total_tokens,
            requests_per_s=self.requests_per_s,
            output_tokens_per_s=self.output_tokens_per_s,
            total_tokens_per_s=self.total_tokens_per_s,
        )
        return d


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


def prepare_prompts(engine: Engine, workload: Workload) -> list[list[int]]:
    """Apply the chat template where asked and check every prompt before anything runs: their token ids."""
    from infer.inputs.chat_template import chat_token_ids

    prompts: list[list[int]] = []
    for i, prompt in enumerate(workload.prompts):
        try:
            if (
                workload.chat
                and isinstance(prompt, str)
                and engine.tokenizer is not None
                and getattr(engine.tokenizer, "chat_template", None)  # a duck-typed HF tokenizer's optional template
            ):
                prompt = chat_token_ids(engine.tokenizer, [{"role": "user", "content": prompt}])  # ids: one BOS at most
            _, ids = engine.tokenize(prompt)
        except RequestError as exc:
            raise RequestError(f"prompt {i} of {workload.name}: {exc}") from exc
        prompts.append(ids)
    return prompts


WARM_PROMPTS = 32  # prompts of a warm-up on the measured run's shapes, at most
WARM_TOKENS = 4  # tokens each of them generates, at most
WARM_SEED = 0x5EED  # its token ids' generator: never a workload's own seed


def warm_up_shaped(
    engine: Engine, workload: Workload, base: SamplingParams, num_prompts: int = WARM_PROMPTS
) -> tuple[float, int]:
    """The measured run's shapes on prompts of their own, so that no kernel compiles (nor tunes, nor graph
    allocates) inside the timed part and the prefix cache holds none of the measured prompts: the first
    `num_prompts` prompts' lengths, each filled with random token ids of a generator of its own, run with
    the workload's sampling for at most WARM_TOKENS tokens; the engine's counters are reset after.
    Returns (seconds, prompts) it took."""
    firsts = Workload(workload.name, workload.prompts[:num_prompts], workload.max_tokens[:num_prompts], workload.chat)
    lengths = [len(ids) for ids in prepare_prompts(engine, firsts)]
    rng = random.Random(WARM_SEED)
    high = engine.parts.vocab_size
    prompts: list[str | list[int]] = [[rng.randrange(min(10, high - 1), high) for _ in range(n)] for n in lengths]
    tokens = [min(m, WARM_TOKENS) for m in firsts.max_tokens]
    started = time.perf_counter()
    run_workload(engine, Workload("warm-up", prompts, tokens, ignore_eos=True), base, "warm-up")
    engine.reset_stats()
    return time.perf_counter() - started, len(prompts)


def warm_up(engine: Engine, workload: Workload) -> None:
    """Run `workload` greedily (kernels compile, autotune, allocators warm), then reset the engine's counters."""
    run_workload(engine, workload, SamplingParams(temperature=0), "warmup")
    engine.reset_stats()


def run_workload(
    engine: Engine,
    workload: Workload,
    base: SamplingParams,
    label: str,
    on_finish: Callable[[RequestOutput], None] | None = None,
    on_step: Callable[[Engine], None] | None = None,  # after every step (progress that needs no finished request)
) -> tuple[RunRecord, list[RequestOutput]]:
    prompts = prepare_prompts(engine, workload)
    params = workload.params(base)
    results: dict[str, RequestOutput] = {}
    order: list[str] = []
    utilisation: list[float] = []
    saved = 0  # blocks that sharing saved, at the step where it saved most
    started = time.perf_counter()
    for prompt, p in zip(prompts, params):
        order.append(engine.add_request(prompt, p))
    while engine.has_unfinished():
        for out in engine.step():
            results[out.request_id] = out
            if on_finish is not None:
                on_finish(out)
        if on_step is not None:
            on_step(engine)
        usage = engine.kv_usage()
        saved = max(saved, usage.num_saved_blocks)
        if usage.num_reserved_slots:
            utilisation.append(usage.num_filled_slots / usage.num_reserved_slots)
    wall = time.perf_counter() - started
    outputs = [results[rid] for rid in order]
    ttft = [o.metrics.get("ttft_s", 0.0) for o in outputs]
    tpot = []
    reasons: dict[str, int] = {}
    for o in outputs:
        n = sum(len(c.token_ids) for c in o.outputs)
        for c in o.outputs:
            reasons[c.finish_reason or "none"] = reasons.get(c.finish_reason or "none", 0) + 1
        if n > 1 and "latency_s" in o.metrics:
            tpot.append((o.metrics["latency_s"] - o.metrics.get("ttft_s", 0.0)) / (n - 1))
    stats = engine.stats()
    record = RunRecord(
        label=label,
        config=dict(engine.parts.describe),
        num_requests=len(outputs),
        prompt_tokens=sum(len(o.prompt_token_ids) * len(o.outputs) for o in outputs),
        output_tokens=sum(len(c.token_ids) for o in outputs for c in o.outputs),
        wall_s=wall,
        ttft_p50_s=_percentile(ttft, 50),
        ttft_p99_s=_percentile(ttft, 99),
        tpot_p50_s=_percentile(tpot, 50),
        tpot_p99_s=_percentile(tpot, 99),
        kv_utilisation=statistics.fmean(utilisation) if utilisation else 0.0,
        preemptions=int(stats.get("preemptions", 0)),
        steps=int(stats.get("steps", 0)),
        finish_reasons=reasons,
        decoding=engine.decoder_stats(),
        prefix_hit_rate=engine.kv_usage().prefix_hit_rate,
        preemptions_swap=int(stats.get("preemptions_swap", 0)),
        preemptions_recompute=int(stats.get("preemptions_recompute", 0)),
        blocks_saved_by_sharing=saved,
    )
    return record, outputs


def format_table(records: list[RunRecord]) -> str:
    headers = [
        "run",
        "req/s",
        "out tok/s",
        "total tok/s",
        "prompt tok",
        "total tok",
        "time s",
        "TTFT p50 ms",
        "TPOT p50 ms",
        "KV util",
        "prefix hit",
        "preempt swap/recomp",
        "shared blk",
        "speedup",
    ]
    rows = []
    for r in records:
        rows.append(
            [
                r.label,
                f"{r.requests_per_s:.2f}",
                f"{r.output_tokens_per_s:.1f}",
                f"{r.total_tokens_per_s:.1f}",
                str(r.prompt_tokens),
                str(r.total_tokens),
                f"{r.wall_s:.2f}",
                f"{r.ttft_p50_s * 1e3:.1f}",
                f"{r.tpot_p50_s * 1e3:.1f}",
                f"{r.kv_utilisation:.1%}",
                f"{r.prefix_hit_rate:.1%}",
                f"{r.preemptions} ({r.preemptions_swap}/{r.preemptions_recompute})",
                str(r.blocks_saved_by_sharing),
                "—" if r.speedup is None else f"{r.speedup:.2f}x",
            ]
        )
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(headers)]
    line = lambda cells: "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))  # noqa: E731
    return "\n".join([line(headers), line(["-" * w for w in widths]), *(line(r) for r in rows)])
