"""The online load generator: requests sent to any OpenAI-compatible server as streams, at Poisson
arrivals or a fixed concurrency, each timed chunk by chunk (the PagedAttention paper's measure).

One request's failure is a record with `error` set, never the end of the run. Errors that make the
whole run meaningless (no server at the URL, a refused key) are found by `check_server` first.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Literal

import httpx

from infer.api.errors import InferError, one_line

Endpoint = Literal["completions", "chat"]
PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


class ServerError(InferError):
    """The server cannot be reached, refused the key, or does not speak the OpenAI protocol."""


@dataclass(frozen=True, slots=True)
class LoadSettings:
    base_url: str  # the server's root, e.g. http://127.0.0.1:8000 (no /v1)
    model: str  # the `model` field of every request
    endpoint: Endpoint = "completions"
    api_key: str | None = None  # sent as `Authorization: Bearer KEY`
    request_rate: float = math.inf  # Poisson arrivals per second; inf: every request at once
    max_concurrency: int | None = None  # requests in flight at most; None: no bound
    seed: int = 0  # seeds the arrival times
    timeout_s: float = 600.0  # longest wait for one read of a stream (a request may run longer)

    def url(self) -> str:
        return self.base_url + PATHS[self.endpoint]

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


@dataclass(slots=True)
class OnlineRequest:
    prompt: str | list[int]  # text, or token ids (completions only: chat messages are text)
    max_tokens: int  # output tokens asked for, with ignore_eos: the output length
    prompt_tokens: int = 0  # known before sending for token ids (or with a tokenizer); else 0, read from usage
    priority: int | None = None  # sent as `priority` (lower first); None: not sent


@dataclass(slots=True)
class RequestRecord:
    index: int  # the request's place in the workload
    start_s: float  # when it was sent, seconds after the run started
    prompt_tokens: int = 0  # from the server's usage, else as known before sending
    output_tokens: int = 0  # from the server's usage, else the streamed chunks that carried output
    ttft_s: float = 0.0  # sent -> first chunk with output
    e2e_s: float = 0.0  # sent -> end of the stream
    itl_s: list[float] = field(default_factory=list)  # gaps between successive chunks with output
    error: str | None = None  # why the request failed; None when it succeeded
    priority: int | None = None  # the priority it was sent with, if any
    lag_s: float = 0.0  # sent late by this much after its arrival time: the client's own delay

    @property
    def tpot_s(self) -> float:
        """Time per output token after the first; 0 for a one-token answer."""
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1) if self.output_tokens > 1 else 0.0


@dataclass(slots=True)
class LoadResult:
    settings: LoadSettings  # what was sent, how
    records: list[RequestRecord]  # one per request, in workload order
    duration_s: float  # first send -> last request done


def normalize_base_url(url: str) -> str:
    """The server's root: no trailing slash, no /v1 (the paths add it)."""
    url = url.strip().rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def arrival_offsets(num_requests: int, request_rate: float, seed: int) -> list[float]:
    """Seconds after the start at which each request is sent: a Poisson process at `request_rate`
    (exponential gaps from a seeded RNG, the first request at 0), or all at 0 when the rate is inf."""
    if math.isinf(request_rate):
        return [0.0] * num_requests
    rng = random.Random(seed)
    offsets, t = [], 0.0
    for _ in range(num_requests):
        offsets.append(t)
        t += rng.expovariate(request_rate)
    return offsets


