"""`example-split`: one token per request per step, but decodes and prefill chunks never share a forward.

A step the scheduler mixes (running requests' next tokens beside new prompts) runs as two forwards
through the target's runner: the decodes, then the prompts. Lossless: every token is the one the
model computes for it, only the grouping into forwards changes. It reports how many forwards it ran
(`StepResult.stats`, summed by the engine) and, over a run, how many steps it split
(`StatsSummary`), and names itself in the run's description (`SelfDescribing`).
`pytest --infer-kit decoding=example-split` checks it against `autoregressive`.
"""

from __future__ import annotations

import infer
from infer.api import DecoderContext, SchedulerOutput, StepResult

INFER_PLUGIN_API = ">=2,<3"


class SplitDecoder:
    capabilities = infer.Capabilities()  # no CUDA graphs, no decode pipelining claimed
    num_lookahead_tokens = 0  # no speculative slots
    describe = {"split": "decodes and prefill chunks in separate forwards"}

    def __init__(self, ctx: DecoderContext) -> None:
        self.runner = ctx.runner

    def execute(self, out: SchedulerOutput) -> StepResult:
        decodes = [s for s in out.scheduled if s.num_new_tokens == 1]
        prefills = [s for s in out.scheduled if s.num_new_tokens != 1]
        parts = [group for group in (decodes, prefills) if group]
        result = StepResult(sampled={}, stats={"forwards": float(len(parts)), "split_steps": float(len(parts) > 1)})
        for group in parts:
            step = self.runner.execute(SchedulerOutput(group))  # the engine made the step's block copies already
            result.sampled.update(step.sampled)
            result.logprobs.update(step.logprobs)
            result.num_computed.update(step.num_computed)
        return result

    def summarize(self, totals: dict[str, float]) -> dict[str, float]:
        steps_with_work = totals.get("forwards", 0.0) - totals.get("split_steps", 0.0)
        return {"split_fraction": totals.get("split_steps", 0.0) / steps_with_work if steps_with_work else 0.0}


@infer.hookimpl
def infer_register_decoders(register) -> None:
    register("example-split", SplitDecoder)
