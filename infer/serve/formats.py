"""How the completions and the chat API write a generation: stream chunks (plain dicts, encoded once) and
the JSON answer (the pydantic models of `protocol`, so the answer is what the schema says). A chat
with a tool-call parser writes each choice's calls as `tool_calls`, streamed as OpenAI streams them:
a call's first chunk names it (id, type, function name, arguments ""), the next ones add arguments."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from infer.api.reasoning import ReasoningParser, ReasoningStream
from infer.api.reasoning import split as split_reasoning
from infer.api.request import RequestOutput
from infer.core.stream import CompletionDelta
from infer.serve.answers import (
    ChatChoice,
    ChatCompletion,
    ChatLogprobs,
    ChatMessageOut,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    PromptLogprob,
    TokenLogprob,
)
from infer.serve.generation import Generation, OpenAIEvents, finish_reason
from infer.serve.output_protocol import FunctionCall, ToolCallOut
from infer.serve.tool_parsers import CallDelta, ToolCallStream, ToolParser


class CompletionFormat(OpenAIEvents):
    """echo: each prompt's text (the answer's choices of prompt i start with echo[i]); None: no echo."""

    def __init__(self, echo: list[str] | None = None) -> None:
        self.echo = echo
        self.echoed: set[int] = set()  # the choices whose stream has had its prompt's text

    def opening(self, gen: Generation) -> list[dict[str, Any]]:
        return []

    def chunks(self, gen: Generation, index: int, delta: CompletionDelta) -> list[dict[str, Any]]:
        text = delta.text
        if self.echo is not None and index not in self.echoed:  # a choice's first chunk starts with its prompt
            self.echoed.add(index)
            text = self.echo[index // gen.n] + text
        logprobs = self._logprobs(gen, index, delta.token_ids, delta.logprobs) if delta.logprobs else None
        if not text and not delta.token_ids and logprobs is None and delta.finish_reason is None:
            return []  # a chunk per step that made tokens, text or not (a model without a tokenizer has none)
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": None}
        choice["finish_reason"] = finish_reason(delta.finish_reason)
        return [_chunk(gen, "text_completion", choice)]

    def closing(self, gen: Generation) -> list[dict[str, Any]]:
        return (
            [{**_chunk(gen, "text_completion", None), "usage": gen.usage().model_dump()}] if gen.include_usage else []
        )

    def response(self, gen: Generation, finals: list[RequestOutput]) -> Completion:
        choices = []
        for i, final in enumerate(finals):
            for c in final.outputs:
                index = i * gen.n + c.index
                text, logprobs = c.text, None
                if c.logprobs is not None:
                    if self.echo is not None:  # the prompt's tokens first; the output's offsets follow its text
                        logprobs = self._prompt_part(gen, index, final)
                        gen.text_offsets[index] = len(self.echo[i])
                    out = self._logprobs(gen, index, c.token_ids, c.logprobs)
                    logprobs = out if logprobs is None else {k: logprobs[k] + out[k] for k in out}
                if self.echo is not None:
                    text = self.echo[i] + text
                choices.append(
                    CompletionChoice(
                        index=index,
                        text=text,
                        logprobs=CompletionLogprobs(**logprobs) if logprobs is not None else None,
                        finish_reason=finish_reason(c.finish_reason),
                        prompt_logprobs=prompt_logprobs(gen, final),
                    )
                )
        return Completion(id=gen.id, created=gen.created, model=gen.served.name, choices=choices, usage=gen.usage())

    def _prompt_part(self, gen: Generation, index: int, final: RequestOutput) -> dict[str, Any]:
        """An echoed prompt's tokens in the logprobs' arrays: the first has no logprob (nothing before it)."""
        ids, scored = final.prompt_token_ids, final.prompt_logprobs
        assert scored is not None, "echo with logprobs asks the engine for the prompt's logprobs"
        texts = [gen.token_text(t) for t in ids]
        offsets, offset = [], 0
        for text in texts:
            offsets.append(offset)
            offset += len(text)
        return {
            "tokens": texts,
            "token_logprobs": [None if lp is None else _finite(lp[t]) for t, lp in zip(ids, scored)],
            "top_logprobs": [
                None if lp is None else {gen.token_text(t): _finite(v) for t, v in gen.top(lp)} for lp in scored
            ],
            "text_offset": offsets,
        }

    def _logprobs(
        self, gen: Generation, index: int, token_ids: list[int], logprobs: list[dict[int, float]]
    ) -> dict[str, Any]:
        texts = [gen.token_text(t) for t in token_ids]
        offsets = []
        offset = gen.text_offsets.get(index, 0)
        for text in texts:
            offsets.append(offset)
            offset += len(text)
        gen.text_offsets[index] = offset
        return {
            "tokens": texts,
            "token_logprobs": [_finite(lp[t]) for t, lp in zip(token_ids, logprobs)],
            "top_logprobs": [{gen.token_text(t): _finite(v) for t, v in gen.top(lp)} for lp in logprobs],
            "text_offset": offsets,
        }


def prompt_logprobs(gen: Generation, final: RequestOutput) -> list[dict[str, PromptLogprob] | None] | None:
    """vLLM's prompt_logprobs: per prompt token, None for the first, else every scored token (the prompt's
    own and the top ones) by id, with its logprob and text; None when the request did not ask."""
    if not gen.prompt_logprobs or final.prompt_logprobs is None:
        return None
    return [
        None
        if scored is None
        else {
            str(t): PromptLogprob(logprob=_finite(v), decoded_token=gen.served.token_text(t)) for t, v in scored.items()
        }
        for scored in final.prompt_logprobs
    ]


class ChatFormat(OpenAIEvents):
    def __init__(self, parser: ToolParser | None = None, reasoning: ReasoningParser | None = None) -> None:
        self.parser = parser  # reads each choice's tool calls; None: its text is its content
        self.reasoning = reasoning  # splits each choice's reasoning from its answer; None: all is answer
        self.calls: dict[int, ToolCallStream] = {}  # choice -> its calls so far, when streamed
        self.thoughts: dict[int, ReasoningStream] = {}  # choice -> its reasoning so far, when streamed

    def opening(self, gen: Generation) -> list[dict[str, Any]]:
        """Each choice's first chunk names the role, as OpenAI's do."""
        count = len(gen.streams) * gen.n
        choice = {"delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        return [_chunk(gen, "chat.completion.chunk", {"index": i, **choice}) for i in range(count)]

    def chunks(self, gen: Generation, index: int, delta: CompletionDelta) -> list[dict[str, Any]]:
        """Content, then each call's pieces, one chunk each; the delta's logprobs go in the first, its
        finish reason in the last."""
        logprobs = {"content": self._logprobs(gen, delta.token_ids, delta.logprobs)} if delta.logprobs else None
        reason = finish_reason(delta.finish_reason)
        final = delta.finish_reason is not None
        text, deltas = delta.text, []
        if self.reasoning is not None:  # the reasoning first; the answer's part goes on to the tool calls
            split = self.thoughts.setdefault(index, ReasoningStream(self.reasoning)).feed(text, final)
            text = split.content
            if split.reasoning:
                deltas.append({"reasoning_content": split.reasoning})
        if self.parser is None:
            deltas += [{"content": text}] if text else []
        else:
            calls = self.calls.setdefault(index, self.parser.stream())
            piece = calls.feed(text, final=final)
            deltas += ([{"content": piece.content}] if piece.content else []) + [_call_delta(d) for d in piece.calls]
            reason = _reason(reason, calls.has_calls)
        if not deltas and logprobs is None and reason is None:
            return []
        deltas = deltas or [{}]
        last = len(deltas) - 1
        return [
            _chunk(gen, "chat.completion.chunk", {
                "index": index,
                "delta": d,
                "logprobs": logprobs if n == 0 else None,
                "finish_reason": reason if n == last else None,
            })
            for n, d in enumerate(deltas)
        ]  # fmt: skip

    def closing(self, gen: Generation) -> list[dict[str, Any]]:
        return (
            [{**_chunk(gen, "chat.completion.chunk", None), "usage": gen.usage().model_dump()}]
            if gen.include_usage
            else []
        )

    def response(self, gen: Generation, finals: list[RequestOutput]) -> ChatCompletion:
        choices = []
        for i, final in enumerate(finals):
            for c in final.outputs:
                content = self._logprobs(gen, c.token_ids, c.logprobs) if c.logprobs is not None else None
                thought, text = (None, c.text) if self.reasoning is None else split_reasoning(self.reasoning, c.text)
                text = text or ""
                message = ChatMessageOut(content=text if text or thought is None else None, reasoning_content=thought)
                reason = finish_reason(c.finish_reason)
                parsed = self.parser.parse(text) if self.parser is not None else None
                if parsed is not None and parsed.calls:
                    calls = [
                        ToolCallOut(id=t.id, function=FunctionCall(name=t.name, arguments=t.arguments))
                        for t in parsed.calls
                    ]
                    message = ChatMessageOut(content=parsed.content, tool_calls=calls, reasoning_content=thought)
                    reason = _reason(reason, True)
                choices.append(
                    ChatChoice(
                        index=i * gen.n + c.index,
                        message=message,
                        logprobs=ChatLogprobs(content=[TokenLogprob(**t) for t in content])
                        if content is not None
                        else None,
                        finish_reason=reason,
                    )
                )
        return ChatCompletion(
            id=gen.id,
            created=gen.created,
            model=gen.served.name,
            choices=choices,
            usage=gen.usage(),
            prompt_logprobs=prompt_logprobs(gen, finals[0]) if finals else None,
        )

    def _logprobs(
        self, gen: Generation, token_ids: list[int], logprobs: list[dict[int, float]]
    ) -> list[dict[str, Any]]:
        content = []
        for t, lp in zip(token_ids, logprobs):
            top = [_top_logprob(gen, u, v) for u, v in gen.top(lp)]
            content.append({**_top_logprob(gen, t, lp[t]), "top_logprobs": top})
        return content


def _call_delta(d: CallDelta) -> dict[str, Any]:
    if d.id is None:
        return {"tool_calls": [{"index": d.index, "function": {"arguments": d.arguments}}]}
    function = {"name": d.name, "arguments": d.arguments}
    return {"tool_calls": [{"index": d.index, "id": d.id, "type": "function", "function": function}]}


def _reason(reason: str | None, has_calls: bool) -> str | None:
    """A choice that ends by itself after tool calls ends for them: "tool_calls" (cut short, it stays "length")."""
    return "tool_calls" if has_calls and reason == "stop" else reason


def _top_logprob(gen: Generation, token_id: int, logprob: float) -> dict[str, Any]:
    text = gen.token_text(token_id)
    return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode("utf-8"))}


def _finite(logprob: float) -> float:
    """JSON has no infinities: an impossible token's logprob is written -9999.0, as vLLM writes it."""
    return logprob if math.isfinite(logprob) else -9999.0


