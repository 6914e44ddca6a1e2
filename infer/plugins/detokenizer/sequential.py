"""The `sequential` detokenizer: each step's text decoded on the engine's thread."""

from __future__ import annotations

from typing import Any

from infer.api import DetokenizedDelta, DeviceWaits, RegisterFn
from infer.api.hookspecs import hookimpl
from infer.api.request import Request
from infer.plugins.detokenizer.streams import DecodeBatch, StreamTable, run_streams


class SequentialDetokenizer:
    def __init__(self, tokenizer: Any, waits: DeviceWaits | None = None) -> None:  # decodes in `submit`: defers nothing
        backend = tokenizer.backend_tokenizer
        self._decode: DecodeBatch = lambda ws: [backend.decode(w, skip_special_tokens=True) for w in ws]
        self._table = StreamTable()
        self._ready: dict[str, DetokenizedDelta] = {}

    def submit(self, updates: list[tuple[Request, list[int]]]) -> None:
        work, submitted = self._table.feed(updates)
        for stream in work:
            run_streams([stream], self._decode)
        self._ready.update((rid, s.delta()) for rid, s in submitted)

    def collect(self) -> dict[str, DetokenizedDelta]:
        ready, self._ready = self._ready, {}
        return ready

    def release(self, request_id: str) -> None:
        self._table.streams.pop(request_id, None)

    def close(self) -> None:
        self._table.streams.clear()


@hookimpl
def infer_register_detokenizers(register: RegisterFn) -> None:
    register("sequential", SequentialDetokenizer)
