"""Prometheus metrics of one server (a registry per app, none global), named as vLLM names its own.

Per request, when it ends: its outcome, time to first token, time per output token, end-to-end
latency and token counts. Per engine, as its thread last published them (`EngineSnapshot`, at most
~0.25 s old while it steps, its last figures when idle): running and waiting requests, KV usage,
prefix-cache hits, preemptions and speculative acceptance. A scrape reads what was published: it
never calls into an engine, so it answers while an engine is mid-step, restarting or dead.
`infer_engine_up` is 1 per model whose engine runs, 0 for one that stopped; a stopped engine's
gauges and counters are left out until it runs again (a restarted engine's counters start from 0,
which Prometheus reads as a counter reset), and `infer_engine_restarts_total` counts its restarts.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector

from infer.api.request import RequestOutput
from infer.serve.served import ServedModel
from infer.serve.snapshot import EngineSnapshot

LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0)
# how a request ended: finished (stop or length), aborted (the client left), rejected (a 4xx), failed (a 5xx)
OUTCOMES = ("finished", "aborted", "rejected", "failed")
# per engine, from its snapshot: name -> (help text, the value)
GAUGES: dict[str, tuple[str, Callable[[EngineSnapshot], float]]] = {
    "infer_num_requests_running": ("Requests being stepped.", lambda s: s.num_running),
    "infer_num_requests_waiting": ("Requests queued or preempted.", lambda s: s.num_waiting),
    "infer_kv_cache_usage_ratio": ("Fraction of KV blocks in use.", lambda s: s.kv_usage),
    "infer_kv_cache_blocks": ("KV blocks in the cache.", lambda s: s.num_kv_blocks),
    "infer_prefix_cache_hit_rate": (
        "Prompt tokens found in the prefix cache, of those looked up.",
        lambda s: s.prefix_hit_tokens / s.prefix_query_tokens if s.prefix_query_tokens else 0.0,
    ),
    "infer_spec_decode_acceptance_rate": (
        "Draft tokens accepted, of those proposed (speculative decoding).",
        lambda s: s.stats.get("acceptance_rate", 0.0),
    ),
}
COUNTERS: dict[str, tuple[str, Callable[[EngineSnapshot], float]]] = {  # the engine's running totals
    "infer_prefix_cache_queries": (
        "Prompt tokens looked up in the prefix cache.",
        lambda s: s.prefix_query_tokens,
    ),
    "infer_prefix_cache_hits": ("Prompt tokens found in the prefix cache.", lambda s: s.prefix_hit_tokens),
    "infer_num_preemptions": ("Requests preempted.", lambda s: s.stats.get("preemptions", 0)),
    "infer_engine_steps": ("Engine steps.", lambda s: s.stats.get("steps", 0)),
    "infer_spec_decode_num_draft_tokens": ("Draft tokens proposed.", lambda s: s.stats.get("spec_proposed", 0)),
    "infer_spec_decode_num_accepted_tokens": (
        "Draft tokens accepted.",
        lambda s: s.stats.get("spec_accepted", 0),
    ),
}


class ServeMetrics:
    def __init__(self, models: Iterable[ServedModel], multiprocess_dir: str | None = None) -> None:
        """multiprocess_dir: PROMETHEUS_MULTIPROC_DIR, as it was when this process imported prometheus_client (the
        API server processes of `--api-server-count`): a scrape sums the counts of every process there."""
        self.models = list(models)
        self.multiprocess_dir = multiprocess_dir
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "infer_requests", "Generation requests by how they ended.", ["model", "outcome"], registry=r
        )
        self.ttft = Histogram(
            "infer_time_to_first_token_seconds",
            "Arrival to first token.",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "infer_time_per_output_token_seconds",
            "After the first token, per further token.",
            ["model"],
            buckets=TOKEN_BUCKETS,
            registry=r,
        )
        self.queue = Histogram(
            "infer_request_queue_time_seconds",
            "Arrival to first scheduled: the wait in the engine's queue.",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "infer_e2e_request_latency_seconds",
            "Arrival to last token.",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "infer_prompt_tokens", "Prompt tokens of finished requests.", ["model"], registry=r
        )
        self.generation_tokens = Counter(
            "infer_generation_tokens", "Tokens generated by finished requests.", ["model"], registry=r
        )
        self._engines = _EngineCollector(self.models)
        r.register(self._engines)
        for model in self.models:  # every series exists from the start, at zero
            for outcome in OUTCOMES:
                self.requests.labels(model.name, outcome)

    def finished(self, model: str, output: RequestOutput) -> None:
        """A request's last output: its outcome and timings (the engine's own, on its clock)."""
        self.requests.labels(model, "finished").inc()
        num_tokens = max((len(c.token_ids) for c in output.outputs), default=0)
        self.prompt_tokens.labels(model).inc(len(output.prompt_token_ids))
        self.generation_tokens.labels(model).inc(sum(len(c.token_ids) for c in output.outputs))
        ttft, latency = output.metrics.get("ttft_s"), output.metrics.get("latency_s")
        if (queue := output.metrics.get("queue_s")) is not None:
            self.queue.labels(model).observe(queue)
        if ttft is not None:
            self.ttft.labels(model).observe(ttft)
        if latency is not None:
            self.e2e.labels(model).observe(latency)
        if ttft is not None and latency is not None and num_tokens > 1:
            self.tpot.labels(model).observe((latency - ttft) / (num_tokens - 1))

    def ended(self, model: str, outcome: str, count: int = 1) -> None:
        self.requests.labels(model, outcome).inc(count)

    def scrape(self) -> bytes:
        """The exposition text, with every running engine's last published state (no call into an engine)."""
        if self.multiprocess_dir is None:
            return generate_latest(self.registry)
        registry = CollectorRegistry()
        MultiProcessCollector(registry, path=self.multiprocess_dir)
        registry.register(self._engines)
        return generate_latest(registry)


