"""All rows in one batched pass on the logits' device, one device-to-host copy per step.

Per-step parameters are gathered from the request list with list comprehensions into small host
tensors (one host-to-device copy each); that is gathering, not per-request compute. Every choice
of which stage to run, and on which rows, is made on those host lists, so nothing waits on the
device before the final `.tolist()`. Stages write into one working copy of the logits, and the
costly ones (sort, noise) run only on the rows that need them: large temporaries cost more than
the arithmetic, on a CPU above all.
"""

from __future__ import annotations

import importlib.util
import math
from itertools import chain

import torch

from infer.api import Capabilities, RegisterFn, SamplerOutput
from infer.api.hookspecs import hookimpl
from infer.api.request import Request, SamplingParams
from infer.api.transfer import row_index, to_device
from infer.kernels import rng

NEG_INF = float("-inf")
_HAS_TRITON = importlib.util.find_spec("triton") is not None


class VectorizedSampler:
    capabilities = Capabilities(priority=1)

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = torch.device(device)

    def sample(
        self,
        logits: torch.Tensor,  # [B, V] float32
        requests: list[Request],
        positions: list[int] | None = None,
    ) -> SamplerOutput:
        positions = rng.row_positions(logits, requests, positions)
        work = _working_copy(logits, requests)  # [B, V]: the stages write into it
        apply_penalties_(work, requests)
        num_logprobs = [r.params.logprobs for r in requests]
        asked = [i for i, k in enumerate(num_logprobs) if k is not None]
        logprobs = work[row_index(asked, len(requests), work.device)].log_softmax(dim=-1) if asked else None
        tokens = choose_tokens_(work, requests, positions)
        if logprobs is None:
            return SamplerOutput(token_ids=tokens.tolist())
        return _with_logprobs(tokens, logprobs, asked, num_logprobs)

    def sample_tokens(
        self,
        logits: torch.Tensor,  # [B, V] float32
        requests: list[Request],
        positions: list[int] | None = None,
    ) -> torch.Tensor | None:
        """The token ids `sample` would return, as a [B] int64 tensor on the logits' device, queued
        without waiting for the device (decode pipelining); None when the batch asks for logprobs."""
        if any(r.params.logprobs is not None for r in requests):
            return None
        positions = rng.row_positions(logits, requests, positions)
        work = _working_copy(logits, requests)
        apply_penalties_(work, requests)
        return choose_tokens_(work, requests, positions)

    def probs(
        self,
        logits: torch.Tensor,  # [B, V] float32
        requests: list[Request],
        positions: list[int] | None = None,
    ) -> torch.Tensor:
        """The distribution `sample` draws row i from: [B, V] float32 (one-hot at the argmax for greedy rows)."""
        assert logits.dim() == 2 and logits.shape[0] == len(requests)
        work = logits.clone(memory_format=torch.contiguous_format)
        apply_penalties_(work, requests)
        greedy = [i for i, r in enumerate(requests) if r.params.temperature == 0.0]
        sampled = [i for i, r in enumerate(requests) if r.params.temperature != 0.0]
        if sampled:
            index = row_index(sampled, len(requests), work.device)
            p = process_rows_(work[index], [requests[i].params for i in sampled]).softmax(dim=-1)
            if not greedy:
                return p
            work[index] = p
        # one-hot rows built on the device: assigning a Python scalar through an index copies it
        # from pageable memory, which waits for every kernel queued before (the verify forward)
        rows = row_index(greedy, len(requests), work.device)
        top = work[rows].argmax(dim=-1, keepdim=True)  # [G, 1]
        one_hot = torch.zeros(top.shape[0], work.shape[1], dtype=work.dtype, device=work.device).scatter_(1, top, 1.0)
        if isinstance(rows, slice):
            return one_hot
        return work.index_copy_(0, rows, one_hot)

    def logprobs(self, logits: torch.Tensor, requests: list[Request], token_ids: list[int]) -> list[dict[int, float]]:
        """What `sample` reports in row i had it chosen `token_ids[i]`; {} for rows that did not ask."""
        # logits: [B, V] float32
        work = logits.clone(memory_format=torch.contiguous_format)
        apply_penalties_(work, requests)
        num_logprobs = [r.params.logprobs for r in requests]
        asked = [i for i, k in enumerate(num_logprobs) if k is not None]
        if not asked:
            return [{} for _ in requests]
        logprobs = work[row_index(asked, len(requests), work.device)].log_softmax(dim=-1)
        tokens = to_device(token_ids, torch.int64, work.device)
        return _with_logprobs(tokens, logprobs, asked, num_logprobs).logprobs or []


