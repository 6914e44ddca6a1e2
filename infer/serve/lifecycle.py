"""Whether the server takes requests, and how many it is answering: what a graceful shutdown waits on.

One `Lifecycle` is shared by the app (`create_app(..., lifecycle=...)`, whose `Admission` middleware
is outermost) and by the server that stops it (`server.Server`). While `stopping` is None every
request is admitted and counted in `num_active` until its answer is sent (a stream until its
`[DONE]`). Once a shutdown begins (`stop_accepting(reason)`) every new request, /health included, is
a 503 in OpenAI's shape with `reason` as its message and `Connection: close` (a load balancer or a
client's retry goes elsewhere), while the server waits for `num_active` to reach 0. /metrics is
neither refused nor counted: a scraper sees the drain.
"""

from __future__ import annotations

from typing import Any

from infer.serve.errors import APIError

__all__ = ["Admission", "Lifecycle"]

UNCOUNTED = frozenset({"/metrics"})  # answered while stopping too, and never waited for


class Lifecycle:
    """Changed on the event loop only."""

    def __init__(self) -> None:
        self.stopping: str | None = None  # why new requests are refused (the 503's message); None: serving
        self.code = "server_shutting_down"  # the 503's error code
        self.num_active = 0  # HTTP requests admitted and not yet answered

    def stop_accepting(self, reason: str, code: str = "server_shutting_down") -> None:
        """From now on a new request is a 503 saying `reason` (the first reason given stays)."""
        if self.stopping is None:
            self.stopping, self.code = reason, code

    def refusal(self) -> APIError:
        assert self.stopping is not None
        return APIError(503, self.stopping, "server_error", code=self.code, headers={"Connection": "close"})


class Admission:
    """ASGI middleware: counts each request while it is answered; refuses new ones once `lifecycle` stops."""

    def __init__(self, app: Any, lifecycle: Lifecycle) -> None:
        self.app, self.lifecycle = app, lifecycle

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] in UNCOUNTED:
            await self.app(scope, receive, send)
            return
        lifecycle = self.lifecycle
        if lifecycle.stopping is not None:  # its body is never read: the connection closes after the answer
            await lifecycle.refusal().response()(scope, receive, send)
            return
        lifecycle.num_active += 1
        try:
            await self.app(scope, receive, send)
        finally:
            lifecycle.num_active -= 1