def request_body(request: OnlineRequest, settings: LoadSettings) -> dict[str, Any]:
    """Greedy, EOS ignored (vLLM's extra) so the output length is the workload's, usage in the stream."""
    body: dict[str, Any] = {
        "model": settings.model,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if settings.endpoint == "chat":
        assert isinstance(request.prompt, str), "chat prompts are text"
        body.update(messages=[{"role": "user", "content": request.prompt}], max_completion_tokens=request.max_tokens)
    else:
        body.update(prompt=request.prompt, max_tokens=request.max_tokens)
    if request.priority is not None:
        body["priority"] = request.priority
    return body


def _error_message(status: int, raw: bytes) -> str:
    """`HTTP 400: the server's message`, from OpenAI's error body when it sent one."""
    text = raw.decode(errors="replace")
    try:
        body = json.loads(text)
        error = body.get("error", body) if isinstance(body, dict) else body
        message = error.get("message", error) if isinstance(error, dict) else error
    except json.JSONDecodeError:
        message = text
    message = one_line(str(message))[:200]
    return f"HTTP {status}: {message}" if message else f"HTTP {status}"


def _is_output(chunk: dict[str, Any], endpoint: Endpoint) -> bool:
    """Whether a streamed chunk carries output: a chat delta with content, or any completions choice
    (as vLLM's benchmark counts them: a step's tokens may hold no text yet, or no text at all from a
    model served without a tokenizer)."""
    choices = chunk.get("choices") or []
    if not choices or not isinstance(choices[0], dict):
        return False
    if endpoint == "chat":
        return bool((choices[0].get("delta") or {}).get("content"))
    return True


async def send(
    client: httpx.AsyncClient,
    request: OnlineRequest,
    settings: LoadSettings,
    index: int,
    t0: float,
    due_s: float | None = None,
) -> RequestRecord:
    """One streamed request, timed per chunk that carries output. Never raises for the request's own failure.
    `due_s`: its arrival time, seconds after t0 (the record's lag is how late it went out)."""
    start = time.perf_counter()
    record = RequestRecord(index, start - t0, prompt_tokens=request.prompt_tokens, priority=request.priority)
    if due_s is not None:
        record.lag_s = max(0.0, start - t0 - due_s)
    chunks, last, done = 0, start, False
    try:
        async with client.stream("POST", settings.url(), json=request_body(request, settings)) as response:
            if response.status_code != 200:
                record.error = _error_message(response.status_code, await response.aread())
                return record
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue  # blank lines between events, `: comments`, other fields
                data = line[len("data:") :].strip()
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if not isinstance(chunk, dict):
                    raise ValueError(f"an event's data is not a JSON object: {data[:80]}")
                if "error" in chunk:
                    record.error = f"error in the stream: {one_line(str(chunk['error']))[:200]}"
                    return record
                if _is_output(chunk, settings.endpoint):
                    now = time.perf_counter()
                    if chunks == 0:
                        record.ttft_s = now - start
                    else:
                        record.itl_s.append(now - last)
                    chunks, last = chunks + 1, now
                usage = chunk.get("usage") or {}
                record.output_tokens = usage.get("completion_tokens") or record.output_tokens
                record.prompt_tokens = usage.get("prompt_tokens") or record.prompt_tokens
    except Exception as exc:  # whatever the server sent or did, it fails this request only
        record.error = f"{type(exc).__name__}: {one_line(exc) or 'no message'}"[:240]
        return record
    record.e2e_s = time.perf_counter() - start
    if not done:
        record.error = "the stream ended before `data: [DONE]`"
    elif chunks == 0:
        record.error = "the stream carried no output"
    record.output_tokens = record.output_tokens or chunks
    return record


def make_client(settings: LoadSettings) -> httpx.AsyncClient:
    """No pool bound (httpx's default of 100 connections would cap the load silently); the bound is ours."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(settings.timeout_s, connect=10.0, pool=None)
    return httpx.AsyncClient(limits=limits, timeout=timeout, headers=settings.headers())


async def run_load(
    requests: list[OnlineRequest],
    settings: LoadSettings,
    on_done: Callable[[RequestRecord], object] | None = None,
) -> LoadResult:
    """Send every request at its arrival time, at most `max_concurrency` in flight (a request whose time
    came waits for a slot, as in vLLM's benchmark); TTFT counts from the send, not from the arrival."""
    offsets = arrival_offsets(len(requests), settings.request_rate, settings.seed)
    slots = asyncio.Semaphore(settings.max_concurrency) if settings.max_concurrency else None
    async with make_client(settings) as client:
        t0 = time.perf_counter()

        async def one(i: int) -> RequestRecord:
            await asyncio.sleep(max(0.0, t0 + offsets[i] - time.perf_counter()))
            if slots is None:
                record = await send(client, requests[i], settings, i, t0, offsets[i])
            else:  # a wait for a slot is the bound's, not the client's lag
                async with slots:
                    record = await send(client, requests[i], settings, i, t0)
            if on_done is not None:
                on_done(record)
            return record

        records = await asyncio.gather(*(one(i) for i in range(len(requests))))
        return LoadResult(settings, list(records), time.perf_counter() - t0)


async def check_server(settings: LoadSettings) -> list[str]:
    """The models the server lists at GET /v1/models; a ServerError naming the fix when there is no
    OpenAI-compatible server at the URL or it refuses the key."""
    url = settings.base_url + "/v1/models"
    try:
        async with make_client(settings) as client:
            response = await client.get(url)
    except (httpx.UnsupportedProtocol, httpx.InvalidURL) as exc:
        raise ServerError(
            f"--base-url {settings.base_url!r} is not a URL ({one_line(exc)}): write it as http://HOST:PORT"
        ) from None
    except httpx.HTTPError as exc:
        raise ServerError(
            f"cannot connect to {settings.base_url} ({type(exc).__name__}: {one_line(exc) or 'no answer'}): "
            f"start the server, or fix --base-url"
        ) from None
    if response.status_code in (401, 403):
        fix = "check --api-key" if settings.api_key else "pass the server's key with --api-key"
        raise ServerError(
            f"{url} refused the request ({_error_message(response.status_code, response.content)}): {fix}"
        )
    if response.status_code != 200:
        raise ServerError(
            f"GET {url} answered {_error_message(response.status_code, response.content)}: --base-url must be the "
            f"root of an OpenAI-compatible server (http://HOST:PORT, no path)"
        )
    try:
        return [str(m["id"]) for m in response.json()["data"]]
    except (ValueError, KeyError, TypeError):
        raise ServerError(
            f"GET {url} did not answer a model list: --base-url must be the root of an OpenAI-compatible server"
        ) from None
