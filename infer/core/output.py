"""Turning finished and running requests into RequestOutputs, with text from the detokenizer.

The detokenizer's work for step N is collected during step N+1, after the forward pass has been
launched, so a `parallel` detokenizer runs beside the model. A request's output is final once
its last tokens have been through the detokenizer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from infer.api import Detokenizer
from infer.api.errors import RequestError, one_line
from infer.api.pooling import DEFAULT_POOLER, PoolingParams, check_dimensions, embed
from infer.api.request import CompletionOutput, FinishReason, Request, RequestOutput


@dataclass(slots=True)
class Group:
    """The n samples of one prompt."""

    request_id: str
    prompt: str | None
    children: list[Request]
    texts: dict[str, str] = field(default_factory=dict)  # child id -> text so far


@dataclass(slots=True)
class Pooling:
    """What embedding requests are pooled by (`infer.api.pooling`)."""

    poolers: dict[str, Any] = field(default_factory=dict)  # name -> Pooler, every one installed
    # the model's (its sentence-transformers Pooling module's, else "last"); None: its folder asks for a
    # pooling no installed pooler serves (`default_problem` says which), so a request must name one
    default: str | None = DEFAULT_POOLER
    max_dimensions: int | None = None  # how far its embeddings may be cut (Matryoshka); None: not at all
    default_problem: str = ""

    def check(self, params: PoolingParams) -> None:
        """Refuse what this engine cannot pool, before the request is queued."""
        name = params.pooler or self.default
        if name is None:
            raise RequestError(f"{self.default_problem}: name a pooler for it (pooler=...), or serve another model")
        if name not in self.poolers:
            known = ", ".join(sorted(self.poolers)) or "none installed"
            raise RequestError(f"unknown pooler {name!r}: use one of {known}")
        if params.dimensions is not None:
            check_dimensions(params.dimensions, self.max_dimensions)

    def embedding(self, request: Request) -> tuple[list[float] | None, str | None]:
        """A finished embedding request's (vector, None), or (None, why there is none): it ended before its
        every prompt position was computed through the whole model (aborted, no room in the KV cache, a
        decoder that runs the first layers alone), or its pooler failed. Never raises: the step goes on."""
        params = request.params.pooling
        if params is None:
            return None, None
        if request.num_pooled_rows < request.num_prompt_tokens:
            request.pooled_hidden.clear()
            reason = request.finish_reason.value if request.finish_reason is not None else "unfinished"
            if reason == "abort":
                return None, None  # asked for by its caller
            return None, (
                f"the embedding request ended ({reason}) with the hidden states of {request.num_pooled_rows} of its "
                f"{request.num_prompt_tokens} prompt tokens: a prompt must fit the KV cache whole, and the decoder must "
                "run the whole model (not --decoding early-exit)"
            )
        name = params.pooler or self.default
        assert name is not None, "checked when it was added"
        try:
            return embed(self.poolers[name], request, self.max_dimensions), None
        except Exception as exc:  # a plugin's pooler: this request fails, not the step
            request.pooled_hidden.clear()
            return None, f"pooler {name!r} failed: {one_line(exc)}"


class OutputProcessor:
    def __init__(self, detokenizer: Detokenizer | None, pooling: Pooling | None = None) -> None:
        self.detokenizer = detokenizer
        self.pooling = pooling if pooling is not None else Pooling()
        self.groups: dict[str, Group] = {}  # parent id -> group
        self.parent_of: dict[str, str] = {}  # child id -> parent id
        self.in_flight: list[Request] = []  # submitted, not yet collected
        self.ready: set[str] = set()  # finished children whose text is final

    def add(self, group: Group) -> None:
        self.groups[group.request_id] = group
        for child in group.children:
            self.parent_of[child.request_id] = group.request_id

    def has_pending(self) -> bool:
        return bool(self.in_flight) or bool(self.groups)

    def collect(self) -> list[tuple[Request, int]]:
        """Texts of the last submit; returns (request, stop_index) for stop strings found."""
        if not self.in_flight:
            return []
        deltas = self.detokenizer.collect() if self.detokenizer is not None else {}
        stops = []
        for request in self.in_flight:
            group = self.groups[self.parent_of[request.request_id]]
            delta = deltas.get(request.request_id)
            if delta is not None:
                group.texts[request.request_id] = delta.text
                if delta.stop_index is not None:
                    stops.append((request, delta.stop_index))
            if request.is_finished or (delta is not None and delta.stop_index is not None):
                self.ready.add(request.request_id)
        self.in_flight = []
        return stops

    def submit(self, requests: list[Request]) -> None:
        """Hand this step's updated requests (running or just finished) to the detokenizer."""
        fresh = [r for r in requests if r.request_id in self.parent_of and r.request_id not in self.ready]
        fresh = [r for r in fresh if r.is_finished or r.params.tokens_are_final]  # else decoded once, at the end
        fresh = [r for r in fresh if r.params.detokenize or r.is_finished]  # no text: nothing to decode
        for r in fresh:
            if r.is_finished and not r.output_token_ids:  # ended before producing a token
                self.ready.add(r.request_id)
            elif not r.params.detokenize and r.is_finished:  # token ids alone: no text to wait for
                self.ready.add(r.request_id)
        fresh = [r for r in fresh if r.request_id not in self.ready]
        self.in_flight = fresh
        if self.detokenizer is not None and fresh:
            self.detokenizer.submit([(r, list(r.output_token_ids)) for r in fresh])

    def mark_final(self, request: Request) -> None:
        """An aborted request: its text is final unless tokens of it are still being detokenized."""
        if request not in self.in_flight:
            self.ready.add(request.request_id)

    def discard(self, parent_id: str) -> None:
        """Forget a group without an output (its `generate` failed); its children must be finished."""
        group = self.groups.pop(parent_id, None)
        if group is None:
            return
        ids = {c.request_id for c in group.children}
        self.in_flight = [r for r in self.in_flight if r.request_id not in ids]
        for rid in ids:
            self.parent_of.pop(rid, None)
            self.ready.discard(rid)
            if self.detokenizer is not None:
                self.detokenizer.release(rid)

    def finished_outputs(self) -> list[RequestOutput]:
        """Outputs of the groups whose every child is finished with final text; forgets them."""
        done = []
        for parent_id, group in list(self.groups.items()):
            if all(c.is_finished and c.request_id in self.ready for c in group.children):
                done.append(self.build(group))
                del self.groups[parent_id]
                for child in group.children:
                    self.parent_of.pop(child.request_id, None)
                    self.ready.discard(child.request_id)
                    if self.detokenizer is not None:
                        self.detokenizer.release(child.request_id)
        return done

    def build(self, group: Group) -> RequestOutput:
        outputs = []
        first = group.children[0]
        for i, child in enumerate(group.children[: first.params.n]):  # beam search runs best_of, returns n
            reason = child.finish_reason.value if isinstance(child.finish_reason, FinishReason) else None
            outputs.append(
                CompletionOutput(
                    index=i,
                    text=group.texts.get(child.request_id, ""),
                    token_ids=list(child.output_token_ids),
                    finish_reason=reason,
                    logprobs=list(child.output_logprobs) if _has_logprobs(child.params) else None,
                )
            )
        metrics = {}
        if first.first_scheduled_time is not None:  # arrival -> first scheduled: the wait in the queue
            metrics["queue_s"] = first.first_scheduled_time - first.arrival_time
        if first.first_token_time is not None:
            metrics["ttft_s"] = first.first_token_time - first.arrival_time
        finish_times = [c.finish_time for c in group.children if c.finish_time is not None]
        if len(finish_times) == len(group.children):  # every sample finished
            metrics["latency_s"] = max(finish_times) - first.arrival_time
        embedding, error = self.pooling.embedding(first)
        return RequestOutput(
            request_id=group.request_id,
            prompt=group.prompt,
            prompt_token_ids=list(first.prompt_token_ids),
            outputs=outputs,
            finished=True,
            metrics=metrics,
            prompt_logprobs=None if first.params.prompt_logprobs is None else [None, *first.prompt_logprobs],
            num_cached_tokens=first.num_cached_tokens,
            embedding=embedding,
            error=error,
        )

    def close(self) -> None:
        if self.detokenizer is not None:
            self.detokenizer.close()


def _has_logprobs(params) -> bool:
    return params.logprobs is not None and params.tokens_are_final  # else the scheduler's own