class _EngineCollector:
    """Engine state as last published: whether each engine runs, gauges, and its running totals as counters."""

    def __init__(self, models: list[ServedModel]) -> None:
        self.models = models

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily(
            "infer_engine_up", "1 while the model's engine runs, 0 once it stopped.", labels=["model"]
        )
        restarts = CounterMetricFamily(
            "infer_engine_restarts", "Times the model's engine was restarted after it died.", labels=["model"]
        )
        snapshots: list[tuple[str, EngineSnapshot]] = []
        for m in self.models:
            alive = m.engine.is_alive
            up.add_metric([m.name], 1.0 if alive else 0.0)
            restarts.add_metric([m.name], float(m.engine.num_restarts))
            if alive:
                snapshots.append((m.name, m.engine.snapshot))
        yield up
        yield restarts
        yield from _engine_families(snapshots)
        yield from _replica_families([m for m in self.models if hasattr(m.engine, "replica_states")])


# per replica of a data-parallel model: name -> (family, help, value of a ReplicaState; None: no sample)
REPLICA_FAMILIES: dict[str, tuple[type, str, Callable[[Any], float | None]]] = {
    "infer_replica_up": (GaugeMetricFamily, "1 while the replica's engine runs.", lambda r: float(r.alive)),
    "infer_replica_open_requests": (
        GaugeMetricFamily,
        "Requests the replica is answering for this server.",
        lambda r: r.open_requests,
    ),
    "infer_replica_num_requests_running": (
        GaugeMetricFamily,
        "The replica's running requests.",
        lambda r: None if r.snapshot is None else r.snapshot.num_running,
    ),
    "infer_replica_num_requests_waiting": (
        GaugeMetricFamily,
        "The replica's queued or preempted requests.",
        lambda r: None if r.snapshot is None else r.snapshot.num_waiting,
    ),
    "infer_replica_kv_cache_usage_ratio": (
        GaugeMetricFamily,
        "The replica's KV blocks in use.",
        lambda r: None if r.snapshot is None else r.snapshot.kv_usage,
    ),
    "infer_replica_routed_requests": (
        CounterMetricFamily,
        "Requests routed to the replica (retries included).",
        lambda r: r.routed,
    ),
}


def _replica_families(models: list[ServedModel]) -> Iterator[Metric]:
    """Per replica of a data-parallel model (`--data-parallel-size`), beside the model's summed figures."""
    engines: dict[int, tuple[str, Any]] = {}  # an adapter served under its own name shares its base's engine
    for m in models:
        engines.setdefault(id(m.engine), (m.name, m.engine))
    if not engines:
        return
    states = [(name, engine.replica_states()) for name, engine in engines.values()]
    for family_name, (kind, text, value) in REPLICA_FAMILIES.items():
        family = kind(family_name, text, labels=["model", "replica"])
        for name, replicas in states:
            for state in replicas:
                if (v := value(state)) is not None:
                    family.add_metric([name, str(state.index)], float(v))
        yield family
    retries = CounterMetricFamily(
        "infer_router_retries", "Requests sent again after their replica died.", labels=["model"]
    )
    routed = CounterMetricFamily(
        "infer_router_decisions",
        "Requests routed, by why: a prefix's holder or the least loaded.",
        labels=["model", "by"],
    )
    for name, engine in engines.values():
        retries.add_metric([name], float(engine.num_retries))
        routed.add_metric([name, "prefix"], float(engine.router.prefix_routed))
        routed.add_metric([name, "load"], float(engine.router.load_routed))
    yield retries
    yield routed


def _engine_families(snapshots: list[tuple[str, EngineSnapshot]]) -> Iterator[Metric]:
    """The per-engine families, one sample per (model, snapshot)."""
    for families, kind in ((GAUGES, GaugeMetricFamily), (COUNTERS, CounterMetricFamily)):
        for name, (text, value) in families.items():
            family = kind(name, text, labels=["model"])
            for model, snap in snapshots:
                family.add_metric([model], float(value(snap)))
            yield family
