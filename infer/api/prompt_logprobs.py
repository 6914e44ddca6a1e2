"""Prompt logprobs (vLLM's `SamplingParams.prompt_logprobs`): prompt token p + 1's logprob given the
tokens before it, scored from row p of the forward that prefills the prompt, chunk by chunk.

A chunk [start, start + n) of a request that asks for them needs logits at its positions p < P - 1
(P: prompt length) not scored yet: `ForwardSeq.prompt_rows`, the rows just before the `logits_rows`
the decoder samples from. Those always follow them without a gap: a request samples only once its
last prefill chunk (the one that scores position P - 2) has run. Scores are the float32 log-softmax
of the raw logits (the sampler's, before penalties and temperature); a preempted request computes
its prompt again, and `prompt_rows` leaves out the positions it scored before.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

ROWS_AT_ONCE = 256  # rows log-softmaxed at once: a long prompt's scores take [256, V] more memory, not [P, V]

if TYPE_CHECKING:
    from infer.api.request import Request
    from infer.api.runner import ForwardSeq


def prompt_rows(request: Request, start: int, num_tokens: int) -> int:
    """Rows of the chunk [start, start + num_tokens) of `request` that score prompt tokens not scored yet."""
    if request.params.prompt_logprobs is None or request.fork_parent is not None:
        # a parallel sample shares its first request's prompt, whose scores the output reports: it scores none
        # (computed again after a preemption, its chunk may run past the prompt, where no rows follow them)
        return 0
    first = max(start, len(request.prompt_logprobs))  # positions before it are scored
    end = min(start + num_tokens, request.num_prompt_tokens - 1)  # position P - 1 scores the first output
    return max(0, end - first)


def take_prompt_logprobs(logits: torch.Tensor, seqs: list[ForwardSeq]) -> torch.Tensor:
    """Score every seq's `prompt_rows` into its request's `prompt_logprobs`; returns the other rows.

    logits: [sum(prompt_rows + logits_rows), V] float32, in the order of `seqs` -> [sum(logits_rows), V]."""
    if not any(s.prompt_rows for s in seqs):
        return logits
    keep: list[int] = []
    scored: list[int] = []
    owners: list[tuple[Request, int, int]] = []  # (request, first position, rows)
    at = 0
    for s in seqs:
        first = s.start + len(s.token_ids) - s.logits_rows - s.prompt_rows
        if s.prompt_rows:
            owners.append((s.request, first, s.prompt_rows))
            scored.extend(range(at, at + s.prompt_rows))
        keep.extend(range(at + s.prompt_rows, at + s.prompt_rows + s.logits_rows))
        at += s.prompt_rows + s.logits_rows
    device = logits.device
    targets = [r.prompt_token_ids[p + 1] for r, first, n in owners for p in range(first, first + n)]
    k = min(max(r.params.prompt_logprobs or 0 for r, _, _ in owners), logits.shape[1])
    tables = []
    for rows, tokens in zip(
        torch.tensor(scored, device=device).split(ROWS_AT_ONCE),
        torch.tensor(targets, device=device).split(ROWS_AT_ONCE),
    ):
        logprobs = logits[rows].log_softmax(dim=-1)  # [S, V]
        chosen = logprobs.gather(1, tokens[:, None])  # [S, 1]
        top = logprobs.topk(k, dim=-1)  # [S, k] each
        tables.append(torch.cat([chosen.double(), top.indices.double(), top.values.double()], dim=1))
    table = torch.cat(tables).tolist()  # the one device-to-host copy
    row = 0
    for request, first, n in owners:
        want = request.params.prompt_logprobs or 0
        for p in range(first, first + n):
            assert p == len(request.prompt_logprobs), "prompt rows score each position once, in order"
            values = table[row]
            row += 1
            scores = {int(t): lp for t, lp in zip(values[1 : 1 + want], values[1 + k : 1 + k + want])}
            scores[request.prompt_token_ids[p + 1]] = values[0]
            request.prompt_logprobs.append(scores)
    return logits[torch.tensor(keep, device=device)] if keep else logits.new_empty(0, logits.shape[1])