def _working_copy(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """A contiguous copy of the logits for the stages to write into; the logits themselves where no
    stage will (greedy rows without penalties only read them) and they are contiguous (a tensor-parallel
    vocabulary's gathered columns may be a slice)."""
    if logits.is_contiguous() and all(r.params.temperature == 0.0 and not _penalised(r.params) for r in requests):
        return logits
    return logits.clone(memory_format=torch.contiguous_format)


def _penalised(params: SamplingParams) -> bool:
    return params.repetition_penalty != 1.0 or params.presence_penalty != 0.0 or params.frequency_penalty != 0.0


def argmax_rows(work: torch.Tensor) -> torch.Tensor:
    """[B, V] -> [B] int64, `work.argmax(dim=-1)`: on a GPU with Triton in `infer.kernels.argmax`'s two
    small kernels (torch's reduction takes one block for a row: ~27 us at one row of 128,256 logits)."""
    if work.is_cuda and _HAS_TRITON:
        from infer.kernels import argmax

        if argmax.takes(work):
            return argmax.argmax_rows(work)
    return work.argmax(dim=-1)


def _column(values: list[float], device: torch.device) -> torch.Tensor:
    # -> [N, 1] float32
    return to_device(values, torch.float32, device)[:, None]


def _entries(token_lists: list[list[int]], vocab: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    # -> flat index row * V + token, and row: [N] each, over every listed token in row order
    tokens = to_device(list(chain.from_iterable(token_lists)), torch.int64, device)
    lengths = to_device([len(t) for t in token_lists], torch.int64, device)
    rows = torch.repeat_interleave(torch.arange(len(token_lists), device=device), lengths, output_size=tokens.numel())
    return rows * vocab + tokens, rows


def _occurrences(flat: torch.Tensor) -> torch.Tensor:
    # flat: [N] -> [N], how often each entry's value occurs in flat (sort + searchsorted: no sync)
    ordered = flat.sort().values
    return torch.searchsorted(ordered, flat, right=True) - torch.searchsorted(ordered, flat)


def apply_penalties_(work: torch.Tensor, requests: list[Request]) -> None:
    # work: [B, V], changed in place at the (row, token) entries of the requests' token lists;
    # a token listed twice in a row reads and writes the same value, so duplicates are harmless
    params = [r.params for r in requests]
    flat_work = work.view(-1)
    vocab = work.shape[1]
    if any(p.repetition_penalty != 1.0 for p in params):
        seen = [r.all_token_ids if r.params.repetition_penalty != 1.0 else [] for r in requests]
        flat, rows = _entries(seen, vocab, work.device)
        penalty = _column([p.repetition_penalty for p in params], work.device)[rows, 0]  # [N]
        x = flat_work[flat]
        flat_work[flat] = torch.where(x > 0, x / penalty, x * penalty)
    if any(p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 for p in params):
        on = [p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 for p in params]
        flat, rows = _entries([r.output_token_ids if o else [] for r, o in zip(requests, on)], vocab, work.device)
        count = _occurrences(flat).to(work.dtype)  # [N], at least 1
        frequency = _column([p.frequency_penalty for p in params], work.device)[rows, 0]
        presence = _column([p.presence_penalty for p in params], work.device)[rows, 0]
        flat_work[flat] = flat_work[flat] - frequency * count - presence


def choose_tokens_(work: torch.Tensor, requests: list[Request], positions: list[int]) -> torch.Tensor:
    # work: [B, V] penalised, overwritten -> [B] int64; greedy rows take the argmax, the others
    # are sampled from their rows of work (a copy of them when some rows are greedy)
    greedy = [r.params.temperature == 0.0 for r in requests]
    if all(greedy):
        return argmax_rows(work)
    sampled = [i for i, g in enumerate(greedy) if not g]
    index = row_index(sampled, len(requests), work.device)
    tokens = argmax_rows(work) if any(greedy) else None
    x = work[index]  # [S, V]
    draws = sample_rows_(x, [requests[i] for i in sampled], [positions[i] for i in sampled])
    if tokens is None:
        return draws
    return tokens.index_copy_(0, index, draws)


def sample_rows_(x: torch.Tensor, requests: list[Request], positions: list[int]) -> torch.Tensor:
    # x: [S, V] penalised logits of rows that sample, overwritten -> [S] int64
    device = x.device
    process_rows_(x, [r.params for r in requests])
    seeds = to_device([rng.split_seed(r.seed) for r in requests], torch.int64, device)  # [S, 2]
    key, mult = rng.row_keys(seeds, to_device(positions, torch.int64, device))
    noise = rng.exponential(key, mult, torch.arange(x.shape[1], device=device))  # [S, V] float64
    # exponential race: argmax(p / E) with E ~ Exp(1) draws from p; softmax's normaliser is
    # shared by the row, so exp(x - max) stands in for p
    return x.sub_(x.amax(dim=-1, keepdim=True)).exp_().div_(noise).argmax(dim=-1)


def process_rows_(x: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    # x: [S, V] penalised logits of rows that sample -> the same tensor, changed in place:
    # temperature, min-p, top-k, top-p; its softmax is the distribution the row samples from
    device = x.device
    x.div_(_column([p.temperature for p in params], device))
    if any(p.min_p > 0.0 for p in params):
        min_p = _column([p.min_p for p in params], device)
        x.masked_fill_(x < x.amax(dim=-1, keepdim=True) + min_p.log(), NEG_INF)  # p < min_p * p_max
    rows = [i for i, p in enumerate(params) if p.top_k > 0 or p.top_p < 1.0]
    if len(rows) == len(params):
        top_k_top_p_(x, params)
    elif rows:
        index = row_index(rows, len(params), device)
        x[index] = top_k_top_p_(x[index], [params[i] for i in rows])
    return x


def top_k_top_p_(x: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    # x: [R, V], dropped tokens set to -inf in place. vLLM's order: min-p has already run;
    # top-k, then top-p over the mass that top-k kept. One descending sort serves both.
    vocab = x.shape[1]
    values, order = x.sort(dim=-1, descending=True)  # [R, V]
    if any(p.top_k > 0 for p in params):
        top_k = to_device([p.top_k or vocab for p in params], torch.int64, x.device)[:, None]
        values.masked_fill_(torch.arange(vocab, device=x.device)[None, :] >= top_k, NEG_INF)
    if any(p.top_p < 1.0 for p in params):
        top_p = _column([p.top_p if p.top_p < 1.0 else math.inf for p in params], x.device)  # inf: off
        mass = values.softmax(dim=-1).cumsum_(dim=-1)  # mass[:, j]: tokens ranked 0..j
        values[:, 1:].masked_fill_(mass[:, :-1] >= top_p, NEG_INF)  # mass ranked ahead >= top_p
    return x.scatter_(1, order, values)


def _with_logprobs(
    tokens: torch.Tensor,  # [B] int64
    logprobs: torch.Tensor,  # [A, V]: log_softmax of the penalised logits of the rows that asked
    asked: list[int],
    num_logprobs: list[int | None],
) -> SamplerOutput:
    k = min(max(num_logprobs[i] or 0 for i in asked), logprobs.shape[1])
    chosen = logprobs.gather(1, tokens[row_index(asked, tokens.shape[0], tokens.device)][:, None])  # [A, 1]
    top = logprobs.topk(k, dim=-1)  # [A, k] each
    table = torch.cat([chosen.double(), top.indices.double(), top.values.double()], dim=1)  # [A, 1 + 2k]
    flat = torch.cat([tokens.double(), table.flatten()]).tolist()  # the step's one device-to-host copy
    ids = [int(t) for t in flat[: len(num_logprobs)]]
    out: list[dict[int, float]] = [{} for _ in ids]
    width, start = 1 + 2 * k, len(ids)
    for j, i in enumerate(asked):
        row = flat[start + j * width : start + (j + 1) * width]  # chosen, k ids, k logprobs
        n = min(num_logprobs[i] or 0, k)
        out[i] = {int(t): lp for t, lp in zip(row[1 : 1 + n], row[1 + k : 1 + k + n])}
        out[i][ids[i]] = row[0]
    return SamplerOutput(token_ids=ids, logprobs=out)


@hookimpl
def infer_register_samplers(register: RegisterFn) -> None:
    register("vectorized", VectorizedSampler)
