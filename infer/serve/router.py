"""The data-parallel router (`infer.serve.replicas`): which replica takes a request, by the prefix it
holds of the request's prompt, else by load."""

from __future__ import annotations

import itertools
from collections import OrderedDict
from typing import Sequence

from infer.api.errors import ConfigError
from infer.serve.engine_thread import EngineDeadError

__all__ = ["PrefixRouter"]


class PrefixRouter:
    """Picks a replica for a prompt: the holder of its longest remembered prefix, else the least loaded.

    `block_size` tokens make a block; `capacity` blocks are remembered at most (least recently routed
    forgotten first)."""

    def __init__(
        self,
        num_replicas: int,
        block_size: int = 16,
        capacity: int = 1 << 16,
        cache_threshold: float = 0.5,
        balance_abs: int = 8,
        balance_rel: float = 1.5,
    ) -> None:
        if num_replicas < 1:
            raise ConfigError(f"a router needs at least one replica, not {num_replicas}")
        self.num_replicas = num_replicas
        self.block_size = block_size
        self.capacity = capacity
        self.cache_threshold = cache_threshold
        self.balance_abs = balance_abs
        self.balance_rel = balance_rel
        self._holder: OrderedDict[int, int] = OrderedDict()  # prefix hash -> the replica that last took it
        self._turn = itertools.count()  # breaks ties between equally loaded replicas in turn
        self.prefix_routed = 0  # requests sent to a prefix's holder
        self.load_routed = 0  # requests sent to the least loaded

    def _hashes(self, ids: Sequence[int]) -> list[int]:
        hashes, h, size = [], 0, self.block_size
        for start in range(0, len(ids) - size + 1, size):
            h = hash((h, tuple(ids[start : start + size])))
            hashes.append(h)
        return hashes

    def match(self, ids: Sequence[int], up: Sequence[bool]) -> tuple[int | None, int]:
        """(the replica that holds the longest remembered prefix of `ids` among those `up`, its length in tokens)."""
        return self._match(self._hashes(ids), up)

    def _match(self, hashes: list[int], up: Sequence[bool]) -> tuple[int | None, int]:
        best, length = None, 0
        for i, h in enumerate(hashes):
            replica = self._holder.get(h)
            if replica is None:
                break
            if up[replica]:
                best, length = replica, (i + 1) * self.block_size
        return best, length

    def pick(self, ids: Sequence[int], loads: Sequence[float | None]) -> int:
        """loads: per replica, its open requests (plus a fraction for its KV usage); None for one that is down."""
        up = [load is not None for load in loads]
        live = [i for i, ok in enumerate(up) if ok]
        if not live:
            raise EngineDeadError(
                "every replica of this model stopped: the request did not run; retry it once one is back"
            )
        values = {i: float(loads[i]) for i in live}  # type: ignore[arg-type]
        low, high = min(values.values()), max(values.values())
        balanced = not (high - low > self.balance_abs and high > self.balance_rel * max(low, 1.0))
        hashes = self._hashes(ids)  # once: matched, then recorded under the replica chosen
        if balanced:
            holder, length = self._match(hashes, up)
            if holder is not None and length >= self.cache_threshold * len(ids):
                self.prefix_routed += 1
                self._record(hashes, holder)
                return holder
        self.load_routed += 1
        turn = next(self._turn)
        choice = min(live, key=lambda i: (values[i], (i - turn) % self.num_replicas))
        self._record(hashes, choice)
        return choice

    def record(self, ids: Sequence[int], replica: int) -> None:
        """`replica` took a request of prompt `ids`: its prefix's blocks are now held there."""
        self._record(self._hashes(ids), replica)

    def _record(self, hashes: list[int], replica: int) -> None:
        holder = self._holder
        for h in hashes:
            holder[h] = replica
            holder.move_to_end(h)
        while len(holder) > self.capacity:
            holder.popitem(last=False)

    def forget(self, replica: int) -> None:
        """A replica restarted with an empty cache: what it held is held nowhere."""
        for h in [h for h, r in self._holder.items() if r == replica]:
            del self._holder[h]
