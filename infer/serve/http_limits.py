"""What keeps one slow or greedy client from holding the server: the HTTP half of `ServeLimits`.

`BodyLimits` (ASGI middleware) reads each request's body before the app does: a Content-Length
past `max_request_bytes` is a 413 at once, a chunked body is counted as it arrives and refused
once past it (no more of it is read), and a body with no byte for `body_timeout_s` (one shorter
than its Content-Length included) is a 408. Both close the connection. The app gets the body
whole, as FastAPI would have read it anyway.

`HeaderTimeout` (uvicorn's h11 protocol) closes a connection that has not sent a request's whole
headers `header_timeout_s` after it opened or after its last response (a 408 if it sent some),
so connections trickling headers (slowloris) cannot pile up; an idle keep-alive connection is
closed after `keep_alive_timeout_s` (uvicorn's own timer). `uvicorn_options(limits)` is what
uvicorn.Config takes for them.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from infer.serve.errors import APIError
from infer.serve.limits import ServeLimits

__all__ = ["BodyLimits", "HeaderTimeout", "uvicorn_options"]


def uvicorn_options(limits: ServeLimits) -> dict[str, Any]:
    """uvicorn.Config's keyword arguments for `limits`: `uvicorn.Config(app, host=..., **uvicorn_options(limits))`."""
    return {
        "http": functools.partial(HeaderTimeout, header_timeout_s=limits.header_timeout_s),
        "timeout_keep_alive": limits.keep_alive_timeout_s,
    }


class _TooLarge(Exception):
    pass


class _Gone(Exception):
    pass


class BodyLimits:
    """Reads a request's body within `limits` (413 past its size, 408 when it stalls), then runs the app."""

    def __init__(self, app: Any, limits: ServeLimits) -> None:
        self.app, self.limits = app, limits

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        try:
            if declared is not None and declared > self.limits.max_request_bytes:
                raise _TooLarge
            body = await self._read(receive)
        except _TooLarge:
            await _refuse(send, self._too_large())
            return
        except TimeoutError:
            await _refuse(send, self._too_slow())
            return
        except _Gone:
            return  # nobody to answer
        await self.app(scope, _replaying(body, receive), send)

    async def _read(self, receive: Any) -> bytes:
        chunks: list[bytes] = []
        size, more = 0, True
        while more:
            message = await asyncio.wait_for(receive(), self.limits.body_timeout_s)
            if message["type"] == "http.disconnect":
                raise _Gone
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.limits.max_request_bytes:
                raise _TooLarge
            chunks.append(chunk)
            more = message.get("more_body", False)
        return b"".join(chunks)

    def _too_large(self) -> APIError:
        limit = self.limits.max_request_bytes
        return APIError(
            413,
            f"the request body is larger than this server's {limit} bytes: send a smaller one, or start the "
            "server with a higher --max-request-bytes",
            code="request_too_large",
        )

    def _too_slow(self) -> APIError:
        return APIError(
            408,
            f"the request body stopped arriving (nothing for {self.limits.body_timeout_s:g} s, or fewer bytes "
            "than its Content-Length): send the whole body at once, or start the server with a higher "
            "--body-timeout",
            code="request_timeout",
        )


def _content_length(scope: dict[str, Any]) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            return int(value) if value.isdigit() else None  # h11 refuses a malformed one before us
    return None


def _replaying(body: bytes, receive: Any) -> Any:
    """A `receive` giving the app `body` whole, then what the client sends next (its disconnect)."""
    sent = False

    async def replay() -> dict[str, Any]:
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replay


async def _refuse(send: Any, error: APIError) -> None:
    """`error` with Connection: close: the rest of the body is never read."""
    body = json.dumps(error.body()).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"connection", b"close"),
    ]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class HeaderTimeout(H11Protocol):
    """uvicorn's h11 protocol, closing a connection whose request headers are not whole `header_timeout_s`
    after it opened or after its last response."""

    def __init__(self, *args: Any, header_timeout_s: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.header_timeout_s = header_timeout_s
        self.header_timer: asyncio.TimerHandle | None = None  # armed while a request's headers are awaited

    # uvicorn's H11Protocol narrows asyncio's BaseTransport to Transport itself: its override, kept as it is
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._await_headers()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._await_headers()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._await_headers()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_timer()
        super().connection_lost(exc)

    def _await_headers(self) -> None:
        """Arms the timer while the client owes a request's headers (h11: their state IDLE), once per request:
        bytes trickling in do not push the deadline back."""
        if self.conn.their_state is not h11.IDLE or self.transport.is_closing():
            self._stop_timer()
        elif self.header_timer is None:
            self.header_timer = self.loop.call_later(self.header_timeout_s, self._timed_out)

    def _stop_timer(self) -> None:
        if self.header_timer is not None:
            self.header_timer.cancel()
            self.header_timer = None

    def _timed_out(self) -> None:
        self.header_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        if self.conn.trailing_data[0]:  # part of a request came: say why it is dropped
            self.transport.write(_raw_408(self.header_timeout_s))
        with contextlib.suppress(h11.LocalProtocolError):
            self.conn.send(h11.ConnectionClosed())
        self.transport.close()


def _raw_408(timeout_s: float) -> bytes:
    """A 408 written past h11, which answers only requests whose headers came."""
    message = (
        f"the request's headers did not arrive within {timeout_s:g} s: send them at once, or start the server "
        "with a higher --header-timeout"
    )
    body = json.dumps(APIError(408, message, code="request_timeout").body()).encode()
    head = f"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
    return head.encode() + b"connection: close\r\n\r\n" + body
