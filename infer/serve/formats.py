"""How the completions and the chat API write a generation: stream chunks (plain dicts, encoded once) and
the JSON answer (the pydantic models of `protocol`, so the answer is what the schema says)."""

from __future__ import annotations

import math
from typing import Any

from infer.core.request import RequestOutput
from infer.serve.generation import Generation, finish_reason
from infer.serve.protocol import (
    ChatChoice,
    ChatCompletion,
    ChatLogprobs,
    ChatMessageOut,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    TokenLogprob,
)
from infer.serve.stream import CompletionDelta


class CompletionFormat:
    def opening(self, gen: Generation) -> list[dict[str, Any]]:
        return []

    def chunk(self, gen: Generation, index: int, delta: CompletionDelta) -> dict[str, Any] | None:
        logprobs = self._logprobs(gen, index, delta.token_ids, delta.logprobs) if delta.logprobs else None
        if not delta.text and not delta.token_ids and logprobs is None and delta.finish_reason is None:
            return None  # a chunk per step that made tokens, text or not (a model without a tokenizer has none)
        choice = {"index": index, "text": delta.text, "logprobs": logprobs, "finish_reason": None}
        choice["finish_reason"] = finish_reason(delta.finish_reason)
        return _chunk(gen, "text_completion", choice)

    def usage_chunk(self, gen: Generation) -> dict[str, Any]:
        return {**_chunk(gen, "text_completion", None), "usage": gen.usage().model_dump()}

    def response(self, gen: Generation, finals: list[RequestOutput]) -> Completion:
        choices = []
        for i, final in enumerate(finals):
            for c in final.outputs:
                index = i * gen.n + c.index
                logprobs = self._logprobs(gen, index, c.token_ids, c.logprobs) if c.logprobs is not None else None
                choices.append(
                    CompletionChoice(
                        index=index,
                        text=c.text,
                        logprobs=CompletionLogprobs(**logprobs) if logprobs is not None else None,
                        finish_reason=finish_reason(c.finish_reason),
                    )
                )
        return Completion(id=gen.id, created=gen.created, model=gen.served.name, choices=choices, usage=gen.usage())

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


class ChatFormat:
    def opening(self, gen: Generation) -> list[dict[str, Any]]:
        """Each choice's first chunk names the role, as OpenAI's do."""
        count = len(gen.streams) * gen.n
        choice = {"delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        return [_chunk(gen, "chat.completion.chunk", {"index": i, **choice}) for i in range(count)]

    def chunk(self, gen: Generation, index: int, delta: CompletionDelta) -> dict[str, Any] | None:
        logprobs = {"content": self._logprobs(gen, delta.token_ids, delta.logprobs)} if delta.logprobs else None
        if not delta.text and logprobs is None and delta.finish_reason is None:
            return None
        choice = {
            "index": index,
            "delta": {"content": delta.text} if delta.text else {},
            "logprobs": logprobs,
            "finish_reason": finish_reason(delta.finish_reason),
        }
        return _chunk(gen, "chat.completion.chunk", choice)

    def usage_chunk(self, gen: Generation) -> dict[str, Any]:
        return {**_chunk(gen, "chat.completion.chunk", None), "usage": gen.usage().model_dump()}

    def response(self, gen: Generation, finals: list[RequestOutput]) -> ChatCompletion:
        choices = []
        for i, final in enumerate(finals):
            for c in final.outputs:
                content = self._logprobs(gen, c.token_ids, c.logprobs) if c.logprobs is not None else None
                choices.append(
                    ChatChoice(
                        index=i * gen.n + c.index,
                        message=ChatMessageOut(content=c.text),
                        logprobs=ChatLogprobs(content=[TokenLogprob(**t) for t in content])
                        if content is not None
                        else None,
                        finish_reason=finish_reason(c.finish_reason),
                    )
                )
        return ChatCompletion(id=gen.id, created=gen.created, model=gen.served.name, choices=choices, usage=gen.usage())

    def _logprobs(
        self, gen: Generation, token_ids: list[int], logprobs: list[dict[int, float]]
    ) -> list[dict[str, Any]]:
        content = []
        for t, lp in zip(token_ids, logprobs):
            top = [_top_logprob(gen, u, v) for u, v in gen.top(lp)]
            content.append({**_top_logprob(gen, t, lp[t]), "top_logprobs": top})
        return content


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
