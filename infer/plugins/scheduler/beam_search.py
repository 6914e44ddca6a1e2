"""Beam search over the scheduler's requests, step for step as HF transformers' `generate(num_beams=W)`.

A beam group is `best_of` = W requests (slots). Until the first token only slot 0 runs (the
prompt); the others are dormant. A slot that computes its last token records the top-K logprobs
of its next token (K = max(2, 1 + stop tokens) * W: the best K continuations over all beams are
among each beam's own best K). When every live beam has its candidates, the group takes one step
of HF's algorithm (`beam_step`): of the best K continuations by cumulative logprob, those among
the best W that end in a stop token (or reach max_tokens) become finished hypotheses, scored
sum_logprobs / generated_len ** length_penalty; the best W others are the next beams. Scores are
float32, added and divided as HF does, so orderings match.

Slots are then reassigned: a beam's first child keeps its parent's slot and appends its token;
other children take over the slots of beams left without one, sharing the parent's whole block
table (`allocator.reassign`: refcount + 1; the partly filled last block is copied on its first
write). Stop conditions, as HF's: early_stopping=False stops when the best running beam, at its
current length, cannot beat the worst of W finished hypotheses; True stops once W are finished;
"never" (with length_penalty > 0) judges the running beam at the maximum length.

A beam that recorded its candidates and waits for the rest of its group is idle: the scheduler
never runs it, and frees it first when nothing else can run. Beams preempt by recompute only.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from infer.api.request import FinishReason, Request, SamplingParams


def div32(x: float, divisor: float) -> float:
    # a float32 value divided by a Python float, as HF divides its float32 score tensors
    return (torch.tensor(x, dtype=torch.float32) / divisor).item()


def stop_token_ids(request: Request) -> set[int]:
    p = request.params
    return set(p.stop_token_ids or ()) | (set() if p.ignore_eos else set(request.eos_token_ids))


def max_new_tokens(request: Request) -> int:
    limit = request.params.max_tokens
    return min(limit, request.max_model_len - request.num_prompt_tokens) if request.max_model_len else limit


@dataclass(slots=True)
class Hypothesis:
    score: float  # sum_logprobs / generated_len ** length_penalty, a float32 value
    token_ids: list[int]  # generated tokens, the stop token included


@dataclass(slots=True)
class BeamGroup:
    slots: list[Request]  # W requests; slot 0 is the prompt's first request
    live: list[Request]  # current beams, best first (HF's beam order)
    scores: list[float]  # their cumulative logprobs, float32 values
    stops: set[int]
    max_new: int
    finished: list[Hypothesis] = field(default_factory=list)  # best first, at most W
    is_open: bool = True  # HF's is_early_stop_heuristic_unsatisfied
    num_generated: int = 0
    candidates: dict[str, dict[int, float]] = field(default_factory=dict)  # live slot id -> next-token logprobs

    @property
    def params(self) -> SamplingParams:
        return self.slots[0].params

    @property
    def width(self) -> int:
        return self.params.best_of or self.params.n

    @property
    def is_ready(self) -> bool:
        return all(b.request_id in self.candidates for b in self.live)


def beam_step(g: BeamGroup) -> tuple[list[tuple[int, int, float]], bool]:
    """One step of HF's beam search; returns the next beams as (parent index in g.live, token, score), and done."""
    p, width = g.params, g.width
    keep = max(2, 1 + len(g.stops)) * width
    items = [(j, t, lp) for j, beam in enumerate(g.live) for t, lp in g.candidates[beam.request_id].items()]
    base = torch.tensor([g.scores[j] for j, _, _ in items], dtype=torch.float32)
    acc = (base + torch.tensor([lp for _, _, lp in items], dtype=torch.float32)).tolist()
    order = sorted(range(len(items)), key=lambda i: (-acc[i], items[i][0], items[i][1]))[:keep]
    top = [(items[i][0], items[i][1], acc[i]) for i in order]
    at_length = g.num_generated + 1 >= g.max_new
    hits = [at_length or t in g.stops for _, t, _ in top]
    running = [top[k] for k in range(len(top)) if not hits[k]][:width]
    if len(running) < width:  # every continuation stopped: HF keeps them at -1e9; the group is done anyway
        running += [top[k] for k in range(len(top)) if hits[k]][: width - len(running)]
    if g.is_open and not (p.early_stopping is True and len(g.finished) == width):
        divisor = (g.num_generated + 1) ** p.length_penalty
        new = [
            Hypothesis(div32(score, divisor), g.live[j].output_token_ids + [t])
            for k, (j, t, score) in enumerate(top[:width])
            if hits[k]
        ]
        g.finished = sorted(g.finished + new, key=lambda h: -h.score)[:width]
    g.num_generated += 1
    if len(g.finished) == width and running:
        length = g.max_new if p.early_stopping == "never" and p.length_penalty > 0 else g.num_generated
        best = div32(running[0][2], length**p.length_penalty)
        g.is_open = g.is_open and best > g.finished[-1].score
    done = not g.is_open or (p.early_stopping is True and len(g.finished) == width) or all(hits)
    return running, done


