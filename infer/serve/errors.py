"""Every error the server answers, in OpenAI's shape: {"error": {"message", "type", "param", "code"}}.

Bad input is a 400 (pydantic's validation errors included), an unknown model a 404, a missing or
wrong API key a 401, a full waiting queue a 429 with Retry-After, a body too large a 413 and one
too slow a 408 (`http_limits`); only the server's own failures are 5xx: a step that failed a 500,
an engine that stopped (`EngineDeadError`) or a server that is shutting down (`ShuttingDownError`) a
503, whose request was fine and may be retried (never a 400). No traceback reaches a client.
"""

from __future__ import annotations

import itertools
import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from infer.api.errors import InferError, RequestError, one_line
from infer.serve import output_protocol, protocol
from infer.serve.async_engine import QueueFullError
from infer.serve.engine_thread import EngineDeadError, EngineStepError, ShuttingDownError
from infer.serve.protocol import Refused

RETRY_AFTER_S = 1  # what a 429 asks a client to wait
# the request fields a validation error's location may name (the rest of a location are pydantic's
# union-member tags, "constrained-str" and the like, which name no parameter)
FIELDS = frozenset(
    field.alias or name
    for model in (protocol.CompletionRequest, protocol.ChatRequest, protocol.ChatMessage, protocol.TextPart,
                  protocol.StreamOptions, protocol.TokenizeRequest, protocol.DetokenizeRequest,
                  output_protocol.ResponseFormat, output_protocol.JsonSchemaFormat, output_protocol.Tool,
                  output_protocol.FunctionDefinition, output_protocol.NamedToolChoice, output_protocol.FunctionName)
    for name, field in model.model_fields.items()
)  # fmt: skip


class APIError(Exception):
    """An error answered as is: its status, OpenAI's error type, the field at fault."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self, path: str = "") -> JSONResponse:
        """The answer; on Anthropic's route (/v1/messages) in Anthropic's error shape."""
        body = self.anthropic_body() if path.startswith(ANTHROPIC_PATH) else self.body()
        return JSONResponse(body, status_code=self.status, headers=self.headers)

    def anthropic_body(self) -> dict[str, Any]:
        kind = ANTHROPIC_ERROR_TYPES.get(self.status, "api_error")
        return {"type": "error", "error": {"type": kind, "message": self.message}}


ANTHROPIC_PATH = "/v1/messages"
ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
    405: "invalid_request_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error",
}  # fmt: skip


def api_error(exc: BaseException) -> APIError:
    """The answer to an exception raised while serving a request."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, Refused):
        return APIError(400, str(exc), param=exc.param, code="unsupported_parameter")
    if isinstance(exc, QueueFullError):
        headers = {"Retry-After": str(RETRY_AFTER_S)}
        return APIError(429, one_line(exc), "rate_limit_exceeded", code="queue_full", headers=headers)
    if isinstance(exc, EngineStepError):
        return APIError(500, one_line(exc), "server_error")
    if isinstance(exc, EngineDeadError):
        return APIError(503, one_line(exc), "server_error", code="engine_dead")
    if isinstance(exc, ShuttingDownError):
        return APIError(503, one_line(exc), "server_error", code="server_shutting_down")
    if isinstance(exc, RequestError):
        return APIError(400, one_line(exc), param=_param_of(str(exc)))
    if isinstance(exc, InferError):
        return APIError(400, one_line(exc))
    return APIError(
        500, f"the server failed ({type(exc).__name__}): retry, and report it if it persists", "server_error"
    )


def _param_of(message: str) -> str | None:
    """SamplingParams' messages start 'invalid FIELD=...' (or 'invalid FIELD: ...', FIELD.PART, FIELD[KEY]):
    FIELD is the request's parameter too (`structured` is the request field that constrains the output)."""
    found = re.match(r"invalid ([A-Za-z_]+)[=:. []", message)
    return found.group(1) if found else None


def validation_error(exc: RequestValidationError) -> APIError:
    problems = exc.errors()
    first = problems[0] if problems else {"loc": (), "msg": "invalid request"}
    loc = list(first.get("loc", ()))
    loc = loc[1:] if loc[:1] == ["body"] else loc
    if first.get("type") == "extra_forbidden":
        param = ".".join(map(str, loc))
        return APIError(
            400, f"unrecognized request argument {param!r}: drop it (GET /openapi.json lists the fields)", param=param
        )
    # the body's own field, then the nested fields and indices down to the first union tag ("list[str]")
    inner = itertools.takewhile(lambda part: isinstance(part, int) or part in FIELDS, loc[1:])
    param = ".".join(map(str, [*loc[:1], *inner])) or None
    where = f"{param}: " if param else ""
    more = len(problems) - 1
    also = f" (and {more} more problem{'s' if more > 1 else ''})" if more > 0 else ""
    return APIError(400, f"{where}{first.get('msg', 'invalid')}{also}: fix the request body", param=param)


def install(app: FastAPI) -> None:
    """Route every error through `api_error`."""

    # Starlette types a handler as taking any Exception; it calls each with the kind it was added for
    async def on_validation(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        return validation_error(exc).response(request.url.path)

    async def on_http(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        kind = {401: "authentication_error", 404: "not_found_error"}.get(exc.status_code, "invalid_request_error")
        message = (
            f"{exc.detail}: see GET /openapi.json for the routes" if exc.status_code in (404, 405) else str(exc.detail)
        )
        headers = dict(exc.headers) if exc.headers else None
        return APIError(exc.status_code, message, kind, headers=headers).response(request.url.path)

    async def on_error(request: Request, exc: Exception) -> JSONResponse:
        return api_error(exc).response(request.url.path)

    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(StarletteHTTPException, on_http)
    for kind in (APIError, InferError, Refused):
        app.add_exception_handler(kind, on_error)
    app.add_exception_handler(Exception, on_error)
