"""One HTTP generation request, completions or chat: its engine requests (one per prompt), read to a JSON
answer or streamed as server-sent events ending in `data: [DONE]`.

Everything that can be wrong with a request is found before it is answered: a bad prompt or
parameter is a 400 (the requests already queued for its other prompts are aborted), a full queue a
429. What only the engine can check (a constraint's schema or grammar compiles when the request is
added) is known by its first output, so a stream starts only once that has come. A client that
leaves, mid-stream or while waiting for its answer, aborts every request it made.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Protocol, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from infer.api.request import RequestOutput, SamplingParams
from infer.common.log import get_logger
from infer.core.stream import CompletionDelta, StreamOutput
from infer.serve.answers import PromptTokensDetails, Usage
from infer.serve.async_engine import RequestStream
from infer.serve.constrained import OutputRules
from infer.serve.errors import APIError, api_error
from infer.serve.metrics import ServeMetrics
from infer.serve.protocol import SamplingFields
from infer.serve.served import ServedModel
from infer.serve.tracing import end_span

DONE = "data: [DONE]\n\n"
T = TypeVar("T")


def finish_reason(reason: str | None) -> str | None:
    """The engine's "capacity" (the KV cache cannot hold the request) ends it for want of room, as "length"."""
    return "length" if reason == "capacity" else reason


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1e3, 3)


