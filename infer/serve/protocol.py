"""The OpenAI API's request shapes (pydantic v2), and how a request maps onto SamplingParams (`answers`: what
the routes answer).

Fields are OpenAI's, with vLLM's sampling extras (`top_k`, `min_p`, `repetition_penalty`,
`ignore_eos`, `stop_token_ids`, `min_tokens`, `bad_words`, `allowed_token_ids`) and its ways to
constrain the output (`structured_outputs`, the older `guided_*`). A field OpenAI defines that this
server cannot honour is refused with a 400 naming it and why (`Refused`), never silently ignored;
the few that change nothing a self-hosted model does (`user`, `metadata`, `store`, ...) are
accepted and ignored. A field OpenAI does not define is refused by validation, as OpenAI refuses
one ("Extra inputs are not permitted"). Each field is checked for its JSON type strictly, as OpenAI
checks it: "5" or true for an integer, true for a number, "yes" for a boolean are 400s; an integer
passes for a number, and a whole number written 5.0 for an integer (JSON Schema's integers).

The OpenAPI schema states what the handlers enforce, refusals included (`suffix` only empty,
`modalities` only ["text"], /tokenize's prompt or messages, ...), so a client generated from it
sends nothing it forbids; what it cannot state is the model's (its context, vocabulary and chat
template), the constraint compilers' and rules across fields (`best_of` = `n`, one constraint).
"""

from __future__ import annotations

import contextlib
import json
from typing import TYPE_CHECKING, Annotated, Any, Literal, Union

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, StrictStr, WithJsonSchema

from infer.api.request import SamplingParams
from infer.api.structured import StructuredOutputs
from infer.serve.output_protocol import NamedToolChoice, ResponseFormat, Tool

if TYPE_CHECKING:
    from typing_extensions import TypeIs  # typing's own from Python 3.13

MAX_LOGPROBS = 20  # top logprobs per token, at most (OpenAI's chat limit; vLLM's default)
MAX_N = 128  # samples per prompt, at most (OpenAI's limit)
SAFE_INTEGER = 2**53 - 1  # the largest integer a JSON number holds exactly in every client


def _whole(value: Any) -> Any:
    """5.0 is the integer 5 to JSON Schema (and so to the OpenAPI schema's clients); 5.5, "5" and true are not."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


# after an integer field's Field(...) (so that its bounds reach the OpenAPI schema): requests are validated
# strictly (no "5", no true for an integer), and a whole number written 5.0 passes as JSON Schema says it does
WHOLE = BeforeValidator(_whole)
TokenIds = Annotated[list[Annotated[int, Field(ge=0), WHOLE]], Field(min_length=1)]
Text = Annotated[StrictStr, Field(min_length=1)]
Stop = Union[Text, list[Text], None]
NULL_ONLY: dict[str, Any] = {"type": "null"}  # the schema of a field refused whatever its value
# a string with a character str.strip() keeps (JSON Schema's \s is not Python's whitespace)
NOT_BLANK = "[^\t\n\v\f\r\x1c-\x20\x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000]"


def _given(*names: str) -> list[Any]:
    """JSON Schema's oneOf branches "this field is given" (present and not null), one per name."""
    return [{"required": [name], "properties": {name: {"not": {"type": "null"}}}} for name in names]


def _token_key(key: str) -> str:
    if not (key.isascii() and key.isdigit()):
        raise ValueError("use token ids (integers >= 0, written as strings) as its keys")
    return key


# a logit_bias key: a token id as OpenAI writes it, "1234"
TokenKey = Annotated[str, AfterValidator(_token_key), WithJsonSchema({"type": "string", "pattern": "^[0-9]+$"})]

# top_logprobs > 0 needs logprobs: true (the route refuses it otherwise)
TOP_LOGPROBS_NEED_LOGPROBS = {
    "if": {"properties": {"top_logprobs": {"type": "integer", "minimum": 1}}, "required": ["top_logprobs"]},
    "then": {"properties": {"logprobs": {"const": True}}, "required": ["logprobs"]},
}