def _chunk(gen: Generation, kind: str, choice: dict[str, Any] | None) -> dict[str, Any]:
    chunk: dict[str, Any] = {
        "id": gen.id,
        "object": kind,
        "created": gen.created,
        "model": gen.served.name,
        "choices": [choice] if choice is not None else [],
    }
    if gen.include_usage:  # OpenAI: with include_usage, every chunk has a usage field, null but the last
        chunk["usage"] = None
    return chunk


@dataclass(frozen=True, slots=True)
class ChatPiece:
    """One thing a chat stream's chunk says, for the formats that re-frame it (Responses, Anthropic):
    `kind` is "reasoning" or "text" (`text` the piece), "call" (a tool call starts: `index`, `call_id`,
    `name`), "arguments" (`index`, `text` the arguments' next characters) or "finish" (`text` the reason)."""

    kind: str
    text: str = ""
    index: int = 0
    call_id: str = ""
    name: str = ""


def chat_pieces(chunks: list[dict[str, Any]]) -> list[ChatPiece]:
    """What `ChatFormat.chunks` said, piece by piece, in order (one choice: these APIs have no `n`)."""
    pieces: list[ChatPiece] = []
    for chunk in chunks:
        choice = chunk["choices"][0]
        d = choice["delta"]
        if d.get("reasoning_content"):
            pieces.append(ChatPiece("reasoning", d["reasoning_content"]))
        if d.get("content"):
            pieces.append(ChatPiece("text", d["content"]))
        for call in d.get("tool_calls") or ():
            function = call.get("function", {})
            if call.get("id"):
                pieces.append(
                    ChatPiece("call", index=call["index"], call_id=call["id"], name=function.get("name") or "")
                )
            if function.get("arguments"):
                pieces.append(ChatPiece("arguments", function["arguments"], index=call["index"]))
        if choice.get("finish_reason"):
            pieces.append(ChatPiece("finish", choice["finish_reason"]))
    return pieces