@dataclass(slots=True)
class Generation:
    """The engine requests of one HTTP request, and what its answer needs of them."""

    id: str  # the response's id: cmpl-... or chatcmpl-...
    served: ServedModel
    metrics: ServeMetrics
    n: int  # samples per prompt: prompt i's sample j is choice i * n + j
    num_logprobs: int | None  # top logprobs per token, or None
    include_usage: bool  # a usage chunk ends the stream
    tokens_as_ids: bool  # logprobs name tokens "token_id:N" (vLLM's return_tokens_as_token_ids)
    asked_by: str | None = None  # the request field that constrains the output (the engine's errors about it name it)
    prompt_logprobs: bool = False  # the answer has each prompt token's logprobs (asked for with prompt_logprobs)
    created: int = field(default_factory=lambda: int(time.time()))
    streams: list[RequestStream] = field(default_factory=list)  # one per prompt
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # of prompt_tokens, those found in the prefix cache (counted as each prompt finishes)
    text_offsets: dict[int, int] = field(default_factory=dict)  # choice -> its tokens' text so far (completions)
    num_finished: int = 0  # streams that ended with their output
    closed: bool = False
    span: Any = None  # the request's OpenTelemetry span (`tracing`), ended at close; None: not traced
    finish_reasons: list[str] = field(default_factory=list)  # of the finished outputs' samples
    first_token_s: float | None = None  # the earliest time to a first token among the prompts
    received: float = field(default_factory=time.perf_counter)  # when the server took the request up
    first_output_s: float | None = None  # received -> the first output in the server (streamed requests)
    priority: int = 0  # its requests' scheduling priority (lower first)

    @classmethod
    def start(
        cls, prefix: str, served: ServedModel, metrics: ServeMetrics, req: SamplingFields, prompts: list[list[int]],
        max_tokens: Callable[[int], int], num_logprobs: int | None, rules: OutputRules,
    ) -> "Generation":  # fmt: skip
        """Queue one engine request per prompt (token ids); max_tokens(prompt length) -> its limit."""
        gen = cls(
            f"{prefix}-{uuid.uuid4().hex}",
            served,
            metrics,
            req.n or 1,
            num_logprobs,
            req.include_usage,
            bool(req.return_tokens_as_token_ids),
            rules.asked_by,
            req.prompt_logprobs is not None,
        )
        gen.submit(prompts, lambda ids: req.sampling(max_tokens(len(ids)), num_logprobs, rules.structured))
        return gen

    def submit(self, prompts: list[list[int]], params_for: Callable[[list[int]], SamplingParams]) -> None:
        """Queue one engine request per prompt (token ids), with `params_for(ids)`; a refused one aborts those
        queued before it."""
        try:
            for i, ids in enumerate(prompts):
                params = params_for(ids)
                self.priority = params.priority
                self.streams.append(
                    self.served.engine.submit({"prompt_token_ids": ids}, params, f"{self.id}-{i}", self.served.lora)
                )
                self.prompt_tokens += len(ids)
        except BaseException:
            self.close(unfinished="rejected")
            raise

    def close(self, unfinished: str = "aborted", failed: str = "failed") -> None:
        """At the end, however it came: abort what is unfinished (the client left, or a later prompt was
        refused: `unfinished` says which) and count every engine request's outcome once (`failed`: of
        those an error ended, "rejected" when the engine refused them)."""
        if self.closed:
            return
        self.closed = True
        num_failed = sum(s.finished for s in self.streams) - self.num_finished  # ended by an error
        left = [s for s in self.streams if not s.finished]
        error = unfinished if left else failed if num_failed else None
        end_span(self.span, {
            "gen_ai.response.id": self.id,
            "gen_ai.usage.input_tokens": self.prompt_tokens,
            "gen_ai.usage.output_tokens": self.completion_tokens,
            "gen_ai.usage.cached_tokens": self.cached_tokens,
            "gen_ai.response.finish_reasons": self.finish_reasons or None,
            "infer.time_to_first_token_s": self.first_token_s,
        }, error)  # fmt: skip
        for stream in left:
            stream.close()
        for outcome, count in ((unfinished, len(left)), (failed, num_failed)):
            if count:
                self.metrics.ended(self.served.name, outcome, count)

    def error(self, exc: BaseException) -> APIError:
        """The answer to an error; one about the constraint (SamplingParams' `structured`) names the request
        field that asked for it."""
        error = api_error(exc)
        if error.param != "structured" or self.asked_by is None:
            return error
        return APIError(error.status, f"{self.asked_by}: {error.message}", error.type, self.asked_by, error.code)

    def finished(self, output: RequestOutput) -> None:
        self.num_finished += 1
        self.completion_tokens += sum(len(c.token_ids) for c in output.outputs)
        self.cached_tokens += output.num_cached_tokens or 0
        self.finish_reasons += [finish_reason(c.finish_reason) or "" for c in output.outputs]
        ttft = output.metrics.get("ttft_s")
        if ttft is not None and (self.first_token_s is None or ttft < self.first_token_s):
            self.first_token_s = ttft
        self.metrics.finished(self.served.name, output)
        get_logger().debug(  # where a request's wait went: the server's side and the engine's (`--log-level debug`)
            "request finished",
            request_id=output.request_id,
            priority=self.priority,
            server_first_output_ms=_ms(self.first_output_s),
            engine_queue_ms=_ms(output.metrics.get("queue_s")),
            engine_ttft_ms=_ms(ttft),
            engine_latency_ms=_ms(output.metrics.get("latency_s")),
            server_ms=_ms(time.perf_counter() - self.received),
        )

    def usage(self) -> Usage:
        total = self.prompt_tokens + self.completion_tokens
        return Usage(
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
            total_tokens=total,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=self.cached_tokens),
        )

    def token_text(self, token_id: int) -> str:
        return f"token_id:{token_id}" if self.tokens_as_ids else self.served.token_text(token_id)

    def top(self, logprobs: dict[int, float]) -> list[tuple[int, float]]:
        """The `num_logprobs` most likely tokens (the engine's dict also holds the sampled token)."""
        return sorted(logprobs.items(), key=lambda kv: -kv[1])[: self.num_logprobs or 0]


class Format(Protocol):
    """How one API writes its stream chunks and its JSON answer."""

    def opening(self, gen: Generation) -> list[dict[str, Any]]: ...

    def chunks(self, gen: Generation, index: int, delta: CompletionDelta) -> list[dict[str, Any]]: ...

    def closing(self, gen: Generation) -> list[dict[str, Any]]: ...  # after the last output (the usage)

    def response(self, gen: Generation, finals: list[RequestOutput]) -> Any: ...

    def error_body(self, error: APIError) -> dict[str, Any]: ...  # an error in the stream, or as the answer

    def event(self, chunk: dict[str, Any]) -> str: ...  # one server-sent event

    end: str | None  # the event that ends the stream ("data: [DONE]"), if the API has one


class OpenAIEvents:
    """OpenAI's framing: `data:` events, `data: [DONE]` last, errors in OpenAI's body."""

    end: str | None = DONE

    def event(self, chunk: dict[str, Any]) -> str:
        return sse_event(chunk)

    def error_body(self, error: APIError) -> dict[str, Any]:
        return error.body()


