"""What an engine publishes of its state for /metrics: an `EngineSnapshot`, taken on the engine's thread
between two steps (`EngineThread` takes one after a step at most every `SNAPSHOT_INTERVAL_S`, and
whenever it goes idle) and read by the server as it stands, so a scrape never waits for, or runs on,
the engine's thread."""

from __future__ import annotations

from dataclasses import dataclass

from infer.api.request import RequestStatus
from infer.core.engine import Engine

# a busy engine's figures are at most this old (an idle engine's are its last); taking one costs a pass
# over the requests, and crossing the pipe a few hundred bytes
SNAPSHOT_INTERVAL_S = 0.25


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
    """Runs on the engine's thread (or before it starts)."""
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
