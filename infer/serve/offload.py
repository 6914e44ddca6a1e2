"""Work a request needs before it reaches the engine, off the event loop: tokenizing prompts and rendering
chat templates run in a small pool of threads (HF tokenizers release the GIL while they encode), so a
long prompt never freezes /health or another client's stream. Short text (under `inline_chars`: a few
milliseconds of work) and token ids are handled at once, on the loop: a thread hop would cost more.
The pool is bounded twice: `num_threads` run at once, and at most `max_queued` wait; past that a
request gets a 429 with Retry-After at once.

Text longer than the context could hold in any tokenization (more characters than `max_model_len`
tokens of the vocabulary's longest token, twice over for normalizers) is refused before it is encoded.
"""

from __future__ import annotations

import asyncio
import functools
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, TypeVar

from infer.serve.errors import APIError

T = TypeVar("T")
RETRY_AFTER_S = 1


class Offload:
    def __init__(self, num_threads: int = 2, max_queued: int = 256, inline_chars: int = 8192) -> None:
        self.num_threads = num_threads
        self.max_queued = max_queued  # jobs waiting for a thread, at most
        self.inline_chars = inline_chars  # text this short is tokenized on the loop
        self._pool: ThreadPoolExecutor | None = None  # made on first use, in the loop's process
        self._num_jobs = 0  # running or waiting (changed on the event loop only)

    async def run(self, num_chars: int, fn: Callable[..., T], *args: Any) -> T:
        """fn(*args), the work of `num_chars` characters of text: at once when that is short, else on a pool
        thread; a 429 when `max_queued` jobs already wait."""
        if num_chars < self.inline_chars:
            return fn(*args)
        if self._num_jobs >= self.num_threads + self.max_queued:
            raise APIError(
                429,
                f"{self._num_jobs} requests are being tokenized or waiting to be, the most this server takes: "
                f"retry after {RETRY_AFTER_S} s",
                "rate_limit_exceeded",
                code="tokenizer_busy",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.num_threads, thread_name_prefix="infer-tokenize")
        self._num_jobs += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, functools.partial(fn, *args))
        finally:
            self._num_jobs -= 1

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


def longest_token_chars(tokenizer: Any) -> int:
    """An upper bound on the characters of text one token covers: the longest entry of the vocabulary
    (byte-level BPE writes one character per byte, SentencePiece one per character; byte-fallback
    entries such as <0xE3> are longer than what they cover)."""
    vocab = tokenizer.get_vocab() if tokenizer is not None else {}
    return max((len(token) for token in vocab), default=1) or 1


def refuse_long_text(num_chars: int, max_chars_per_token: int, max_model_len: int, param: str) -> None:
    """A 400 for text that cannot fit the context however it tokenizes, before any of it is encoded."""
    bound = 2 * max_chars_per_token * max_model_len
    if num_chars > bound:
        raise APIError(
            400,
            f"{param} holds {num_chars} characters, more than this model's context of {max_model_len} tokens can "
            f"hold in any tokenization (at most {bound}): shorten it",
            param=param,
            code="context_length_exceeded",
        )
