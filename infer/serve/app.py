"""The OpenAI-compatible app: `create_app({"model name": AsyncEngine, ...})` -> a FastAPI app.

Requests may constrain their output (response_format, vLLM's structured_outputs and guided_*) and
chats may pass tools; with `tool_call_parser` (hermes, llama3_json) tool_choice "auto" reads the
calls a model writes in its text (`constrained`, `tool_parsers`).

    POST /v1/completions, /v1/chat/completions   JSON, or server-sent events with "stream": true
    GET  /v1/models                              the served models (requests route by `model`)
    POST /tokenize, /detokenize                  vLLM's shapes
    GET  /health, /metrics                       liveness; Prometheus text

With `api_key`, /v1/* and /(de)tokenize need `Authorization: Bearer <key>`; /health and /metrics
stay open to the probes and scrapers of the network the server is on. The app does not own the
engines: whoever made them closes them.
"""

from __future__ import annotations

import contextlib
import secrets
from typing import Any, Iterator, Mapping

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from infer import __version__
from infer.core.errors import ConfigError, RequestError, one_line
from infer.inputs.chat_template import check_template_kwargs, render_chat, template_for
from infer.serve import errors
from infer.serve.async_engine import AsyncEngine
from infer.serve.constrained import output_rules
from infer.serve.errors import APIError
from infer.serve.formats import ChatFormat, CompletionFormat
from infer.serve.generation import Generation, answer, max_tokens_rule
from infer.serve.metrics import ServeMetrics
from infer.serve.protocol import (
    ChatCompletion,
    ChatRequest,
    Completion,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from infer.serve.served import ServedModel
from infer.serve.tool_parsers import PARSERS

__all__ = ["create_app"]

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions (chat: all the context left)
ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse, "description": text}
    for code, text in [
        (400, "A bad parameter or prompt"),
        (401, "No or a wrong API key"),
        (404, "No such model"),
        (429, "The waiting queue is full: retry after Retry-After seconds"),
        (500, "The engine failed"),
    ]
}


def _streamed(model: type) -> dict[int | str, dict[str, Any]]:
    content = {"text/event-stream": {"schema": {"type": "string", "description": "with stream: chunks, then [DONE]"}}}
    return {200: {"model": model, "content": content}, **ERRORS}