async def answer(gen: Generation, fmt: Format, stream: bool, request: Request) -> Response:
    """The JSON answer, or the event stream once the first output has come (an error before it is a
    plain error answer)."""
    outputs = merged(gen.streams)
    work = asyncio.ensure_future(_first(outputs) if stream else _finals(gen, outputs))
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not work.done():  # the client left: nobody reads the answer
            work.cancel()
            gen.close()
    if work.cancelled():
        return Response(status_code=499)  # nginx's "client closed request"; nobody receives it
    try:
        result = work.result()
    except Exception as exc:
        error = gen.error(exc)
        refused = "rejected" if error.status < 500 else "failed"
        gen.close(unfinished="rejected" if error.status < 500 else "aborted", failed=refused)
        raise error from exc
    if stream:
        gen.first_output_s = time.perf_counter() - gen.received
        return EventStream(_events(gen, fmt, result, outputs), on_close=gen.close)
    gen.close()
    return JSONResponse(fmt.response(gen, result).model_dump(mode="json"))


async def _first(outputs: AsyncIterator[tuple[int, StreamOutput]]) -> tuple[int, StreamOutput] | None:
    return await anext(outputs, None)


async def _finals(gen: Generation, outputs: AsyncIterator[tuple[int, StreamOutput]]) -> list[RequestOutput]:
    finals: list[RequestOutput | None] = [None] * len(gen.streams)
    async for i, out in outputs:
        if out.finished:
            assert out.final is not None
            finals[i] = out.final
            gen.finished(out.final)
    return [f for f in finals if f is not None]


async def _disconnected(request: Request) -> None:
    """Returns when the client goes away (the body was read: the next message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _events(
    gen: Generation, fmt: Format, first: tuple[int, StreamOutput] | None, rest: AsyncIterator[tuple[int, StreamOutput]]
) -> AsyncIterator[str]:
    try:
        for chunk in fmt.opening(gen):
            yield fmt.event(chunk)
        async for i, out in _after(first, rest):
            for delta in out.deltas:
                for chunk in fmt.chunks(gen, i * gen.n + delta.index, delta):
                    yield fmt.event(chunk)
            if out.finished:
                assert out.final is not None
                gen.finished(out.final)
        for chunk in fmt.closing(gen):
            yield fmt.event(chunk)
    except Exception as exc:  # the engine failed mid-stream: the status is sent, so say it in the stream
        yield fmt.event(fmt.error_body(gen.error(exc)))
    finally:
        gen.close()
    if fmt.end is not None:
        yield fmt.end


async def _after(first: T | None, rest: AsyncIterator[T]) -> AsyncIterator[T]:
    if first is not None:
        yield first
    async for item in rest:
        yield item


def sse_event(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, StreamOutput]]:
    """(prompt index, output) from every stream, as they come; leaving early closes them all."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue[tuple[int, StreamOutput | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                queue.put_nowait((i, out))
        except Exception as exc:
            queue.put_nowait((i, exc))
        queue.put_nowait((i, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        for stream in streams:
            stream.close()


class EventStream(StreamingResponse):
    """Server-sent events; `on_close` runs however the response ends (a client gone included)."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(content, headers={"Cache-Control": "no-cache"})
        self._on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def max_tokens_rule(
    requested: int | None, default: int | None, max_model_len: int, param: str, prompt_param: str
) -> Callable[[int], int]:
    """A prompt of p tokens leaves max_model_len - p: `requested` must fit; `default` (None: all) is cut to it.
    `param` and `prompt_param` name the request's fields in errors."""

    def rule(num_prompt: int) -> int:
        room = max_model_len - num_prompt
        if room < 1:
            raise APIError(
                400,
                f"the prompt has {num_prompt} tokens but this model's context holds {max_model_len} (prompt + at "
                f"least one new token): shorten the prompt",
                param=prompt_param,
                code="context_length_exceeded",
            )
        if requested is None:
            return room if default is None else min(default, room)
        if requested > room:
            raise APIError(
                400,
                f"this model's context holds {max_model_len} tokens and the prompt has {num_prompt}, so {param} "
                f"can be at most {room}, not {requested}: lower {param} or shorten the prompt",
                param=param,
                code="context_length_exceeded",
            )
        return requested

    return rule
