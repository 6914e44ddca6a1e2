"""The OpenAI-compatible app: `create_app({"model name": AsyncEngine, ...})` -> a FastAPI app.

Requests may constrain their output (response_format, vLLM's structured_outputs and guided_*) and
chats may pass tools; with `tool_call_parser` (hermes, llama3_json) tool_choice "auto" reads the
calls a model writes in its text (`constrained`, `tool_parsers`).

    POST /v1/completions, /v1/chat/completions   JSON, or server-sent events with "stream": true
    POST /v1/responses, /v1/messages             OpenAI's Responses API; Anthropic's Messages API
    POST /v1/embeddings                          each input's embedding (`embeddings`)
    GET  /v1/models                              the served models (requests route by `model`)
    POST /tokenize, /detokenize                  vLLM's shapes
    GET  /health, /metrics                       liveness; Prometheus text

With `api_key`, every route but /health needs `Authorization: Bearer <key>` (the scheme in any
case): /v1/*, /(de)tokenize, /openapi.json, and /metrics unless `metrics_public` (for a scraper
that sends no key). /docs and /redoc are off (they load their pages from a CDN); GET /openapi.json
describes every route, with the `limits` (`ServeLimits`) it can state. Requests past the limits are
refused before any work: bodies and slow clients by `http_limits`, fields by `request_limits`.
The app does not own the engines: whoever made them closes them (and stops the `lifecycle`, whose
`Admission` answers 503 to new requests once a shutdown begins: `server.Server` does both).

/health is a 503 while an engine is stopped (dead, or being restarted) and while the server shuts
down; a request to a stopped engine is a 503 (`EngineDeadError`), never a 400. /metrics reads what the
engines last published (`metrics`) and answers whatever their state.
"""

from __future__ import annotations

import contextlib
import functools
import secrets
from typing import Any, Iterator, Mapping, Sequence

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from infer import __version__
from infer.api.adapters import LoRARequest
from infer.api.errors import ConfigError, RequestError, one_line
from infer.core.registry import PluginRegistry
from infer.inputs.chat_template import check_template_kwargs, render_chat, template_for
from infer.inputs.prompts import check_encodable
from infer.serve import embeddings, errors
from infer.serve.adapters import AdapterNames
from infer.serve.adapters import install as install_adapter_routes
from infer.serve.answers import (
    ChatCompletion,
    Completion,
    DetokenizeResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    TokenizeResponse,
)
from infer.serve.anthropic import AnthropicErrorResponse, AnthropicFormat, AnthropicMessage, MessagesRequest
from infer.serve.async_engine import AsyncEngine
from infer.serve.constrained import output_rules
from infer.serve.errors import APIError
from infer.serve.formats import ChatFormat, CompletionFormat
from infer.serve.generation import Generation, answer, max_tokens_rule
from infer.serve.http_limits import BodyLimits
from infer.serve.lifecycle import Admission, Lifecycle
from infer.serve.limits import ServeLimits
from infer.serve.metrics import ServeMetrics
from infer.serve.offload import Offload, longest_token_chars, refuse_long_text
from infer.serve.protocol import ChatRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from infer.serve.request_limits import check_request, openapi_limits
from infer.serve.responses import (
    RESPONSES_NAMES,
    ResponseObject,
    ResponsesFormat,
    ResponsesRequest,
    ResponseStore,
    renamed,
)
from infer.serve.served import ServedModel
from infer.serve.tool_parsers import PARSERS
from infer.serve.tracing import end_span, start_span

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
        (503, "The engine stopped (it died, or is being restarted) or the server is shutting down: retry"),
    ]
}


ANTHROPIC_ERRORS: dict[int | str, dict[str, Any]] = {
    200: {
        "model": AnthropicMessage,
        "content": {"text/event-stream": {"schema": {"type": "object", "description": "with stream: named events"}}},
    },
    **{code: {"model": AnthropicErrorResponse, "description": e["description"]} for code, e in ERRORS.items()},
}


