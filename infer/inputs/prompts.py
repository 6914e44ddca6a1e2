"""Prompt forms `generate` takes, vLLM's included, checked before anything is tokenized.

A prompt is a string, a list of token ids, `{"prompt": str}` (vLLM's TextPrompt) or
`{"prompt_token_ids": [int, ...]}` (vLLM's TokensPrompt). Anything else is the caller's mistake,
reported as a RequestError for that prompt alone.
"""

from __future__ import annotations

import numbers
from typing import Any, Iterable

from infer.api.errors import RequestError

TEXT_KEY, TOKENS_KEY = "prompt", "prompt_token_ids"
FORMS = "a string, a list of token ids, {'prompt': str} or {'prompt_token_ids': [int, ...]}"


def is_token_id(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def as_batch(prompts: Any) -> list[Any]:
    """One prompt or a batch of them -> a list of prompts (as vLLM: a list whose first item is an
    int is one prompt of token ids)."""
    if prompts is None or isinstance(prompts, (str, bytes, dict)) or not isinstance(prompts, Iterable):
        return [prompts]
    items = list(prompts)
    return [items] if items and is_token_id(items[0]) else items


def split_prompt(prompt: Any, vocab_size: int) -> tuple[str | None, list[int] | None]:
    """(text, None) for a text prompt, (None, ids) for token ids; RequestError for anything else."""
    if isinstance(prompt, dict):
        return _split_dict(prompt, vocab_size)
    if isinstance(prompt, str):
        return check_text(prompt), None
    if isinstance(prompt, (bytes, bytearray)):
        raise RequestError(f"prompt is {type(prompt).__name__}, not text: decode it first (prompt.decode('utf-8'))")
    if isinstance(prompt, (list, tuple)):
        return None, _check_ids(prompt, vocab_size)
    raise RequestError(f"prompt {_short(prompt)} of type {type(prompt).__name__} is not a prompt: give {FORMS}")


def _split_dict(prompt: dict, vocab_size: int) -> tuple[str | None, list[int] | None]:
    unknown = sorted(map(str, set(prompt) - {TEXT_KEY, TOKENS_KEY}))
    if unknown:
        raise RequestError(
            f"prompt dict has unsupported key(s) {', '.join(map(repr, unknown))}: use only "
            f"'{TEXT_KEY}' or '{TOKENS_KEY}'"
        )
    if (TEXT_KEY in prompt) == (TOKENS_KEY in prompt):
        raise RequestError(f"a prompt dict needs exactly one of '{TEXT_KEY}' (text) or '{TOKENS_KEY}' (token ids)")
    if TEXT_KEY in prompt:
        text = prompt[TEXT_KEY]
        if not isinstance(text, str):
            raise RequestError(
                f"'{TEXT_KEY}' must be a string, not {type(text).__name__}: put token ids under '{TOKENS_KEY}'"
            )
        return check_text(text), None
    ids = prompt[TOKENS_KEY]
    if not isinstance(ids, (list, tuple)):
        raise RequestError(f"'{TOKENS_KEY}' must be a list of token ids, not {type(ids).__name__}")
    return None, _check_ids(ids, vocab_size)


def check_text(text: str) -> str:
    if not text:
        raise RequestError("empty prompt: give at least one character or token id")
    check_encodable(text, "prompt")
    return text


def check_encodable(text: str, what: str) -> None:
    """`what` (a prompt, a chat message's content) names the text in the error."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:  # a lone surrogate ("\ud800"): no tokenizer can encode it
        raise RequestError(
            f"{what} is not valid Unicode: {text[exc.start]!r} at index {exc.start} is a lone "
            f"surrogate; fix the text (decode bytes with errors='replace')"
        ) from None


def _check_ids(ids: list | tuple, vocab_size: int) -> list[int]:
    if not ids:
        raise RequestError("empty prompt: give at least one token id")
    for i, t in enumerate(ids):
        if not is_token_id(t) or not 0 <= t < vocab_size:
            raise RequestError(
                f"prompt token ids must be integers in [0, {vocab_size}); item {i} is {_short(t)}: fix the token list"
            )
    return [int(t) for t in ids]


def _short(value: object, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def tokenize(
    prompt: Any, tokenizer: Any | None, vocab_size: int, max_model_len: int, model: str
) -> tuple[str | None, list[int]]:
    """(text or None, token ids) of a prompt for `model`, which must leave room for one new token."""
    text, ids = split_prompt(prompt, vocab_size)
    if ids is None:
        if tokenizer is None:
            raise RequestError(f"model {model} has no tokenizer: pass prompts as token id lists")
        ids = list(tokenizer.encode(text))
    if len(ids) >= max_model_len:
        raise RequestError(
            f"prompt has {len(ids)} tokens but the context holds {max_model_len} (prompt + at least one new token): "
            f"shorten the prompt or raise --max-model-len"
        )
    return text, ids
