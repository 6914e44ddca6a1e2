"""`early-exit`: every token runs only the first N decoder layers, then the final norm and LM head.

LOSSY: it changes the outputs (on SmolLM2-135M the top-1 token at layer 20 of 30 agrees with the
full model's on about one position in five). It is here as a speed/quality trade-off to measure;
the lossless use of the same cut is `--decoding speculative --draft self --exit-layer N`.
With N equal to the model's depth it is `autoregressive`. The KV cache holds only the N layers
that run, so more blocks fit in the same budget.
"""

from __future__ import annotations

from infer.api import Capabilities, DecoderContext, SchedulerOutput, StepResult
from infer.api.errors import ConfigError
from infer.api.hookspecs import hookimpl


class EarlyExitDecoder:
    capabilities = Capabilities(cuda_graph_safe=True, pipeline_safe=True, lossy=True, uses_exit_layer=True)
    num_lookahead_tokens = 0

    def __init__(self, ctx: DecoderContext) -> None:
        exit_layer = ctx.config.exit_layer
        if exit_layer is None:
            raise ConfigError("--decoding early-exit needs --exit-layer N: the number of decoder layers to keep")
        self.runner = ctx.runner
        self.runner.num_layers = exit_layer  # read by the builder too: it sizes the KV cache for these layers
        total = ctx.model_config.num_layers if ctx.model_config is not None else exit_layer
        self.describe = {"lossy": f"early exit keeps {exit_layer}/{total} layers"}

    def execute(self, out: SchedulerOutput) -> StepResult:
        return self.runner.execute(out)


@hookimpl
def infer_register_decoders(register) -> None:
    register("early-exit", EarlyExitDecoder)
