"""The per-request loop that the vectorized sampler replaces, kept as a baseline.

Same math, one row at a time, with a `torch.Generator` per row seeded from (seed, position) and
`torch.multinomial`. Greedy tokens and logprobs equal the vectorized sampler's; sampled tokens
follow the same distribution from a different random stream.
"""

from __future__ import annotations

import math

import torch

from infer.api import RegisterFn, SamplerOutput
from infer.api.hookspecs import hookimpl
from infer.api.request import Request, SamplingParams
from infer.kernels.rng import generator_seed, row_positions


class NaiveSampler:
    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = torch.device(device)

    def sample(
        self,
        logits: torch.Tensor,  # [B, V] float32
        requests: list[Request],
        positions: list[int] | None = None,
    ) -> SamplerOutput:
        positions = row_positions(logits, requests, positions)
        tokens: list[int] = []
        logprobs: list[dict[int, float]] = []
        for row, request, position in zip(logits, requests, positions):
            row = penalise(row, request)  # [V]
            token = choose_token(row, request.params, request.seed, position)
            tokens.append(token)
            logprobs.append(logprob_dict(row, token, request.params.logprobs))
        asked = any(r.params.logprobs is not None for r in requests)
        return SamplerOutput(token_ids=tokens, logprobs=logprobs if asked else None)

    def probs(self, logits: torch.Tensor, requests: list[Request], positions: list[int] | None = None) -> torch.Tensor:
        # logits: [B, V] float32 -> [B, V]: the distribution `sample` draws each row from
        rows = []
        for row, request in zip(logits, requests):
            row = penalise(row, request)
            if request.params.is_greedy:
                rows.append(torch.zeros_like(row).index_fill_(0, row.argmax(), 1.0))
            else:
                rows.append(processed(row, request.params).softmax(dim=-1))
        return torch.stack(rows)

    def logprobs(self, logits: torch.Tensor, requests: list[Request], token_ids: list[int]) -> list[dict[int, float]]:
        # logits: [B, V] float32; what `sample` reports in row i had it chosen token_ids[i]
        return [
            logprob_dict(penalise(row, r), t, r.params.logprobs) if r.params.logprobs is not None else {}
            for row, r, t in zip(logits, requests, token_ids)
        ]


def penalise(row: torch.Tensor, request: Request) -> torch.Tensor:
    # row: [V] -> [V], a new tensor when any penalty applies
    p = request.params
    if p.repetition_penalty != 1.0 and request.num_tokens:
        ids = torch.tensor(sorted(set(request.all_token_ids)), device=row.device)
        seen = row[ids]
        row = row.index_put((ids,), torch.where(seen > 0, seen / p.repetition_penalty, seen * p.repetition_penalty))
    if (p.presence_penalty or p.frequency_penalty) and request.output_token_ids:
        output = torch.tensor(request.output_token_ids, device=row.device)
        counts = torch.bincount(output, minlength=row.numel()).to(row.dtype)
        row = row - p.frequency_penalty * counts - p.presence_penalty * (counts > 0)
    return row


def choose_token(row: torch.Tensor, params: SamplingParams, seed: int, position: int) -> int:
    if params.is_greedy:
        return int(row.argmax())
    scaled = processed(row, params)
    generator = torch.Generator(device=row.device).manual_seed(generator_seed(seed, position))
    return int(torch.multinomial(scaled.softmax(dim=-1), 1, generator=generator))


def processed(row: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    # row: [V] penalised logits -> [V] logits whose softmax the row samples from
    scaled = row / params.temperature
    if params.min_p > 0.0:
        scaled = scaled.masked_fill(scaled < scaled.max() + math.log(params.min_p), float("-inf"))
    if params.top_k > 0 or params.top_p < 1.0:
        values, order = scaled.sort(descending=True)
        if params.top_k > 0:
            values[params.top_k :] = float("-inf")
        if params.top_p < 1.0:
            mass = values.softmax(dim=-1).cumsum(dim=-1)  # mass[j]: tokens ranked 0..j
            values[1:] = values[1:].masked_fill(mass[:-1] >= params.top_p, float("-inf"))
        scaled = torch.empty_like(scaled).scatter_(0, order, values)
    return scaled


def logprob_dict(row: torch.Tensor, token: int, k: int | None) -> dict[int, float]:
    # row: [V] penalised logits, before temperature and filters
    if k is None:
        return {}
    logprobs = row.log_softmax(dim=-1)
    top = logprobs.topk(min(k, row.numel()))
    out = {int(t): float(lp) for t, lp in zip(top.indices.tolist(), top.values.tolist())}
    out[token] = float(logprobs[token])
    return out


@hookimpl
def infer_register_samplers(register: RegisterFn) -> None:
    register("naive", NaiveSampler)
