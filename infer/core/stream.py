"""Per-request deltas, the public stepping API's outputs (`Engine.stream`, `Engine.step_outputs`): what
each engine step adds to a request's samples, cut so that the streamed pieces concatenate to the
final output exactly.

Text reaches a request one step after its tokens (the detokenizer runs beside the next forward),
and a stop string found in that text truncates the tokens and cuts the text. So a step streams
only tokens whose text the detokenizer has returned (the ones handed to it by the step before),
and only text that no stop string can still cut: the last `longest stop - 1` characters wait until
the request ends. What is left goes out with the final output.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from infer.api.request import Request, RequestOutput
from infer.core.output import Group

# A step's news for one request as the engine's thread makes it: (request id, [(index, text, token_ids,
# logprobs), ...]), plain tuples, so that a step of a few hundred requests crosses a pipe in a fraction of
# a millisecond (pickling as many dataclasses costs ~30x more, on the engine's critical path).
# `as_output` makes the StreamOutput on the reader's side.
RawDelta = tuple[int, str, list[int], "list[dict[int, float]] | None"]
News = tuple[str, list[RawDelta]]


@dataclass(slots=True)
class CompletionDelta:
    """What one sample gained since its previous delta."""

    index: int  # which of the request's n samples
    text: str  # new text: the streamed texts concatenate to the final text
    token_ids: list[int]  # new token ids: they concatenate to the final token ids
    logprobs: list[dict[int, float]] | None  # per new token {token id: logprob}; None unless asked for
    finish_reason: str | None = None  # "stop", "length", "abort", "capacity"; set in the sample's last delta


@dataclass(slots=True)
class StreamOutput:
    """One step's news for one request; the last one (`finished`) carries the whole output."""

    request_id: str  # the request's id, as generate() was given or chose it
    deltas: list[CompletionDelta]  # the samples with something new in this step
    finished: bool  # True in the request's last output only
    final: RequestOutput | None = None  # the complete output, as LLM.generate returns it; set when finished


@dataclass(slots=True)
class EngineStep:
    """What one `Engine.step_outputs()` produced: the news of each streamed request, and every request
    that ended (streamed or not)."""

    news: list[News]  # per streamed request with something new: (request id, [RawDelta per sample])
    # each request that ended: its output, and for a streamed one that ran its last StreamOutput (the rest
    # of each sample and its finish reason); None when it was not streamed or was refused (`output.error`)
    finished: list[tuple[RequestOutput, StreamOutput | None]]


@dataclass(slots=True)
class Tracked:
    """One request's progress through its stream, kept by the engine's thread."""

    group: Group  # the engine's group of this request's samples (its texts so far)
    prompt: str | None  # the prompt's text, for the final output (the engine was given token ids)
    holdback: int  # characters a stop string may still cut: longest stop - 1
    logprobs: bool  # whether deltas carry logprobs
    streams: bool  # False for beams, whose tokens change until the end: their output comes whole
    sent_tokens: list[int] = field(default_factory=list)  # per sample: tokens streamed
    sent_chars: list[int] = field(default_factory=list)  # per sample: characters streamed

    @classmethod
    def of(cls, group: Group, prompt: str | None) -> "Tracked":
        params = group.children[0].params
        stops = params.stop or []
        n = len(group.children)
        return cls(
            group=group,
            prompt=prompt,
            holdback=max(map(len, stops), default=1) - 1,
            logprobs=params.logprobs is not None and params.tokens_are_final,
            streams=params.tokens_are_final,
            sent_tokens=[0] * n,
            sent_chars=[0] * n,
        )

    def delta(self, index: int, request: Request, num_checked: int) -> RawDelta | None:
        """The sample's news after a step; `num_checked`: its tokens whose text is in (handed to the
        detokenizer by the step before)."""
        end = min(num_checked, len(request.output_token_ids))
        text = self.group.texts.get(request.request_id, "")
        cut = len(text) - self.holdback
        start_token, start_char = self.sent_tokens[index], self.sent_chars[index]
        if end <= start_token and cut <= start_char:
            return None
        token_ids = request.output_token_ids[start_token:end] if end > start_token else []
        logprobs = request.output_logprobs[start_token:end] if self.logprobs and end > start_token else None
        self.sent_tokens[index] = max(end, start_token)
        self.sent_chars[index] = max(cut, start_char)
        return index, text[start_char:cut] if cut > start_char else "", token_ids, logprobs

    def last(self, output: RequestOutput) -> StreamOutput:
        """The final output, and every sample's rest: what was not streamed yet, and its finish reason."""
        if output.prompt is None:
            output.prompt = self.prompt
        deltas = []
        for c in output.outputs:
            tokens, chars = self.sent_tokens[c.index], self.sent_chars[c.index]
            logprobs = c.logprobs[tokens:] if self.logprobs and c.logprobs is not None else None
            deltas.append(CompletionDelta(c.index, c.text[chars:], c.token_ids[tokens:], logprobs, c.finish_reason))
        return StreamOutput(output.request_id, deltas, finished=True, final=output)


