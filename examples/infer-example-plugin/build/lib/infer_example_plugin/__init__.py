"""An example infer plugin: the `temperature-only` sampler and the `infer example-hello` command.

`temperature-only` samples from softmax(logits / T) and ignores every other knob (greedy at
T = 0). It is deliberately small: a plugin implements the `Sampler` interface, declares its
capabilities, and registers itself; nothing in infer changes.
"""

from __future__ import annotations

import click
import torch

import infer
from infer.core.interfaces import SamplerOutput


class TemperatureOnlySampler:
    capabilities = infer.Capabilities(devices=frozenset({"cpu", "cuda"}))

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size

    def sample(self, logits: torch.Tensor, requests, positions=None) -> SamplerOutput:
        # logits: [B, V]
        temps = torch.tensor([r.params.temperature for r in requests], device=logits.device)
        greedy = logits.argmax(-1)
        probs = torch.softmax(logits / temps.clamp(min=1e-5)[:, None], dim=-1)
        gen = torch.Generator(device=logits.device).manual_seed(requests[0].seed if requests else 0)
        sampled = torch.multinomial(probs, 1, generator=gen).squeeze(-1)
        return SamplerOutput(torch.where(temps == 0, greedy, sampled).tolist())


@infer.hookimpl
def infer_register_samplers(register) -> None:
    register("temperature-only", TemperatureOnlySampler)


@infer.hookimpl
def infer_register_commands(cli) -> None:
    @cli.command("example-hello")
    def hello() -> None:
        """Say hello from the example plugin."""
        click.echo("hello from infer-example-plugin")
