"""A model as the server sees it: its name, its AsyncEngine, and what its answers need of its tokenizer."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from infer.api.adapters import LoRARequest
from infer.api.reasoning import ReasoningParser
from infer.serve.async_engine import AsyncEngine
from infer.serve.snapshot import EngineSnapshot, snapshot

__all__ = ["EngineSnapshot", "ServedModel", "snapshot"]  # the snapshot's names stay importable from here


@dataclass(slots=True)
class ServedModel:
    name: str  # what requests put in `model`
    engine: AsyncEngine
    created: int = field(default_factory=lambda: int(time.time()))  # when the server took it (unix seconds)
    token_texts: dict[int, str] = field(default_factory=dict)  # token id -> its text, filled as logprobs ask
    reasoning: ReasoningParser | None = None  # splits a chat's reasoning from its answer (--reasoning-parser)
    lora: LoRARequest | None = None  # an adapter served under its own name: the base model's engine runs it
    parent: str | None = None  # an adapter's base model (its name here)

    def adapter(self, lora: LoRARequest) -> "ServedModel":
        """The same engine serving `lora` under the adapter's name."""
        return ServedModel(
            lora.lora_name, self.engine, token_texts=self.token_texts, reasoning=self.reasoning, lora=lora,
            parent=self.name,
        )  # fmt: skip

    @property
    def tokenizer(self) -> Any | None:
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.engine.parts.max_model_len

    def token_text(self, token_id: int) -> str:
        """A token's own text (logprobs name tokens by it); `token_id:N` without a tokenizer, as vLLM."""
        text = self.token_texts.get(token_id)
        if text is None:
            tokenizer = self.tokenizer
            text = tokenizer.decode([token_id]) if tokenizer is not None else f"token_id:{token_id}"
            self.token_texts[token_id] = text
        return text