class Streams:
    """The requests an engine streams (`Engine.stream`), and what each step added to them."""

    def __init__(self) -> None:
        self.tracked: dict[str, Tracked] = {}  # streamed request id -> its progress
        self.samples: dict[Request, tuple[Tracked, int]] = {}  # streamed sample -> (its request's, its index)
        self.submitted: list[tuple[Request, int]] = []  # handed to the detokenizer last step: (sample, tokens)

    def add(self, group: Group, prompt: str | None) -> None:
        tracked = Tracked.of(group, prompt)
        self.tracked[group.request_id] = tracked
        for index, sample in enumerate(group.children):
            self.samples[sample] = (tracked, index)

    def remove(self, request_id: str) -> Tracked | None:
        tracked = self.tracked.pop(request_id, None)
        for sample in tracked.group.children if tracked is not None else ():
            self.samples.pop(sample, None)
        return tracked

    def after_step(self, finished: list[RequestOutput], in_flight: list[Request]) -> EngineStep:
        """A step's outputs: `finished`, what it ended; `in_flight`, the samples it handed to the
        detokenizer (their text is in after the next step)."""
        submitted = self.submitted
        self.submitted = [(r, len(r.output_token_ids)) for r in in_flight] if self.tracked else []
        ends: list[tuple[RequestOutput, StreamOutput | None]] = []
        for output in finished:  # first: a request that ended gets its rest in its last output, no news
            tracked = self.remove(output.request_id)
            ends.append((output, tracked.last(output) if tracked is not None and output.error is None else None))
        news: dict[str, list[RawDelta]] = {}
        for request, num_checked in submitted:
            entry = self.samples.get(request)
            if entry is None or not entry[0].streams:
                continue
            tracked, index = entry
            delta = tracked.delta(index, request, num_checked)
            if delta is not None:
                news.setdefault(tracked.group.request_id, []).append(delta)
        return EngineStep(list(news.items()), ends)


def as_output(item: StreamOutput | News) -> StreamOutput:
    """A stream's item as its reader sees it: a step's news (plain tuples) made a StreamOutput."""
    if isinstance(item, StreamOutput):
        return item
    request_id, deltas = item
    return StreamOutput(request_id, [CompletionDelta(*d) for d in deltas], finished=False)


def merge(first: StreamOutput, later: StreamOutput) -> StreamOutput:
    """Two successive outputs of one request as one: what a reader that fell behind gets, so a client is
    sent one chunk for several steps instead of one per step (the concatenations are unchanged)."""
    by_index = {d.index: d for d in first.deltas}
    deltas = list(first.deltas)
    for d in later.deltas:
        before = by_index.get(d.index)
        if before is None:
            deltas.append(d)
            continue
        logprobs = (
            None if before.logprobs is None and d.logprobs is None else (before.logprobs or []) + (d.logprobs or [])
        )
        joined = CompletionDelta(
            d.index, before.text + d.text, before.token_ids + d.token_ids, logprobs, d.finish_reason
        )
        deltas[deltas.index(before)] = by_index[d.index] = joined
    return StreamOutput(later.request_id, deltas, later.finished, later.final)
