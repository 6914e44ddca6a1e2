"""Data parallelism: one served model as several engine replicas behind a router (`infer serve
--data-parallel-size N`).

Each replica is an `AsyncEngine` of its own (its own process, its own devices and `--tp` group);
`ReplicatedEngine` stands where the server expects one `AsyncEngine` and routes each request
(`infer.serve.router.PrefixRouter`):

- **Prefix-aware.** The router remembers, per block of prompt tokens (chained hashes, so a block stands
  for the whole prefix up to it, as in a prefix cache), which replica last took a request with that
  prefix. A request goes to the replica holding its longest remembered prefix when that prefix covers at
  least `cache_threshold` of its prompt, so that replica's prefix cache serves it.
- **Least loaded** otherwise, and always when the replicas are out of balance (the busiest has more than
  `balance_abs` requests over the idlest and more than `balance_rel` times as many): by the requests each
  replica has open from this server (exact, and current), then its KV-cache usage.
- **Health.** A replica whose process died takes no new request. What it had accepted is retried on
  another: from the start if nothing of it was sent yet, else as a continuation (its prompt and the
  tokens already sent, for the tokens left), when the request allows one (a single sample, no stop
  strings, constraint, penalty on output tokens or prompt logprobs); one that allows none ends with the
  replica's error. `restart` builds the dead replicas again (`--restart-engine`).
- **Metrics.** `snapshot` sums the replicas' figures; `replica_states` gives each one's for /metrics.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import itertools
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from infer.api.adapters import LoRARequest
from infer.api.errors import ConfigError
from infer.api.params import SamplingParams
from infer.api.request import CompletionOutput, RequestOutput
from infer.common import env
from infer.core.engine import Engine, Prompt
from infer.core.stream import StreamOutput
from infer.serve.async_engine import AsyncEngine, QueueFullError, RequestStream
from infer.serve.engine_process import EngineLink, Starter
from infer.serve.engine_thread import EngineDeadError
from infer.serve.router import PrefixRouter
from infer.serve.snapshot import EngineSnapshot

__all__ = ["PrefixRouter", "ReplicaState", "ReplicatedEngine", "RoutedStream"]


@dataclass(slots=True)
class ReplicaState:
    """One replica as /metrics shows it."""

    index: int
    alive: bool
    open_requests: int  # requests of this server it is answering now
    routed: int  # requests routed to it since the start (retries included)
    snapshot: EngineSnapshot | None  # its last published state; None while it is down


def _continuable(params: SamplingParams) -> bool:
    """Whether a request cut short can go on from its prompt and the tokens already sent and give what it
    would have: one sample, nothing that reads the output as output (stop strings over its text, a
    constraint's state, penalties on output tokens, a beam), no prompt logprobs or embedding."""
    return (
        params.n == 1
        and not params.use_beam_search
        and not params.stop
        and params.structured is None
        and params.structured_outputs is None
        and params.prompt_logprobs is None
        and params.pooling is None
        and params.presence_penalty == 0.0
        and params.frequency_penalty == 0.0
        and params.truncate_prompt_tokens is None
        and params.logits_processors is None
    )


class RoutedStream:
    """A request's outputs from the replica that runs it; when that replica dies, from the one it is
    retried on, as one stream (`RequestStream`'s interface)."""

    def __init__(
        self,
        owner: "ReplicatedEngine",
        request_id: str,
        prompt: Prompt,
        ids: list[int],
        params: SamplingParams,
        lora_request: LoRARequest | None,
    ) -> None:
        self.request_id = request_id
        self.finished = False
        self.retries = 0  # times it was sent again after its replica died
        self._owner = owner
        self._prompt, self._ids, self._params, self._lora = prompt, ids, params, lora_request
        self._sent_ids: list[int] = []  # sample 0's tokens sent so far
        self._sent_text: list[str] = []  # and its text
        self._sent_logprobs: list[dict[int, float]] = []
        self._sent_anything = False
        self._ahead: tuple[list[int], str, list[dict[int, float]]] | None = None  # sent before a continuation
        self._closed = False
        self.replica, self._inner = owner._route(ids, prompt, params, request_id, lora_request)
        self._open = True  # counted in its replica's open requests (`_release` uncounts it, once)

    def __aiter__(self) -> "RoutedStream":
        return self

    async def __anext__(self) -> StreamOutput:
        while True:
            if self.finished or self._closed:
                raise StopAsyncIteration
            try:
                out = await self._inner.__anext__()
            except StopAsyncIteration:
                self._end()
                raise
            except EngineDeadError:
                if not self._retry():
                    self._end()
                    raise
                continue
            return self._stitched(out)

    def _stitched(self, out: StreamOutput) -> StreamOutput:
        out.request_id = self.request_id
        for delta in out.deltas:
            self._sent_anything = self._sent_anything or bool(delta.token_ids or delta.text)
            if delta.index == 0:
                self._sent_ids += delta.token_ids
                self._sent_text.append(delta.text)
                self._sent_logprobs += delta.logprobs or []
        if out.finished:
            self._end()
            if out.final is not None and self._ahead is not None:
                out.final = self._whole(out.final)
        return out

    def _whole(self, final: RequestOutput) -> RequestOutput:
        """A continuation's final output as the uninterrupted request's: the original prompt, and the tokens
        sent before the retry ahead of the continuation's."""
        assert self._ahead is not None
        ids, text, logprobs = self._ahead
        first = final.outputs[0]
        whole = CompletionOutput(
            first.index,
            text + first.text,
            [*ids, *first.token_ids],
            first.finish_reason,
            None if first.logprobs is None else [*logprobs, *first.logprobs],
        )
        prompt = self._prompt.get("prompt") if isinstance(self._prompt, dict) else self._prompt
        return dataclasses.replace(
            final,
            request_id=self.request_id,
            prompt=prompt if isinstance(prompt, str) else None,
            prompt_token_ids=list(self._ids),
            outputs=[whole],
        )

    def _retry(self) -> bool:
        """Send the request again to a live replica after its own died; False when it cannot go again."""
        owner = self._owner
        self._release()
        if owner.closed or owner._ended is not None or self._closed or self.retries >= owner.num_replicas:
            return False
        params, ids, prompt = self._params, self._ids, self._prompt
        continued = False
        if self._sent_anything:  # go on after what the client has: same prompt, its tokens so far
            if not _continuable(params):
                return False
            done = len(self._sent_ids)
            if params.max_tokens - done < 1:
                return False
            self._ahead = (list(self._sent_ids), "".join(self._sent_text), list(self._sent_logprobs))
            params = dataclasses.replace(
                params, max_tokens=params.max_tokens - done, min_tokens=max(0, params.min_tokens - done)
            )
            ids = [*ids, *self._sent_ids]
            prompt = {"prompt_token_ids": ids}
            continued = True
        try:
            self.replica, self._inner = owner._route(ids, prompt, params, self.request_id, self._lora)
        except (EngineDeadError, QueueFullError):
            return False
        self._open = True
        self.retries += 1
        owner.num_retries += 1
        owner.num_continued += continued
        return True

    def _release(self) -> None:
        if self._open:
            self._open = False
            self._owner._done(self.replica)

    def _end(self) -> None:
        self.finished = True
        self._release()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._release()
        self._inner.close()

    async def aclose(self) -> None:
        self.close()


def _on_devices(devices: tuple[str, ...], build: Callable[[], Engine]) -> Engine:
    """In a replica's process, before CUDA starts there: it sees only its own devices."""
    env.export("CUDA_VISIBLE_DEVICES", ",".join(devices))
    return build()


def replica_devices(size: int, per_replica: int) -> list[list[str]]:
    """Each replica's CUDA devices, in order from those this process sees: `per_replica` each (its --tp)."""
    import torch

    names = env.cuda_visible_devices() or [str(i) for i in range(torch.cuda.device_count())]
    if size * per_replica > len(names):
        raise ConfigError(
            f"--data-parallel-size {size} x --tp {per_replica} needs {size * per_replica} GPUs and "
            f"{len(names)} are visible: lower --data-parallel-size or --tp"
        )
    return [names[i * per_replica : (i + 1) * per_replica] for i in range(size)]


class ReplicatedEngine:
    """Several `AsyncEngine`s of one model behind a `PrefixRouter`, in `AsyncEngine`'s place for the server."""

    def __init__(self, replicas: Sequence[AsyncEngine], router: PrefixRouter | None = None) -> None:
        if not replicas:
            raise ConfigError("a replicated engine needs at least one replica")
        self.replicas = list(replicas)
        self.router = router or PrefixRouter(len(self.replicas))
        self.closed = False
        self.num_retries = 0  # requests sent again after their replica died
        self.num_continued = 0  # of those, the ones that went on after the tokens already sent
        self._open = [0] * len(self.replicas)  # per replica: requests of this server it is answering
        self._routed = [0] * len(self.replicas)
        self._ids = itertools.count()
        self._restarting = False
        self._ended: BaseException | None = None  # set by end_all: every new request is refused with it

    @classmethod
    def spawn(
        cls,
        build: Callable[[], Engine],
        size: int,
        max_waiting: int | None = None,
        devices: Sequence[Sequence[str]] | None = None,
        start: Starter | None = None,
    ) -> "ReplicatedEngine":
        """`size` replicas of what `build()` returns, each built and stepped in a process of its own (built
        side by side); `devices`: per replica, the CUDA devices its process sees (CUDA_VISIBLE_DEVICES);
        `start`: how each process is started (`AsyncEngine.spawn`'s). A replica that cannot be built stops
        the others and raises its error."""
        if size < 1:
            raise ConfigError(f"--data-parallel-size {size}: use 1 or more")
        builds = [
            build if devices is None else functools.partial(_on_devices, tuple(devices[i]), build) for i in range(size)
        ]
        with ThreadPoolExecutor(size) as pool:
            futures = [pool.submit(AsyncEngine.spawn, b, max_waiting, start) for b in builds]
        built, error = [], None
        for future in futures:
            try:
                built.append(future.result())
            except BaseException as exc:
                error = error or exc
        if error is not None:
            for engine in built:
                engine.close()
            raise error
        return cls(built)

    @classmethod
    def attached(cls, links: Sequence["EngineLink"], max_waiting: int | None = None) -> "ReplicatedEngine":
        """The replicas behind `links` (`attach()`, in another process), routed by a router of this process's own."""
        return cls([AsyncEngine.attached(link, max_waiting) for link in links])

    def attach(self) -> list["EngineLink"]:
        """A new connection to each live replica, for `attached` in another process (which routes over those);
        EngineDeadError when none lives."""
        links = []
        for replica in self.replicas:
            try:
                links.append(replica.attach())
            except EngineDeadError:  # dead, perhaps not yet seen: passed over, as the router passes it over
                continue
        if not links:
            raise EngineDeadError("every replica of this model stopped: the request did not run")
        return links

    # what the server reads of an AsyncEngine
    @property
    def num_replicas(self) -> int:
        return len(self.replicas)

    def _first_alive(self) -> AsyncEngine:
        return next((r for r in self.replicas if r.is_alive), self.replicas[0])

    @property
    def engine(self) -> Any:
        return self._first_alive().engine

    @property
    def tokenizer(self) -> Any:
        return self._first_alive().tokenizer

    @property
    def is_alive(self) -> bool:
        """Whether any replica runs: the model is served while one does."""
        return any(r.is_alive for r in self.replicas)

    @property
    def dead(self) -> list[int]:
        """The replicas whose process ended (and were not closed)."""
        return [i for i, r in enumerate(self.replicas) if not r.is_alive and not r.closed]

    @property
    def exitcode(self) -> int | None:
        return None if self.is_alive else self.replicas[0].exitcode

    @property
    def restarting(self) -> bool:
        return self._restarting or any(r.restarting for r in self.replicas)

    @property
    def num_restarts(self) -> int:
        return sum(r.num_restarts for r in self.replicas)

    @property
    def num_waiting(self) -> int:
        return sum(r.num_waiting for r in self.replicas)

    @property
    def snapshot(self) -> EngineSnapshot:
        """The live replicas' figures summed (KV usage over all their blocks)."""
        snaps = [r.snapshot for r in self.replicas if r.is_alive] or [self.replicas[0].snapshot]
        blocks = sum(s.num_kv_blocks for s in snaps)
        stats: dict[str, float] = {}
        for s in snaps:
            for key, value in s.stats.items():
                stats[key] = stats.get(key, 0.0) + value
        return EngineSnapshot(
            num_running=sum(s.num_running for s in snaps),
            num_waiting=sum(s.num_waiting for s in snaps),
            kv_usage=sum(s.kv_usage * s.num_kv_blocks for s in snaps) / blocks if blocks else 0.0,
            num_kv_blocks=blocks,
            prefix_query_tokens=sum(s.prefix_query_tokens for s in snaps),
            prefix_hit_tokens=sum(s.prefix_hit_tokens for s in snaps),
            stats=stats,
        )

    def replica_states(self) -> list[ReplicaState]:
        return [
            ReplicaState(i, r.is_alive, self._open[i], self._routed[i], r.snapshot if r.is_alive else None)
            for i, r in enumerate(self.replicas)
        ]

    def submit(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> RoutedStream:
        """Check, route and queue one request (as `AsyncEngine.submit`)."""
        if self._ended is not None:
            raise self._ended
        if self.closed:
            raise EngineDeadError("this engine was closed: the request did not run")
        params = SamplingParams() if params is None else params
        _, ids = self.engine.tokenize(prompt)  # what the router matches prefixes on
        if request_id is None:
            request_id = f"req-{next(self._ids)}"
        return RoutedStream(self, request_id, prompt, ids, params, lora_request)

    def _route(
        self, ids: list[int], prompt: Prompt, params: SamplingParams, request_id: str, lora: LoRARequest | None
    ) -> tuple[int, RequestStream]:
        """Pick a live replica and queue the request there; one found dead or full is passed over. Raises
        what the request itself is refused for (RequestError) at once; QueueFullError when every live
        replica's queue is full; EngineDeadError when none is live."""
        passed: set[int] = set()
        full: QueueFullError | None = None
        while True:
            loads: list[float | None] = []
            for i, r in enumerate(self.replicas):
                up = i not in passed and r.is_alive and not r.closed
                loads.append(self._open[i] + r.snapshot.kv_usage if up else None)
            if full is not None and all(load is None for load in loads):
                raise full
            index = self.router.pick(ids, loads)  # EngineDeadError when none is live
            try:
                stream = self.replicas[index].submit(prompt, params, request_id, lora)
            except EngineDeadError:
                passed.add(index)
                continue
            except QueueFullError as exc:
                passed.add(index)
                full = exc
                continue
            self._open[index] += 1
            self._routed[index] += 1
            return index, stream

    def _done(self, index: int) -> None:
        self._open[index] = max(0, self._open[index] - 1)

    async def call(self, fn: Callable[[Engine], Any]) -> Any:
        """fn(engine) on every live replica (adapters are loaded on each); the first one's result."""
        live = [r for r in self.replicas if r.is_alive]
        if not live:
            raise EngineDeadError("every replica of this model stopped: retry once one is back")
        results = await asyncio.gather(*(r.call(fn) for r in live))
        return results[0]

    def end_all(self, error: BaseException) -> None:
        """Every replica's open streams end with `error` (none is retried), and new requests are refused with it."""
        self._ended = error
        for r in self.replicas:
            r.end_all(error)

    async def restart(self) -> None:
        """Build every dead replica again in a fresh process (their streams ended, or were retried)."""
        self._restarting = True
        try:
            for i in self.dead:
                await self.replicas[i].restart()
                self.router.forget(i)
                self._open[i] = 0
        finally:
            self._restarting = False

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for r in self.replicas:
            r.close()
