"""The run's adapters (`infer.api.adapters`): which are served, which sit in the kind's device slots.

Rank 0 keeps the names: `add` reads an adapter's folder through the kind (a bad one is refused
before any request runs with it) and gives each load a key of its own, which its requests carry
(`Request.adapter_key`) and the prefix cache keys their blocks under; `remove` stops serving a name,
while requests already running with it finish. Each forward's sequences get their adapters' slots
(`assign`): an adapter already in a slot keeps it, another takes a free slot or the least recently
used one that this forward does not use, and the loads it needs travel with the forward
(`StepInputs.adapter_loads`), so that every rank applies them before it (`prepare`). Host copies
are kept, least recently used first out, up to `max_cpu` of them, but never one that an unfinished
request runs with (`live`, the engine's): such an adapter loads into a slot without its folder being read
again, even once it is unloaded. Another rank keeps the copies of the adapters in its slots; one evicted
there is read again from its folder, which must stay while the adapter is served.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable, Sequence

from infer.api.adapters import AdapterBatch, AdapterKind, LoRARequest
from infer.api.errors import RequestError

Load = tuple[int, int, str, str]  # (slot, key, name, path)


class Adapters:
    def __init__(self, kind: AdapterKind, max_adapters: int, max_cpu: int | None = None) -> None:
        self.kind = kind
        self.max_adapters = max_adapters
        self.max_cpu = max(max_cpu or max_adapters, 1)
        self.served: dict[str, tuple[int, LoRARequest]] = {}  # name -> (key, request): what requests may name
        self.known: dict[int, LoRARequest] = {}  # key -> its adapter, served or still finishing requests
        self.next_key = 0
        self.slots: OrderedDict[int, int] = OrderedDict()  # key -> device slot, least recently used first (rank 0)
        self.in_slot: dict[int, int] = {}  # device slot -> the key loaded there (every rank)
        self.host: OrderedDict[int, Any] = OrderedDict()  # key -> the kind's host copy
        self.num_loads = 0  # adapters copied into a device slot (a run's figure)
        # the keys unfinished requests run with (the engine sets it, on rank 0): their host copies stay
        self.live: Callable[[], set[int]] = set

    # ------------------------------------------------------------------ names (rank 0)

    def add(self, lora: Any) -> int:
        """Serve `lora` (a `LoRARequest`): its key, reading and checking its folder the first time."""
        lora = _checked(lora)
        found = self.served.get(lora.lora_name)
        if found is not None:
            key, served = found
            if (served.lora_int_id, served.lora_path) != (lora.lora_int_id, lora.lora_path):
                raise RequestError(
                    f"adapter {lora.lora_name!r} is served already as id {served.lora_int_id} from "
                    f"{served.lora_path}: use that, or another name"
                )
            return key
        for key, served in self.served.values():
            if served.lora_int_id == lora.lora_int_id:
                raise RequestError(
                    f"lora_int_id {lora.lora_int_id} is adapter {served.lora_name!r}'s already: give "
                    f"{lora.lora_name!r} another id"
                )
        host = self.kind.read(lora.lora_path, lora.lora_name)
        key, self.next_key = self.next_key, self.next_key + 1
        self.served[lora.lora_name] = (key, lora)
        self.known[key] = lora
        self._keep(key, host)
        return key

    def remove(self, name: str) -> bool:
        """Stop serving `name` (False: it was not served). Its running requests finish; its slot and host
        copy go once others need them."""
        found = self.served.pop(name, None)
        return found is not None

    def names(self) -> list[LoRARequest]:
        return [lora for _, lora in self.served.values()]

    def key_of(self, name: str) -> int | None:
        found = self.served.get(name)
        return None if found is None else found[0]

    # ------------------------------------------------------------------ a forward (rank 0)

    def assign(self, keys: Sequence[int | None]) -> tuple[list[int], list[Load]]:
        """Each sequence's slot (-1: the base model) for a forward over sequences of adapters `keys`, and
        the loads into slots it needs first."""
        wanted = list(dict.fromkeys(k for k in keys if k is not None))
        if len(wanted) > self.max_adapters:
            raise RuntimeError(
                f"a step runs {len(wanted)} adapters and --max-loras is {self.max_adapters}: the scheduler must "
                f"admit requests within --max-loras distinct adapters (infer.api.scheduling.adapter_room)"
            )
        loads: list[Load] = []
        for key in wanted:
            if key in self.slots:
                self.slots.move_to_end(key)
                continue
            used = set(self.slots.values())
            free = [s for s in range(self.max_adapters) if s not in used]
            if free:
                slot = free[0]
            else:  # the least recently used adapter this forward does not run
                victim = next(k for k in self.slots if k not in wanted)
                slot = self.slots.pop(victim)
            self.slots[key] = slot
            lora = self.known[key]
            loads.append((slot, key, lora.lora_name, lora.lora_path))
        return [-1 if k is None else self.slots[k] for k in keys], loads

    # ------------------------------------------------------------------ every rank

    def load(self, slot: int, key: int, name: str, path: str) -> None:
        """Put adapter `key` into device slot `slot` (read from `path` unless a host copy is kept)."""
        self.in_slot[slot] = key  # what the slot held before is no longer kept for it
        host = self.host.get(key)
        if host is None:
            host = self.kind.read(path, name)
            self._keep(key, host)
        else:
            self.host.move_to_end(key)
        self.kind.load(slot, host)
        self.num_loads += 1

    def prepare(
        self, loads: Sequence[Load], seq_slots: list[int], query_lens: list[int], num_rows: int | None = None
    ) -> None:
        """Before a forward: its loads, then the kind's plan. `num_rows`: a CUDA graph's replay, of that
        many rows (its bucket), every token a row of its own."""
        for load in loads:
            self.load(*load)
        if not seq_slots:  # a forward built without the adapters' slots (a benchmark's): the base model
            seq_slots = [-1] * len(query_lens)
        if num_rows is not None:
            seq_slots = [s for s, n in zip(seq_slots, query_lens) for _ in range(n)]
            query_lens = [1] * len(seq_slots)
        self.kind.plan(AdapterBatch(seq_slots, query_lens, sum(query_lens) if num_rows is None else num_rows))

    def plan_rows(self, num_rows: int) -> None:
        """A CUDA graph's capture (and its warm-up): `num_rows` rows of the base model."""
        self.kind.plan(AdapterBatch([-1] * num_rows, [1] * num_rows, num_rows, capture=True))

    def _keep(self, key: int, host: Any) -> None:
        self.host[key] = host
        self.host.move_to_end(key)
        if len(self.host) <= self.max_cpu:
            return
        pinned = self.live() | set(self.in_slot.values()) | {key}
        served = {k for k, _ in self.served.values()}
        for old in list(self.host):  # least recently used first; an unloaded adapter's as soon as it is idle
            if len(self.host) <= self.max_cpu and old in served:
                break
            if old not in pinned:
                del self.host[old]
                if old not in served:
                    self.known.pop(old, None)


def _checked(lora: Any) -> LoRARequest:
    if not isinstance(lora, LoRARequest):
        raise RequestError(
            f"lora_request must be an infer.LoRARequest(name, id, path), not {type(lora).__name__}: build one"
        )
    if not isinstance(lora.lora_name, str) or not lora.lora_name.strip():
        raise RequestError(f"LoRARequest name {lora.lora_name!r}: use a non-empty string")
    if isinstance(lora.lora_int_id, bool) or not isinstance(lora.lora_int_id, int) or lora.lora_int_id < 1:
        raise RequestError(f"LoRARequest {lora.lora_name!r}: id {lora.lora_int_id!r} must be an integer >= 1")
    if not isinstance(lora.lora_path, str) or not lora.lora_path:
        raise RequestError(f"LoRARequest {lora.lora_name!r}: give the adapter's folder as lora_path")
    return lora
