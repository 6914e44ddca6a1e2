"""An example infer plugin: the `temperature-only` sampler and the `infer example-hello` command.

`temperature-only` samples from softmax(logits / T) and ignores every other knob (greedy at
T = 0). It is deliberately small: a plugin implements the `Sampler` interface, declares its
capabilities (and, for the conformance kit, the `SamplingParams` it honours), and registers
itself; nothing in infer changes. `pytest --infer-kit sampler=temperature-only` checks it. The
package's other strategies, one for every other slot, are in modules of their own, each under an
entry point of its own (pyproject.toml): `attention.py`, `kv_allocator.py`, `scheduler.py`,
`decoder.py`, `detokenizer.py`, `arcee.py` (the model), `layers.py`, `logits_processor.py` and
`reasoning_parser.py`.
"""

from __future__ import annotations

import click
import torch

import infer
from infer.api import SamplerOutput

INFER_PLUGIN_API = ">=1,<3"  # the infer plugin API versions this plugin works with (2 changed only allocators)


class TemperatureOnlySampler:
    capabilities = infer.Capabilities(devices=frozenset({"cpu", "cuda"}))
    supported_params = frozenset({"temperature", "seed"})  # what `pytest --infer-kit sampler=...` tests

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size

    def sample(self, logits: torch.Tensor, requests, positions=None) -> SamplerOutput:
        # logits: [B, V]; row i draws from its own stream, seeded by (request seed, position)
        if positions is None:
            positions = [len(r.output_token_ids) for r in requests]
        tokens = []
        for row, request, position in zip(logits, requests, positions):
            temperature = request.params.temperature
            if temperature == 0:
                tokens.append(int(row.argmax()))
                continue
            gen = torch.Generator(device=row.device).manual_seed(hash((request.seed, position)) & (2**63 - 1))
            probs = torch.softmax(row.float() / temperature, dim=-1)
            tokens.append(int(torch.multinomial(probs, 1, generator=gen)))
        return SamplerOutput(tokens)


@infer.hookimpl
def infer_register_samplers(register) -> None:
    register("temperature-only", TemperatureOnlySampler)


@infer.hookimpl
def infer_register_commands(cli) -> None:
    @cli.command("example-hello")
    def hello() -> None:
        """Say hello from the example plugin."""
        click.echo("hello from infer-example-plugin")
