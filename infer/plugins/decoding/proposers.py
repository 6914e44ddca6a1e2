"""Proposers for speculative decoding: a draft model (its own or the target's first layers) and n-grams.

A proposer gets, per scheduled request, how many tokens it may propose (0: none, just keep up)
and returns the proposed tokens, plus the draft's distributions for sampled requests.

The draft model's KV cache is indexed by the target's block tables, so the scheduler's blocks
(lookahead included) serve both models. Its validity is tracked per request: `cached[id]` is the
number of tokens whose draft K/V are valid, clamped every step by the target's own count: that
rolls back the draft's K/V of rejected tokens with the target's, and a request preempted by
recompute starts again from 0. Copy-on-write and swap move the draft's blocks with the target's
(the builder registers every model's cache with the block mover), so nothing else is lost.

A draft model's proposal steps stay on the device: each step's chosen tokens feed the next step's
forward as a device tensor (a replay of the draft's CUDA graph where it has one), and the proposal
reaches the verify step the same way, so the host waits for the GPU once per engine step, not once
per draft token. Only a request with penalties needs its draft on the host while drafting (the
penalties count those tokens): its steps wait. A catch-up of at most `rows_upto` tokens (the draft
token and the bonus token after a fully accepted step) runs as decode rows, one per token, so it
replays graphs too; that needs an attention backend that writes a step's K/V before reading the
cache (`writes_kv_first`), the same promise the verify step's rows rely on.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from typing import Protocol

import torch

from infer.api.decoding import ForwardRunner
from infer.api.request import Request
from infer.api.runner import ForwardSeq
from infer.api.transfer import row_index, to_device
from infer.plugins.decoding import rejection

_WORD = array("i").itemsize  # bytes per token id in NgramProposer's search


@dataclass(slots=True)
class DraftRow:
    request: Request
    num_new_tokens: int  # tokens the target computes for it this step, before the draft's
    max_draft: int  # tokens it may propose (0: none; then the request may still be mid-prefill)


@dataclass(slots=True)
class Proposal:
    num_tokens: list[int]  # row i -> tokens proposed, at most rows[i].max_draft
    # row i's tokens: host lists (ngram), or [rows, K] int64 on the device with row i's in its first
    # num_tokens[i] columns (a draft model's, not waited for)
    token_ids: list[list[int]] | torch.Tensor
    probs: list[torch.Tensor | None]  # row i -> [num_tokens[i], V] q, for sampled rows of a model draft


class Proposer(Protocol):
    """Drafts tokens for the target to verify. `shares_target_kv`: the draft writes the target's own
    KV cache (a self-draft over the target's first layers)."""

    shares_target_kv: bool

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
    """Prompt lookup: the latest earlier occurrence of the sequence's last n tokens (n = 3, then 2)
    predicts the k tokens that followed it. Proposals are deterministic (q is one-hot).

    One token is not enough by default (min_n = 2): replayed over SmolLM2's greedy answers to the
    edit workload at K = 2-7, 5-11% of a one-token match's draft tokens were right (two tokens'
    35-48%, three tokens' 67-87%), while a verify step of 2-8 rows costs 1.2-1.7 plain steps on an
    H100 at batch 1, and a step that drafts nothing is a plain one, which decode pipelining overlaps
    with the step before."""

    shares_target_kv = False  # it runs no model

    def __init__(self, max_n: int = 3, min_n: int = 2) -> None:
        self.max_n, self.min_n = max_n, min_n

    def propose(self, rows: list[DraftRow]) -> Proposal:
        tokens = [self.lookup(r.request.all_token_ids, r.max_draft) if r.max_draft else [] for r in rows]
        return Proposal([len(t) for t in tokens], tokens, [None] * len(rows))

    def lookup(self, ids: list[int], k: int) -> list[int]:
        # the ids as 4-byte words, searched from the end by bytes.rfind (C speed, no per-step array ops:
        # at batch 1 the host's step is on the critical path); a hit between two words is skipped
        if len(ids) < 2:
            return []
        words = array("i", ids).tobytes()
        body = words[:-_WORD]  # an occurrence ends before the last token
        for n in range(min(self.max_n, len(ids) - 1), self.min_n - 1, -1):
            tail = words[-n * _WORD :]
            end = len(body)
            while (at := body.rfind(tail, 0, end)) >= 0:
                if at % _WORD == 0:
                    start = at // _WORD + n
                    return ids[start : start + k]
                end = at + len(tail) - 1  # the next occurrence starts before this one
        return []


class ModelProposer:
    """A draft model run autoregressively for k steps, batched over requests.

    `shares_target_kv`: the draft is the target's first layers over the target's own cache
    (self-draft): whatever the target has computed is valid for the draft too, and the target's
    verify pass rewrites every slot the draft wrote.
    """

    def __init__(self, runner: ForwardRunner, shares_target_kv: bool = False, rows_upto: int = 0) -> None:
        self.runner = runner
        self.shares_target_kv = shares_target_kv
        self.rows_upto = rows_upto  # catch-ups of at most this many tokens run one decode row per token
        self.cached: dict[str, tuple[Request, int]] = {}  # request id -> (request, draft tokens cached)

    def _num_cached(self, r: Request) -> int:
        if self.shares_target_kv:
            return r.num_computed_tokens
        entry = self.cached.get(r.request_id)
        return 0 if entry is None or entry[0] is not r else min(entry[1], r.num_computed_tokens)

    def propose(self, rows: list[DraftRow]) -> Proposal:
        self.cached = {k: v for k, v in self.cached.items() if not v[0].is_finished}
        num_tokens = [0] * len(rows)
        probs: list[list[torch.Tensor]] = [[] for _ in rows]
        logits, active = self._catch_up(rows)
        if logits is None:
            return Proposal(num_tokens, [[] for _ in rows], [None] * len(rows))
        width = max(rows[i].max_draft for i in active)
        tokens = torch.zeros(len(rows), width, dtype=torch.int64, device=logits.device)
        # the drafts so far on the host, only where penalties read them
        host = [[] for _ in rows] if any(has_penalties(rows[i].request) for i in active) else None
        ids = None  # [A] the tokens chosen at the step before, on the device
        for step in range(width):
            if step:
                seqs = [ForwardSeq(rows[i].request, [0], rows[i].request.num_tokens + step - 1, 1) for i in active]
                logits = self.runner.forward(seqs, input_ids_t=ids)
            requests = [rows[i].request for i in active]
            chosen, q = self._choose(
                logits, requests, step, [host[i] for i in active] if host is not None else [[]] * len(active)
            )
            tokens[row_index(active, len(rows), tokens.device), step] = chosen
            for a, i in enumerate(active):
                num_tokens[i] += 1
                if not requests[a].params.is_greedy:
                    probs[i].append(q[a])
                if not self.shares_target_kv:  # K/V written up to the newest input token
                    self.cached[requests[a].request_id] = (requests[a], requests[a].num_tokens + step)
            if host is not None:
                for i, t in zip(active, chosen.tolist()):
                    host[i].append(t)
            keep = [a for a, i in enumerate(active) if num_tokens[i] < rows[i].max_draft]
            ids = chosen if len(keep) == len(active) else chosen[to_device(keep, torch.int64, chosen.device)]
            active = [active[a] for a in keep]
            if not active:
                break
        out_probs = [torch.stack(p) if p else None for p in probs]
        return Proposal(num_tokens, tokens, out_probs)

    def _catch_up(self, rows: list[DraftRow]) -> tuple[torch.Tensor | None, list[int]]:
        """The draft computes what it has not yet (prefill chunks, the tokens accepted last step).
        Returns the logits of each drafting row's newest token [A, V] and those rows, or (None, [])."""
        groups: list[tuple[int, list[ForwardSeq]]] = []
        for i, row in enumerate(rows):
            r = row.request
            start = self._num_cached(r)
            end = r.num_computed_tokens + row.num_new_tokens
            if start >= end or (self.shares_target_kv and not row.max_draft) or r.params.pooling is not None:
                continue  # an embedding request never drafts: its prompt is the target's alone
            tokens = r.all_token_ids[start:end]
            if len(tokens) == 1 or len(tokens) <= self.rows_upto:  # decode rows, one per token
                groups.append((i, [ForwardSeq(r, [t], start + j, 1) for j, t in enumerate(tokens)]))
            else:
                groups.append((i, [ForwardSeq(r, tokens, start, 1 if row.max_draft else 0)]))
            if not self.shares_target_kv:
                self.cached[r.request_id] = (r, end)
        groups.sort(key=lambda g: len(g[1][0].token_ids) != 1)  # decodes first
        seqs: list[ForwardSeq] = []
        last_row: dict[int, int] = {}  # drafting row -> its newest token's logits row
        num_rows = 0
        for i, group in groups:
            seqs += group
            num_rows += sum(s.logits_rows for s in group)
            if rows[i].max_draft:
                last_row[i] = num_rows - 1
        if not seqs:
            return None, []
        logits = self.runner.forward(seqs)
        if not last_row:
            return None, []
        active = sorted(last_row)  # in the rows' own order
        pick = [last_row[i] for i in active]
        if pick != list(range(num_rows)):
            logits = logits[to_device(pick, torch.int64, logits.device)]
        return logits, active

    def _choose(
        self, logits: torch.Tensor, requests: list[Request], step: int, drafted: list[list[int]]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # logits: [A, V], row a proposes draft token `step` of requests[a]; drafted[a]: its draft so
        # far on the host where penalties read it, else [] -> (chosen [A] int64, q [A, V])
        views = [view(r, t) for r, t in zip(requests, drafted)]
        positions = [len(r.output_token_ids) + step for r in requests]
        q = self.runner.sampler.probs(logits, views, positions)  # [A, V]
        chosen = q.argmax(dim=-1)  # greedy rows: q is one-hot
        sampled = [a for a, r in enumerate(requests) if not r.params.is_greedy]
        if sampled:
            index = to_device(sampled, torch.int64, q.device)
            seeds = rejection.seed_tensor(
                [rejection.salted(requests[a].seed, rejection.DRAFT_SALT) for a in sampled], q.device
            )
            pos = to_device([positions[a] for a in sampled], torch.int64, q.device)
            chosen[index] = rejection.draw(q[index], seeds, pos)
        return chosen, q