def create_app(
    engines: Mapping[str, AsyncEngine], api_key: str | None = None, tool_call_parser: str | None = None
) -> FastAPI:
    """tool_call_parser: the format of the calls models write in their text (a name in `PARSERS`), read
    for chats with tool_choice "auto"; None: such chats are refused."""
    if not engines:
        raise ConfigError("serve at least one model: give --model NAME")
    if tool_call_parser is not None and tool_call_parser not in PARSERS:
        raise ConfigError(f"unknown tool-call parser {tool_call_parser!r}: use one of {', '.join(PARSERS)}")
    models = Models({name: ServedModel(name, engine) for name, engine in engines.items()})
    metrics = ServeMetrics(models.values())
    app = FastAPI(title="infer", version=__version__, summary="An OpenAI-compatible server over infer's engines.")
    app.state.models, app.state.metrics = models, metrics
    errors.install(app)
    guarded = [Depends(_bearer(api_key))] if api_key else []

    @app.get("/health", responses=ERRORS)
    async def health() -> JSONResponse:
        down = [name for name, m in models.items() if not m.engine.is_alive]
        if down:
            raise APIError(503, f"the engine of {', '.join(down)} stopped: restart the server", "server_error")
        return JSONResponse({"status": "ok"})

    @app.get("/metrics", response_class=Response)
    async def prometheus() -> Response:
        return Response(await metrics.scrape(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", dependencies=guarded, responses=ERRORS)
    async def list_models() -> ModelList:
        cards = [ModelCard(id=m.name, created=m.created, max_model_len=m.max_model_len) for m in models.values()]
        return ModelList(data=cards)

    _generation_routes(app, models, metrics, guarded, tool_call_parser)
    _token_routes(app, models, guarded)
    return app


class Models(dict[str, ServedModel]):
    """The served models by name."""

    def named(self, name: str | None) -> ServedModel:
        """The model a request names (None: the only one, if there is one); a 404 names the others."""
        if name is None and len(self) == 1:
            return next(iter(self.values()))
        served = self.get(name) if name is not None else None
        if served is None:
            raise APIError(
                404 if name is not None else 400,
                f"the model {name!r} is not served here: use one of {', '.join(self)} (GET /v1/models)",
                "not_found_error" if name is not None else "invalid_request_error",
                param="model",
                code="model_not_found",
            )
        return served


def _generation_routes(
    app: FastAPI, models: Models, metrics: ServeMetrics, guarded: list[Any], tool_call_parser: str | None
) -> None:
    @app.post("/v1/completions", dependencies=guarded, response_model=None, responses=_streamed(Completion))
    async def completions(req: CompletionRequest, request: Request) -> Response:
        served = models.named(req.model)
        with _counted(metrics, served):
            req.refuse()
            rules = output_rules(req)
            with _about("prompt"):
                prompts = [served.engine.engine.tokenize(p)[1] for p in req.prompts()]
            default = COMPLETIONS_DEFAULT_MAX_TOKENS
            limit = max_tokens_rule(req.max_tokens, default, served.max_model_len, "max_tokens", "prompt")
            gen = Generation.start("cmpl", served, metrics, req, prompts, limit, req.logprobs, rules)
        return await answer(gen, CompletionFormat(), bool(req.stream), request)

    @app.post("/v1/chat/completions", dependencies=guarded, response_model=None, responses=_streamed(ChatCompletion))
    async def chat_completions(req: ChatRequest, request: Request) -> Response:
        served = models.named(req.model)
        with _counted(metrics, served):
            req.refuse()
            rules = output_rules(req, tool_call_parser)
            with _about("messages"):
                ids = _chat_ids(served, req.messages, True, req.chat_template_kwargs, rules.tools)
            param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
            limit = max_tokens_rule(req.max_new_tokens, None, served.max_model_len, param, "messages")
            gen = Generation.start("chatcmpl", served, metrics, req, [ids], limit, req.num_logprobs, rules)
        return await answer(gen, ChatFormat(rules.parser), bool(req.stream), request)


def _token_routes(app: FastAPI, models: Models, guarded: list[Any]) -> None:
    @app.post("/tokenize", dependencies=guarded, responses=ERRORS)
    async def tokenize(req: TokenizeRequest) -> TokenizeResponse:
        served = models.named(req.model)
        tokenizer = _tokenizer(served)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give exactly one of prompt (text) or messages (a chat)", param="prompt")
        if req.messages is not None:
            ids = _chat_ids(served, req.messages, req.add_generation_prompt, None, None)
        else:
            ids = list(tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens))
        return TokenizeResponse(count=len(ids), max_model_len=served.max_model_len, tokens=ids)

    @app.post("/detokenize", dependencies=guarded, responses=ERRORS)
    async def detokenize(req: DetokenizeRequest) -> DetokenizeResponse:
        served = models.named(req.model)
        tokenizer = _tokenizer(served)
        vocab_size = served.engine.engine.parts.vocab_size
        if any(t >= vocab_size for t in req.tokens):
            raise APIError(400, f"token ids must be in [0, {vocab_size}): fix the list", param="tokens")
        return DetokenizeResponse(prompt=tokenizer.decode(req.tokens))


@contextlib.contextmanager
def _about(param: str) -> Iterator[None]:
    """A RequestError raised inside is about the request's `param`."""
    try:
        yield
    except RequestError as exc:
        raise APIError(400, one_line(exc), param=param) from exc


@contextlib.contextmanager
def _counted(metrics: ServeMetrics, served: ServedModel) -> Iterator[None]:
    """Counts a request refused before it runs (a 4xx) or failing to start (a 5xx) in its model's outcomes."""
    try:
        yield
    except Exception as exc:
        status = errors.api_error(exc).status
        metrics.ended(served.name, "rejected" if status < 500 else "failed")
        raise


def _tokenizer(served: ServedModel) -> Any:
    if served.tokenizer is None:
        raise APIError(400, f"the model {served.name!r} has no tokenizer: send token ids", param="model")
    return served.tokenizer


def _chat_ids(
    served: ServedModel, messages: list[Any], add_generation_prompt: bool, kwargs: Any, tools: list[Any] | None
) -> list[int]:
    """The conversation's prompt ids, rendered as LLM.chat renders it (the model's or --chat-template's)."""
    tokenizer = served.tokenizer
    template = template_for(tokenizer)
    checked = check_template_kwargs(tokenizer, kwargs)
    return render_chat(tokenizer, [m.for_template() for m in messages], template, add_generation_prompt, checked, tools)


def _bearer(api_key: str) -> Any:
    expected = f"Bearer {api_key}".encode()

    async def check(request: Request) -> None:
        given = request.headers.get("authorization", "").encode()
        if not secrets.compare_digest(given, expected):
            raise APIError(
                401,
                "no valid API key: send the server's --api-key as the header 'Authorization: Bearer KEY'",
                "authentication_error",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )

    return check