class Refused(ValueError):
    """A request field this server cannot honour: `param` names it, the message says why and what to do."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    include_usage: bool | None = None  # a last chunk with the usage (and no choices)
    include_obfuscation: bool | None = None  # accepted and ignored: no obfuscation field is sent


class SamplingFields(BaseModel):
    """What completions and chat completions share."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: StrictStr  # a name GET /v1/models lists
    n: Annotated[int, Field(ge=1, le=MAX_N), WHOLE] | None = None  # samples per prompt; None: 1
    temperature: float | None = Field(default=None, ge=0, le=2)  # None: 1; 0 is greedy
    top_p: float | None = Field(default=None, gt=0, le=1)  # None: 1
    stop: Stop = None  # up to --max-stop stop strings (excluded from the text)
    # same seed, same tokens; within JSON's exact integers (2**53 - 1, JavaScript's MAX_SAFE_INTEGER): past them
    # a client's or a schema validator's float arithmetic moves the value (a fuzzer sent -2**63 as -2**63 - 192)
    seed: Annotated[int, Field(ge=-SAFE_INTEGER, le=SAFE_INTEGER), WHOLE] | None = None
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted and ignored
    metadata: dict[str, str] | None = None  # accepted and ignored
    store: bool | None = None  # accepted and ignored: nothing is stored
    service_tier: str | None = None  # accepted and ignored: one tier
    safety_identifier: str | None = None  # accepted and ignored
    prompt_cache_key: str | None = None  # accepted and ignored: prefix caching needs no key
    # token id (as text) -> added to its logit; up to --max-logit-bias entries
    logit_bias: dict[TokenKey, Annotated[float, Field(ge=-100, le=100)]] | None = None
    response_format: ResponseFormat | None = None  # what the output must be: text, a JSON object, JSON by a schema
    # vLLM's extras
    structured_outputs: dict[str, Any] | None = None  # StructuredOutputs' fields: {"json": schema}, {"regex": ...}
    guided_json: Union[dict[str, Any], StrictStr, None] = None  # vLLM's older names for structured_outputs' kinds
    guided_regex: StrictStr | None = None
    guided_choice: Annotated[list[StrictStr], Field(min_length=1)] | None = None
    guided_grammar: StrictStr | None = None
    min_tokens: Annotated[int, Field(ge=0), WHOLE] | None = None  # EOS and stop tokens banned until this many are out
    bad_words: list[Annotated[StrictStr, Field(pattern=NOT_BLANK)]] | None = None  # words never generated
    # only these tokens are generated
    allowed_token_ids: Annotated[list[Annotated[int, Field(ge=0), WHOLE]], Field(min_length=1)] | None = None
    top_k: Annotated[int, Field(ge=-1, le=2**31 - 1), WHOLE] | None = None  # None, 0 or -1: off
    min_p: float | None = Field(default=None, ge=0, le=1)
    repetition_penalty: float | None = Field(default=None, gt=0)
    ignore_eos: bool | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0), WHOLE]] | None = None
    return_tokens_as_token_ids: bool | None = None  # logprobs name tokens "token_id:N", not by their text
    # vLLM's: each prompt token's logprob and its top N (the first token has none), in the answer (not streamed)
    prompt_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS), WHOLE] | None = None
    # lower runs first (vLLM's): the fcfs scheduler admits and preempts by priority, aged by --priority-aging-s
    priority: Annotated[int, Field(ge=-(2**31), le=2**31 - 1), WHOLE] | None = None

    def guided(self) -> list[tuple[str, str, Any]]:
        """(field, StructuredOutputs kind, value) of each `guided_*` field set, in this order."""
        fields = (
            ("guided_json", "json", self.guided_json),
            ("guided_regex", "regex", self.guided_regex),
            ("guided_choice", "choice", self.guided_choice),
            ("guided_grammar", "grammar", self.guided_grammar),
        )
        return [(name, kind, value) for name, kind, value in fields if value is not None]

    def sampling(self, max_tokens: int, logprobs: int | None, structured: StructuredOutputs | None) -> SamplingParams:
        """SamplingParams (which checks what pydantic did not, e.g. top_p > 0) for one prompt; `structured`:
        what the output must match (`constrained.output_rules` reads it from the request)."""
        prompt_logprobs = self.prompt_logprobs_for(logprobs)
        return SamplingParams(
            n=_or(self.n, 1),
            max_tokens=max_tokens,
            temperature=_or(self.temperature, 1.0),
            top_p=_or(self.top_p, 1.0),
            top_k=_or(self.top_k, 0),
            min_p=_or(self.min_p, 0.0),
            repetition_penalty=_or(self.repetition_penalty, 1.0),
            presence_penalty=_or(self.presence_penalty, 0.0),
            frequency_penalty=_or(self.frequency_penalty, 0.0),
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=bool(self.ignore_eos),
            logprobs=logprobs,
            structured=structured,
            logit_bias=self.logit_bias,
            min_tokens=_or(self.min_tokens, 0),
            bad_words=self.bad_words,
            allowed_token_ids=self.allowed_token_ids,
            priority=_or(self.priority, 0),
            prompt_logprobs=prompt_logprobs,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def prompt_logprobs_for(self, logprobs: int | None) -> int | None:
        """The top prompt logprobs each prompt token needs (None: none are computed)."""
        return self.prompt_logprobs

    def refuse_streamed_prompt_logprobs(self) -> None:
        if self.stream and self.prompt_logprobs is not None:
            raise Refused("prompt_logprobs", "prompt_logprobs come in the answer, not in a stream: drop stream or them")


class CompletionRequest(SamplingFields):
    """POST /v1/completions: prompt is text, a list of texts, token ids, or a list of token-id lists."""

    prompt: Union[
        Text, Annotated[list[Text], Field(min_length=1)], TokenIds, Annotated[list[TokenIds], Field(min_length=1)]
    ]
    max_tokens: Annotated[int, Field(ge=1), WHOLE] | None = None  # None: 16, as OpenAI
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS), WHOLE] | None = None  # top logprobs per token
    echo: bool | None = None  # the prompt's text before each choice's (and, with logprobs, its tokens' logprobs)
    suffix: StrictStr | None = Field(default=None, json_schema_extra={"maxLength": 0})  # refused unless empty
    best_of: Annotated[int, Field(ge=1, le=MAX_N), WHOLE] | None = None  # refused unless equal to n

    def refuse(self) -> None:
        """Raise Refused for a field set to something this server cannot do."""
        self.refuse_streamed_prompt_logprobs()
        if self.echo and self.stream and self.logprobs is not None:
            raise Refused("echo", "echo with logprobs is answered whole, not streamed: drop stream, logprobs or echo")
        if self.suffix:
            raise Refused("suffix", "suffix (fill-in-the-middle) is not supported: drop it")
        if self.best_of is not None and self.best_of != _or(self.n, 1):
            raise Refused("best_of", "best_of other than n is not supported: drop it and use n")

    def prompt_logprobs_for(self, logprobs: int | None) -> int | None:
        if self.echo and logprobs is not None:  # the echoed prompt's tokens come with logprobs too
            return max(self.prompt_logprobs or 0, logprobs)
        return self.prompt_logprobs

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        return [p] if isinstance(p, str) or _is_token_ids(p) else list(p)


