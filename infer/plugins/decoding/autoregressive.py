"""`autoregressive`: one token per request per step, straight from the runner."""

from __future__ import annotations

from infer.api import Capabilities, DecoderContext, SchedulerOutput, StepResult
from infer.api.hookspecs import hookimpl


class AutoregressiveDecoder:
    capabilities = Capabilities(cuda_graph_safe=True, pipeline_safe=True)
    num_lookahead_tokens = 0

    def __init__(self, ctx: DecoderContext) -> None:
        self.runner = ctx.runner

    def execute(self, out: SchedulerOutput) -> StepResult:
        return self.runner.execute(out)


@hookimpl
def infer_register_decoders(register) -> None:
    register("autoregressive", AutoregressiveDecoder)
