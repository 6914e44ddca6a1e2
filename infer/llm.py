"""`LLM`: the engine embedded in an application, with the same choices as the CLI."""

from __future__ import annotations

import threading
from typing import Any, Iterable, Sequence

from infer.core.config import EngineConfig
from infer.core.engine import Engine, Prompt
from infer.core.prompts import as_batch
from infer.core.request import RequestOutput, SamplingParams


class LLM:
    """Offline generation.

    >>> llm = LLM(model="smollm2-135m", attention="torch")
    >>> out = llm.generate(["Hello"], SamplingParams(max_tokens=8, temperature=0))
    """

    def __init__(self, model: str = "smollm2-135m", plugins: Iterable[Any] = (), tensor_parallel_size: int = 1, **options: Any) -> None:
        # options: any EngineConfig field (attention, scheduler, sampler, block_size, num_kv_blocks, ...)
        import structlog

        if not structlog.is_configured():  # an embedding app that did not set up logging hears only warnings
            from infer.core.logging import configure

            configure(level="warning")
        config = EngineConfig().replace(model=model, tensor_parallel_size=tensor_parallel_size, **options)
        self.config = config
        self.engine = Engine.from_config(config, extra_plugins=plugins)
        self._lock = threading.RLock()  # one caller steps the engine at a time; abort only queues

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """One prompt or a list: strings, token-id lists, {"prompt": str} or {"prompt_token_ids": [...]}.

        A bad prompt or params gets an output with `error` set; the others run as they would alone.
        If stepping raises (KeyboardInterrupt included), this call's requests are dropped and their
        KV blocks freed before the exception propagates; the LLM stays usable."""
        with self._lock:
            return self.engine.generate(as_batch(prompts), sampling_params)

    # vLLM LLMEngine-style calls: add requests, step until done, abort from any thread

    def add_request(self, prompt: Prompt, sampling_params: SamplingParams | None = None, request_id: str | None = None) -> str:
        """Queue one prompt (RequestError if it is bad); returns its request id."""
        with self._lock:
            return self.engine.add_request(prompt, sampling_params, request_id)

    def step(self) -> list[RequestOutput]:
        """Run one engine step; returns the requests that finished in it."""
        with self._lock:
            return self.engine.step()

    def has_unfinished(self) -> bool:
        return self.engine.has_unfinished()

    def abort(self, request_id: str) -> None:
        """End an unfinished request; a RequestError names an unknown or finished id. From another
        thread during `generate` it takes effect at the next step (its output says "abort")."""
        self.engine.request_abort(request_id)
        if self._lock.acquire(blocking=False):  # idle: apply it now rather than at some later step
            try:
                self.engine.abort_pending()
            finally:
                self._lock.release()

    def chat(
        self,
        conversations: Sequence[dict[str, str]] | Sequence[Sequence[dict[str, str]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation, then generate."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]  # type: ignore[list-item]
        prompts = [apply_chat_template(self.engine.tokenizer, list(c)) for c in conversations]  # type: ignore[arg-type]
        return self.generate(prompts, sampling_params)

    def close(self) -> None:
        with self._lock:
            self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def apply_chat_template(tokenizer: Any, messages: list[dict[str, str]]) -> str:
    from infer.core.errors import RequestError

    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise RequestError("this model has no chat template: use generate() with plain prompts")
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