def _is_token_ids(prompt: list[Text] | TokenIds | list[TokenIds]) -> TypeIs[TokenIds]:
    """Whether a prompt that is a list is one prompt of token ids (validated: its items are all of one kind)."""
    return bool(prompt) and isinstance(prompt[0], int)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["text"]
    text: StrictStr


class ChatMessage(BaseModel):
    """One message; fields beyond these (tool_calls, tool_call_id, ...) reach the chat template as given."""

    model_config = ConfigDict(extra="allow", strict=True)

    role: Annotated[StrictStr, Field(min_length=1)]  # system, developer, user, assistant, tool
    content: Union[StrictStr, list[TextPart], None] = None  # text parts are joined with newlines
    name: str | None = None

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates read it: text parts joined, and the arguments of an assistant's
        tool calls as objects (the API sends them as JSON text; templates write them with `tojson`)."""
        message = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            message["content"] = "\n".join(part.text for part in self.content)
        for call in message.get("tool_calls") or ():
            function = call.get("function") if isinstance(call, dict) else None
            if isinstance(function, dict) and isinstance(function.get("arguments"), str):
                with contextlib.suppress(ValueError, RecursionError):  # not JSON: the template gets the text
                    function["arguments"] = json.loads(function["arguments"])
        return message


class ChatRequest(SamplingFields):
    """POST /v1/chat/completions."""

    model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra=TOP_LOGPROBS_NEED_LOGPROBS)

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    # None: max_tokens, else all the context left
    max_completion_tokens: Annotated[int, Field(ge=1), WHOLE] | None = None
    max_tokens: Annotated[int, Field(ge=1), WHOLE] | None = None  # OpenAI's older name
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS), WHOLE] | None = None  # with logprobs: true
    tools: list[Tool] | None = None  # functions the model may call (the chat template shows them to it)
    # none: text; auto (the default with tools): text, and the calls `--tool-call-parser` finds in it;
    # required: one or more calls; a named function: a call of it
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    parallel_tool_calls: bool | None = None  # False: tool_choice "required" makes one call
    # refused unless empty: tools replace them
    functions: list[dict[str, Any]] | None = Field(default=None, json_schema_extra={"maxItems": 0})
    # refused unless "none"
    function_call: Union[str, dict[str, Any], None] = Field(default=None, json_schema_extra={"enum": ["none", None]})
    modalities: list[str] | None = Field(default=None, json_schema_extra={"enum": [["text"], None]})  # only text
    audio: dict[str, Any] | None = Field(default=None, json_schema_extra=NULL_ONLY)  # refused
    prediction: dict[str, Any] | None = Field(default=None, json_schema_extra=NULL_ONLY)  # refused
    web_search_options: dict[str, Any] | None = Field(default=None, json_schema_extra=NULL_ONLY)  # refused
    # reaches the chat template as its `reasoning_effort` variable (a template that reads it: gpt-oss', ...)
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    verbosity: str | None = None  # accepted and ignored
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: variables for the chat template

    def template_kwargs(self) -> dict[str, Any] | None:
        """The chat template's variables: chat_template_kwargs, and reasoning_effort unless they set it."""
        if self.reasoning_effort is None:
            return self.chat_template_kwargs
        return {"reasoning_effort": self.reasoning_effort, **(self.chat_template_kwargs or {})}

    def refuse(self) -> None:
        """Raise Refused for a field set to something this server cannot do."""
        self.refuse_streamed_prompt_logprobs()
        if self.functions:
            raise Refused("functions", "functions (OpenAI's older tools) are not supported: pass them as tools")
        if self.function_call not in (None, "none"):
            raise Refused("function_call", "function_call is not supported: use tool_choice, or drop it")
        if self.modalities not in (None, ["text"]):
            raise Refused("modalities", "this server writes text only: use ['text'] or drop it")
        for name, value in (
            ("audio", self.audio),
            ("prediction", self.prediction),
            ("web_search_options", self.web_search_options),
        ):
            if value is not None:
                raise Refused(name, f"{name} is not supported by this server: drop it")
        if self.top_logprobs and not self.logprobs:
            raise Refused("top_logprobs", "top_logprobs needs logprobs: true")

    @property
    def num_logprobs(self) -> int | None:
        return _or(self.top_logprobs, 0) if self.logprobs else None

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class TokenizeRequest(BaseModel):
    """POST /tokenize (vLLM's shape): a prompt, or chat messages rendered by the chat template."""

    model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra={"oneOf": _given("prompt", "messages")})

    model: StrictStr | None = None  # None: the only model, when there is one
    prompt: StrictStr | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_special_tokens: bool = True  # for prompt
    add_generation_prompt: bool = True  # for messages


class DetokenizeRequest(BaseModel):
    """POST /detokenize (vLLM's shape)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: StrictStr | None = None
    tokens: list[Annotated[int, Field(ge=0), WHOLE]]


def _or(value: Any, default: Any) -> Any:
    return default if value is None else value
