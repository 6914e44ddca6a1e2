"""Proposers for speculative decoding: a draft model (its own or the target's first layers) and n-grams.

A proposer gets, per scheduled request, how many tokens it may propose (0: none, just keep up)
and returns the proposed tokens, plus the draft's distributions for sampled requests.

The draft model's KV cache is indexed by the target's block tables, so the scheduler's blocks
(lookahead included) serve both models. Its validity is tracked per request: `cached[id]` is the
number of tokens whose draft K/V are valid, clamped every step by the target's own count: that
rolls back the draft's K/V of rejected tokens with the target's, and a request preempted by
recompute starts again from 0. Copy-on-write and swap move the draft's blocks with the target's
(the builder registers every model's cache with the block mover), so nothing else is lost.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from infer.core.request import Request
from infer.core.runner import ForwardSeq, ModelRunner
from infer.plugins.decoders import rejection


@dataclass(slots=True)
class DraftRow:
    request: Request
    num_new_tokens: int  # tokens the target computes for it this step, before the draft's
    max_draft: int  # tokens it may propose (0: none; then the request may still be mid-prefill)


@dataclass(slots=True)
class Proposal:
    token_ids: list[list[int]]  # row i -> proposed tokens, at most rows[i].max_draft
    probs: list[torch.Tensor | None]  # row i -> [len(token_ids[i]), V] q, for sampled rows of a model draft


class Proposer(Protocol):
    def propose(self, rows: list[DraftRow]) -> Proposal:
        """Called once per step, before the target's forward; may run a draft model."""
        ...


class DraftView:
    """A request as if `extra` draft tokens had been accepted: what samplers read for penalties."""

    __slots__ = ("request", "extra", "output_token_ids")

    def __init__(self, request: Request, extra: list[int]) -> None:
        self.request, self.extra = request, extra
        self.output_token_ids = request.output_token_ids + extra

    params = property(lambda self: self.request.params)
    seed = property(lambda self: self.request.seed)
    request_id = property(lambda self: self.request.request_id)
    prompt_token_ids = property(lambda self: self.request.prompt_token_ids)
    all_token_ids = property(lambda self: self.request.prompt_token_ids + self.output_token_ids)
    num_tokens = property(lambda self: self.request.num_tokens + len(self.extra))


def has_penalties(request: Request) -> bool:
    p = request.params
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


def view(request: Request, extra: list[int]) -> Request | DraftView:
    return DraftView(request, list(extra)) if extra and has_penalties(request) else request


class NgramProposer:
    """Prompt lookup: the latest earlier occurrence of the sequence's last n tokens (n = 3, 2, 1)
    predicts the k tokens that followed it. Proposals are deterministic (q is one-hot)."""

    def __init__(self, max_n: int = 3, min_n: int = 1) -> None:
        self.max_n, self.min_n = max_n, min_n

    def propose(self, rows: list[DraftRow]) -> Proposal:
        tokens = [self.lookup(r.request.all_token_ids, r.max_draft) if r.max_draft else [] for r in rows]
        return Proposal(tokens, [None] * len(rows))

    def lookup(self, ids: list[int], k: int) -> list[int]:
        seq = np.asarray(ids, dtype=np.int64)
        for n in range(self.max_n, self.min_n - 1, -1):
            if len(seq) <= n:
                continue
            windows = np.lib.stride_tricks.sliding_window_view(seq[:-1], n)  # [L - n, n]: starts < L - n
            hits = np.flatnonzero((windows == seq[-n:]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return seq[start : start + k].tolist()
        return []


class ModelProposer:
    """A draft model run autoregressively for k steps, batched over requests.

    `shares_target_kv`: the draft is the target's first layers over the target's own cache
    (self-draft): whatever the target has computed is valid for the draft too, and the target's
    verify pass rewrites every slot the draft wrote.
    """

    def __init__(self, runner: ModelRunner, shares_target_kv: bool = False) -> None:
        self.runner = runner
        self.shares_target_kv = shares_target_kv
        self.cached: dict[str, tuple[Request, int]] = {}  # request id -> (request, draft tokens cached)

    def _num_cached(self, r: Request) -> int:
        if self.shares_target_kv:
            return r.num_computed_tokens
        entry = self.cached.get(r.request_id)
        return 0 if entry is None or entry[0] is not r else min(entry[1], r.num_computed_tokens)

    def propose(self, rows: list[DraftRow]) -> Proposal:
        self.cached = {k: v for k, v in self.cached.items() if not v[0].is_finished}
        tokens: list[list[int]] = [[] for _ in rows]
        probs: list[list[torch.Tensor]] = [[] for _ in rows]
        # round 0: catch up (prefill chunks, tokens accepted last step) and propose the first token
        seqs, owners = [], []
        for i, row in enumerate(rows):
            r = row.request
            start = self._num_cached(r)
            end = r.num_computed_tokens + row.num_new_tokens
            if start >= end or (self.shares_target_kv and not row.max_draft):
                continue
            seqs.append(ForwardSeq(r, r.all_token_ids[start:end], start, 1 if row.max_draft else 0))
            owners.append(i)
            if not self.shares_target_kv:
                self.cached[r.request_id] = (r, end)
        if not seqs:
            return Proposal(tokens, [None] * len(rows))
        order = sorted(range(len(seqs)), key=lambda j: len(seqs[j].token_ids) != 1)  # decodes first
        active = [owners[j] for j in order if seqs[j].logits_rows]
        logits = self.runner.forward([seqs[j] for j in order])
        for step in range(max((rows[i].max_draft for i in active), default=0)):
            if step:
                seqs = [
                    ForwardSeq(rows[i].request, tokens[i][-1:], rows[i].request.num_tokens + step - 1, 1)
                    for i in active
                ]
                logits = self.runner.forward(seqs)
            self._choose(
                logits, [rows[i].request for i in active], [tokens[i] for i in active], [probs[i] for i in active]
            )
            if not self.shares_target_kv:
                for i in active:  # K/V written up to the newest input token
                    r = rows[i].request
                    self.cached[r.request_id] = (r, r.num_tokens + step)
            active = [i for i in active if len(tokens[i]) < rows[i].max_draft]
            if not active:
                break
        out_probs = [
            torch.stack(p) if p and not rows[i].request.params.is_greedy else None for i, p in enumerate(probs)
        ]
        return Proposal(tokens, out_probs)

    def _choose(
        self, logits: torch.Tensor, requests: list[Request], tokens: list[list[int]], probs: list[list[torch.Tensor]]
    ) -> None:
        # logits: [A, V], row a proposes token len(tokens[a]) of requests[a]; appends to tokens, probs
        views = [view(r, t) for r, t in zip(requests, tokens)]
        positions = [len(r.output_token_ids) + len(t) for r, t in zip(requests, tokens)]
        q = self.runner.sampler.probs(logits, views, positions)  # [A, V]
        chosen = q.argmax(dim=-1)  # greedy rows: q is one-hot
        sampled = [a for a, r in enumerate(requests) if not r.params.is_greedy]
        if sampled:
            index = torch.tensor(sampled, device=q.device)
            seeds = rejection.seed_tensor(
                [rejection.salted(requests[a].seed, rejection.DRAFT_SALT) for a in sampled], q.device
            )
            pos = torch.tensor([positions[a] for a in sampled], dtype=torch.int64, device=q.device)
            chosen[index] = rejection.draw(q[index], seeds, pos)
        for a, t in enumerate(chosen.tolist()):
            tokens[a].append(t)
            if not requests[a].params.is_greedy:
                probs[a].append(q[a])
