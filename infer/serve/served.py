"""A model as the server sees it: its name, its AsyncEngine, and what its answers need of its tokenizer."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from infer.core.engine import Engine
from infer.core.request import RequestStatus
from infer.serve.async_engine import AsyncEngine


@dataclass(slots=True)
class ServedModel:
    name: str  # what requests put in `model`
    engine: AsyncEngine
    created: int = field(default_factory=lambda: int(time.time()))  # when the server took it (unix seconds)
    token_texts: dict[int, str] = field(default_factory=dict)  # token id -> its text, filled as logprobs ask

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


@dataclass(slots=True)
class EngineSnapshot:
    """An engine's state between two steps, for /metrics."""

    num_running: int  # requests holding KV blocks and being stepped
    num_waiting: int  # requests queued or preempted
    kv_usage: float  # fraction of the KV blocks in use
    num_kv_blocks: int
    prefix_query_tokens: int  # since the start: prompt tokens looked up in the prefix cache
    prefix_hit_tokens: int  # of those, found cached
    stats: dict[str, float]  # Engine.stats(): steps, preemptions, the decoder's (speculative acceptance)


def snapshot(engine: Engine) -> EngineSnapshot:
    """Runs on the engine's thread (`AsyncEngine.call`)."""
    usage = engine.kv_usage()
    running = sum(r.status is RequestStatus.RUNNING for r in engine.requests.values())
    waiting = sum(r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED) for r in engine.requests.values())
    return EngineSnapshot(
        num_running=running,
        num_waiting=waiting,
        kv_usage=usage.num_used_blocks / usage.num_blocks if usage.num_blocks else 0.0,
        num_kv_blocks=usage.num_blocks,
        prefix_query_tokens=usage.prefix_query_tokens,
        prefix_hit_tokens=usage.prefix_hit_tokens,
        stats=engine.stats(),
    )
