"""`LLM`: the engine embedded in an application, with the same choices as the CLI."""

from __future__ import annotations

from typing import Any, Iterable, Sequence

from infer.core.config import EngineConfig
from infer.core.engine import Engine
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

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | Sequence[int] | Sequence[str | Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Prompts are strings or token-id lists. A bad prompt gets an output with `error` set."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        return self.engine.generate(list(prompts), sampling_params)  # type: ignore[arg-type]

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