def _streamed(model: type) -> dict[int | str, dict[str, Any]]:
    # before OpenAPI 3.2, an event stream's `schema` is each event's: its data a chunk's JSON, then [DONE]
    event = {"type": "object", "properties": {"data": {"type": "string"}}, "required": ["data"]}
    content = {"text/event-stream": {"schema": {**event, "description": "with stream: chunks, then [DONE]"}}}
    return {200: {"model": model, "content": content}, **ERRORS}


def create_app(
    engines: Mapping[str, AsyncEngine],
    api_key: str | None = None,
    tool_call_parser: str | None = None,
    *,
    reasoning_parser: str | None = None,
    tracer: Any = None,
    limits: ServeLimits | None = None,
    metrics_public: bool = False,
    lifecycle: Lifecycle | None = None,
    adapters: Mapping[str, Sequence[LoRARequest]] | None = None,
    allow_adapter_updates: bool = False,
    metrics_dir: str | None = None,
    response_store: Any = None,
) -> FastAPI:
    """tool_call_parser: the format of the calls models write in their text (a name in `PARSERS`), read
    for chats with tool_choice "auto"; None: such chats are refused. reasoning_parser: the reasoning parser
    plugin that splits each chat's reasoning (`reasoning_content`) from its answer; None: all is content. tracer: an
    OpenTelemetry tracer for a span per request (`tracing.otlp_tracer`); None: none. limits: None: ServeLimits()'s
    defaults. metrics_public: /metrics needs no key even with `api_key`. lifecycle: what a shutdown
    stops (None: one of the app's own, never stopped). adapters: per served model, the adapters its engine
    serves already (`--lora-modules`), each served as a model of its own name; allow_adapter_updates: the
    load and unload routes answer (`adapters`). metrics_dir: prometheus_client's multiprocess directory, for
    /metrics to sum the counters of every API server process (`fronts`); response_store: where responses are
    kept for previous_response_id (None: this app's own store; `fronts` shares one among its processes)."""
    if not engines:
        raise ConfigError("serve at least one model: give --model NAME")
    if tool_call_parser is not None and tool_call_parser not in PARSERS:
        raise ConfigError(f"unknown tool-call parser {tool_call_parser!r}: use one of {', '.join(PARSERS)}")
    reasoning = None if reasoning_parser is None else PluginRegistry.load().get("reasoning_parser", reasoning_parser)
    models = Models({
        name: ServedModel(name, engine, reasoning=None if reasoning is None else reasoning.factory(engine.tokenizer))
        for name, engine in engines.items()
    })  # fmt: skip
    models.offload = Offload()  # tokenizing and chat templates run here, off the event loop
    models.adapters = AdapterNames()
    models.responses = ResponseStore(held_by=response_store)
    for base, loras in (adapters or {}).items():
        for lora in loras:
            if lora.lora_name in models or lora.lora_name in models.adapters.served:
                raise ConfigError(f"adapter {lora.lora_name!r} has the name of another served model: rename it")
            models.adapters.served[lora.lora_name] = models[base].adapter(lora)
    metrics = ServeMetrics(models.values(), metrics_dir)
    limits = limits or ServeLimits()
    app = FastAPI(
        title="infer",
        version=__version__,
        summary="An OpenAI-compatible server over infer's engines.",
        docs_url=None,  # Swagger UI and ReDoc load from a CDN: blank offline
        redoc_url=None,
        openapi_url=None,  # served below, behind the key
    )
    app.state.models, app.state.metrics, app.state.limits = models, metrics, limits
    errors.install(app)
    app.add_middleware(BodyLimits, limits=limits)
    app.add_middleware(Admission, lifecycle=lifecycle or Lifecycle())  # outermost: refused before the body is read
    guarded = [Depends(_bearer(api_key))] if api_key else []

    @app.get("/health", responses=ERRORS)
    async def health() -> JSONResponse:
        down = [
            f"the engine of {name} stopped" + (" and is being restarted" if m.engine.restarting else "")
            for name, m in models.items()
            if not m.engine.is_alive
        ]
        if down:
            raise APIError(503, "; ".join(down), "server_error", code="engine_dead")
        return JSONResponse({"status": "ok"})

    @app.get("/metrics", response_class=Response, dependencies=[] if metrics_public else guarded)
    async def prometheus() -> Response:
        return Response(metrics.scrape(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", dependencies=guarded, responses=ERRORS)
    async def list_models() -> ModelList:
        every = [*models.values(), *models.adapters.served.values()]
        cards = [
            ModelCard(
                id=m.name, created=m.created, max_model_len=m.max_model_len, root=m.lora.lora_path if m.lora else None,
                parent=m.parent,
            )
            for m in every
        ]  # fmt: skip
        return ModelList(data=cards)

    _generation_routes(app, models, metrics, guarded, tool_call_parser, limits, tracer)
    _token_routes(app, models, guarded)
    _embedding_route(app, models, metrics, guarded)
    install_adapter_routes(app, models, guarded, allow_adapter_updates, ERRORS)
    _openapi_route(app, guarded, limits)
    return app


class Models(dict[str, ServedModel]):
    """The served models by name, and the pool their prompts are tokenized in."""

    offload: Offload  # set by create_app
    adapters: AdapterNames  # set by create_app: adapters served under names of their own
    responses: ResponseStore  # set by create_app: for previous_response_id

    def refuse_long(self, served: ServedModel, num_chars: int, param: str) -> None:
        """A 400 for text longer than the model's context holds in any tokenization, before encoding it."""
        bounds = self.__dict__.setdefault("_chars_per_token", {})
        if served.name not in bounds:
            bounds[served.name] = longest_token_chars(served.tokenizer)
        refuse_long_text(num_chars, bounds[served.name], served.max_model_len, param)

    def named(self, name: str | None) -> ServedModel:
        """The model a request names (None: the only one, if there is one); a 404 names the others."""
        if name is None and len(self) == 1:
            return next(iter(self.values()))
        served = (self.get(name) or self.adapters.served.get(name)) if name is not None else None
        if served is None:
            raise APIError(
                404 if name is not None else 400,
                f"the model {name!r} is not served here: use one of {', '.join([*self, *self.adapters.served])} "
                f"(GET /v1/models)",
                "not_found_error" if name is not None else "invalid_request_error",
                param="model",
                code="model_not_found",
            )
        return served


def _generation_routes(
    app: FastAPI,
    models: Models,
    metrics: ServeMetrics,
    guarded: list[Any],
    tool_call_parser: str | None,
    limits: ServeLimits,
    tracer: Any,
) -> None:
    @app.post("/v1/completions", dependencies=guarded, response_model=None, responses=_streamed(Completion))
    async def completions(req: CompletionRequest, request: Request) -> Response:
        served = models.named(req.model)
        span = start_span(tracer, "text_completion", served.name, request.headers, _span_settings(req, req.max_tokens))
        with _counted(metrics, served), _spanning(span):
            req.refuse()
            check_request(req, limits)
            rules = output_rules(req)
            with _about("prompt"):
                num_chars = [len(p) for p in req.prompts() if isinstance(p, str)]
                for n in num_chars:
                    models.refuse_long(served, n, "prompt")
                prompts = await models.offload.run(sum(num_chars), _tokenize_all, served, req.prompts())
            default = COMPLETIONS_DEFAULT_MAX_TOKENS
            limit = max_tokens_rule(req.max_tokens, default, served.max_model_len, "max_tokens", "prompt")
            gen = Generation.start("cmpl", served, metrics, req, prompts, limit, req.logprobs, rules)
            gen.span = span
            echo = [_prompt_text(served, p, ids) for p, ids in zip(req.prompts(), prompts)] if req.echo else None
        return await answer(gen, CompletionFormat(echo), bool(req.stream), request)

    @app.post("/v1/chat/completions", dependencies=guarded, response_model=None, responses=_streamed(ChatCompletion))
    async def chat_completions(req: ChatRequest, request: Request) -> Response:
        gen, rules = await chat_generation(req, request)
        served = gen.served
        return await answer(gen, ChatFormat(rules.parser, served.reasoning), bool(req.stream), request)

    @app.post("/v1/messages", dependencies=guarded, response_model=None, responses=ANTHROPIC_ERRORS)
    async def messages(req: MessagesRequest, request: Request) -> Response:
        """Anthropic's Messages API, over the chat completions machinery (`anthropic`)."""
        gen, rules = await chat_generation(req.to_chat(), request)
        chat = ChatFormat(rules.parser, gen.served.reasoning)
        return await answer(gen, AnthropicFormat(chat), bool(req.stream), request)

    store = models.responses  # the newest responses, for previous_response_id

    @app.post("/v1/responses", dependencies=guarded, response_model=None, responses=_streamed(ResponseObject))
    async def responses(req: ResponsesRequest, request: Request) -> Response:
        """OpenAI's Responses API, over the chat completions machinery (`responses`)."""
        history = store.history(req.previous_response_id)
        try:
            gen, rules = await chat_generation(req.to_chat(history), request)
        except APIError as exc:  # the chat's field names, as this API spells them
            raise renamed(exc, RESPONSES_NAMES) from exc
        chat = ChatFormat(rules.parser, gen.served.reasoning)
        return await answer(gen, ResponsesFormat(chat, req, history + req.messages(), store), bool(req.stream), request)

    @app.get("/v1/responses/{response_id}", dependencies=guarded, responses=ERRORS)
    async def stored_response(response_id: str) -> JSONResponse:
        return JSONResponse(store.get(response_id))

    async def chat_generation(req: ChatRequest, request: Request) -> tuple[Generation, Any]:
        served = models.named(req.model)
        span = start_span(tracer, "chat", served.name, request.headers, _span_settings(req, req.max_new_tokens))
        with _counted(metrics, served), _spanning(span):
            req.refuse()
            check_request(req, limits)
            rules = output_rules(req, tool_call_parser)
            with _about("messages"):
                num_chars = _num_chars(req.messages) + (len(str(rules.tools)) if rules.tools else 0)
                models.refuse_long(served, num_chars, "messages")
                ids = await models.offload.run(
                    num_chars, _chat_ids, served, req.messages, True, req.template_kwargs(), rules.tools
                )
            param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
            limit = max_tokens_rule(req.max_new_tokens, None, served.max_model_len, param, "messages")
            gen = Generation.start("chatcmpl", served, metrics, req, [ids], limit, req.num_logprobs, rules)
            gen.span = span
        return gen, rules


def _span_settings(req: Any, max_tokens: int | None) -> dict[str, Any]:
    return {"max_tokens": max_tokens, "temperature": req.temperature, "top_p": req.top_p, "seed": req.seed}


@contextlib.contextmanager
def _spanning(span: Any) -> Iterator[None]:
    """A request refused before it reached the engine ends its span with the error."""
    try:
        yield
    except BaseException as exc:
        end_span(span, {}, str(exc) or type(exc).__name__)
        raise


def _prompt_text(served: ServedModel, prompt: str | list[int], ids: list[int]) -> str:
    """What echo writes before a prompt's output: the text as sent, or token ids' text (none without a tokenizer)."""
    if isinstance(prompt, str):
        return prompt
    tokenizer = served.tokenizer
    return tokenizer.decode(ids) if tokenizer is not None else ""


def _token_routes(app: FastAPI, models: Models, guarded: list[Any]) -> None:
    @app.post("/tokenize", dependencies=guarded, responses=ERRORS)
    async def tokenize(req: TokenizeRequest) -> TokenizeResponse:
        served = models.named(req.model)
        tokenizer = _tokenizer(served)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give exactly one of prompt (text) or messages (a chat)", param="prompt")
        if req.messages is not None:
            with _about("messages"):
                num_chars = _num_chars(req.messages)
                models.refuse_long(served, num_chars, "messages")
                chat = functools.partial(_chat_ids, served, req.messages, req.add_generation_prompt, None, None)
                ids = await models.offload.run(num_chars, chat)
        else:
            with _about("prompt"):
                check_encodable(req.prompt, "prompt")
                models.refuse_long(served, len(req.prompt), "prompt")
            encode = functools.partial(tokenizer.encode, req.prompt, add_special_tokens=req.add_special_tokens)
            ids = list(await models.offload.run(len(req.prompt), encode))
        return TokenizeResponse(count=len(ids), max_model_len=served.max_model_len, tokens=ids)

    @app.post("/detokenize", dependencies=guarded, responses=ERRORS)
    async def detokenize(req: DetokenizeRequest) -> DetokenizeResponse:
        served = models.named(req.model)
        tokenizer = _tokenizer(served)
        vocab_size = served.engine.engine.parts.vocab_size
        if any(t >= vocab_size for t in req.tokens):
            raise APIError(400, f"token ids must be in [0, {vocab_size}): fix the list", param="tokens")
        return DetokenizeResponse(prompt=tokenizer.decode(req.tokens))


def _embedding_route(app: FastAPI, models: Models, metrics: ServeMetrics, guarded: list[Any]) -> None:
    @app.post("/v1/embeddings", dependencies=guarded, response_model=embeddings.EmbeddingResponse, responses=ERRORS)
    async def create_embeddings(req: embeddings.EmbeddingRequest, request: Request) -> Response:
        served = models.named(req.model)
        with _counted(metrics, served):
            with _about("input"):
                num_chars = [len(p) for p in req.inputs() if isinstance(p, str)]
                for n in num_chars:
                    models.refuse_long(served, n, "input")
                prompts = await models.offload.run(sum(num_chars), _tokenize_all, served, req.inputs())
            gen = embeddings.start(served, metrics, req, prompts)
        return await answer(gen, embeddings.EmbeddingFormat(req.encoding_format), False, request)


def _openapi_route(app: FastAPI, guarded: list[Any], limits: ServeLimits) -> None:
    """GET /openapi.json behind the key; `app.openapi()` states the limits too."""
    plain = app.openapi

    def with_limits() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = openapi_limits(plain(), limits)
        return app.openapi_schema

    # FastAPI's documented way to extend its schema is to replace `app.openapi`, which typing sees as a method
    app.openapi = with_limits  # type: ignore[method-assign]

    @app.get("/openapi.json", dependencies=guarded, include_in_schema=False)
    async def openapi() -> JSONResponse:
        return JSONResponse(app.openapi())


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


def _tokenize_all(served: ServedModel, prompts: list[str | list[int]]) -> list[list[int]]:
    """Each prompt's token ids, checked against the model's vocabulary and context (on a pool thread)."""
    return [served.engine.engine.tokenize(p)[1] for p in prompts]


def _num_chars(messages: list[Any]) -> int:
    """The characters of a chat's texts (what its rendering holds, less the template's own)."""
    total = 0
    for m in messages:
        content = m.content
        total += len(content) if isinstance(content, str) else sum(len(p.text) for p in content or ())
    return total


def _chat_ids(
    served: ServedModel, messages: list[Any], add_generation_prompt: bool, kwargs: Any, tools: list[Any] | None
) -> list[int]:
    """The conversation's prompt ids, rendered as LLM.chat renders it (the model's or --chat-template's)."""
    tokenizer = served.tokenizer
    template = template_for(tokenizer)
    checked = check_template_kwargs(tokenizer, kwargs)
    return render_chat(tokenizer, [m.for_template() for m in messages], template, add_generation_prompt, checked, tools)


def _bearer(api_key: str) -> Any:
    expected = api_key.encode()

    async def check(request: Request) -> None:
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        # the scheme is case-insensitive (RFC 9110); the key is compared in constant time
        if scheme.lower() == "bearer" and secrets.compare_digest(given.strip().encode(), expected):
            return
        # Anthropic's clients send the key as x-api-key
        if secrets.compare_digest(request.headers.get("x-api-key", "").strip().encode(), expected):
            return
        raise APIError(
            401,
            "no valid API key: send the server's --api-key as the header 'Authorization: Bearer KEY' "
            "(or 'x-api-key: KEY')",
            "authentication_error",
            code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )

    return check