class BeamSearch:
    """The scheduler's beam groups: taking slots in, recording candidates, stepping groups."""

    def __init__(self) -> None:
        self.groups: dict[str, BeamGroup] = {}  # slot request id -> its group

    def add(self, request: Request) -> bool:
        """Take a beam slot; False for the dormant slots of a group (True: queue it, like any other request)."""
        if not request.params.use_beam_search:
            return True
        root = request.fork_parent or request
        group = self.groups.get(root.request_id)
        if group is None:
            assert root is request, "a group's first slot is added first"
            stops = stop_token_ids(request)
            p = request.params
            keep = max(2, 1 + len(stops)) * (p.best_of or p.n)
            request.params = replace(p, temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, logprobs=keep)
            self.groups[request.request_id] = BeamGroup([request], [request], [0.0], stops, max_new_tokens(request))
            return True
        request.params = group.params
        group.slots.append(request)
        self.groups[request.request_id] = group
        return False

    def dormant(self, request_id: str) -> Request | None:
        group = self.groups.get(request_id)
        if group is None:
            return None
        return next((s for s in group.slots if s.request_id == request_id and s not in group.live), None)

    def is_idle(self, request: Request) -> bool:
        group = self.groups.get(request.request_id)
        return group is not None and request.request_id in group.candidates

    def holds(self, request: Request) -> bool:
        return request.request_id in self.groups

    def record(self, request: Request, logprobs: list[dict[int, float]] | None) -> bool:
        """Keep a beam's next-token candidates until its group steps; False for a request that is no beam."""
        group = self.groups.get(request.request_id)
        if group is None:
            return False
        assert logprobs, f"beam {request.request_id} was sampled without logprobs"
        group.candidates[request.request_id] = logprobs[0]
        return True

    def resolve(self, sched: Any) -> list[Request]:
        """Step every group whose live beams all have candidates; returns the requests that finished."""
        finished: list[Request] = []
        ready = {id(g): g for g in self.groups.values() if g.is_ready}
        for group in ready.values():
            running, done = beam_step(group)
            if done:
                finished.extend(self._finish(sched, group, running))
            else:
                self._reassign(sched, group, running)
        return finished

    def _reassign(self, sched: Any, g: BeamGroup, running: list[tuple[int, int, float]]) -> None:
        assert len(running) == g.width, "fewer continuations than beams (vocabulary smaller than K?)"
        parents = [g.live[j] for j, _, _ in running]
        dsts: list[Request | None] = []
        for k, parent in enumerate(parents):  # a parent's first child stays in its slot
            dsts.append(parent if parent not in parents[:k] else None)
        spare = [s for s in g.slots if s not in dsts]
        slots = [d if d is not None else spare.pop(0) for d in dsts]
        tokens = {p.request_id: (list(p.output_token_ids), p.num_computed_tokens) for p in parents}
        sched.allocator.reassign([(d, p) for d, p in zip(slots, parents) if d is not p])
        now = time.perf_counter()
        for slot, parent, (_, token, _) in zip(slots, parents, running):
            output, computed = tokens[parent.request_id]
            slot.output_token_ids = output + [token]
            slot.num_computed_tokens = computed
            if slot.first_token_time is None:
                slot.first_token_time = now
            sched.place(slot)
        g.live, g.scores = slots, [score for _, _, score in running]
        g.candidates.clear()

    def _finish(self, sched: Any, g: BeamGroup, running: list[tuple[int, int, float]]) -> list[Request]:
        hyps = list(g.finished)
        divisor = max(g.num_generated, 1) ** g.params.length_penalty
        for j, t, score in running[: max(0, g.params.n - len(hyps))]:  # only if too few finished
            hyps.append(Hypothesis(div32(score, divisor), g.live[j].output_token_ids + [t]))
        for slot in g.slots:
            del self.groups[slot.request_id]
        now = time.perf_counter()
        for i, slot in enumerate(g.slots):
            ids = hyps[i].token_ids if i < len(hyps) else slot.output_token_ids
            reason = FinishReason.STOP if ids and ids[-1] in g.stops else FinishReason.LENGTH
            sched.finish(slot, reason)  # frees the blocks while they still match the slot's tokens
            slot.output_token_ids = list(ids)
            if slot.first_token_time is None:
                slot.first_token_time = now
        return list(g.slots)

    def on_finish(self, sched: Any, request: Request, reason: FinishReason) -> None:
        """A slot ended from outside (abort, capacity): its whole group ends the same way."""
        group = self.groups.get(request.request_id)
        if group is None:
            return
        for slot in group.slots:
            self.groups.pop(slot.request_id, None)
        for slot in group.slots:
            sched.finish(slot, reason)
