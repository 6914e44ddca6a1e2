"""What the OpenAI-compatible routes answer (pydantic v2): completions and chat completions, whole and as
stream chunks, their logprobs and usage, the model list, errors, and /(de)tokenize's answers."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel

from infer.serve.output_protocol import ToolCallDelta, ToolCallOut


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # prompt tokens found in the prefix cache: not computed again


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int  # every sample's tokens
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    """The completions API's logprobs: one entry per generated token."""

    tokens: list[str] = []  # each token's text
    token_logprobs: list[float | None] = []  # the sampled token's logprob (None: an echoed prompt's first token)
    top_logprobs: list[dict[str, float] | None] = []  # the most likely `logprobs` tokens: text -> logprob
    text_offset: list[int] = []  # where each token's text starts in the choice's text


class PromptLogprob(BaseModel):
    logprob: float
    decoded_token: str


class CompletionChoice(BaseModel):
    index: int  # prompt i's sample j is choice i * n + j
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None  # "stop", "length" (the context or max_tokens), "abort"
    # with prompt_logprobs: per prompt token (None for the first), token id -> its logprob and text (vLLM's)
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None


class Completion(BaseModel):
    """A completions response, or (object "text_completion" too, as OpenAI) one stream chunk of it."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None  # always in a response; in a stream, the last chunk's with include_usage


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None  # the token text's UTF-8 bytes


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = []


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None  # None when the answer is tool calls only
    reasoning_content: str | None = None  # with --reasoning-parser: the model's reasoning, before its answer
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    # with prompt_logprobs: per prompt token (None for the first), token id -> its logprob and text (vLLM's)
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None  # in each choice's first chunk
    content: str | None = None
    reasoning_content: str | None = None  # with --reasoning-parser
    tool_calls: list[ToolCallDelta] | None = None  # a call's first chunk names it, the next ones add arguments


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None  # the last chunk's, with include_usage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "infer"
    max_model_len: int  # vLLM's: the context length
    root: str | None = None  # vLLM's: an adapter's folder
    parent: str | None = None  # vLLM's: the model an adapter runs on


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str  # the problem and the fix
    type: str  # invalid_request_error, authentication_error, not_found_error, rate_limit_exceeded, server_error
    param: str | None = None  # the request field at fault
    code: str | None = None


class ErrorResponse(BaseModel):
    """Every error, in OpenAI's shape."""

    error: ErrorDetail


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str
