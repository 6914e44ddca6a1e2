"""The `parallel` detokenizer: one batched decode per step in a worker thread, overlapping the next forward.

A step's job is started when the engine's thread next waits on the device (`infer.api.DeviceWaits`), not when
it is submitted: run beside the host's work of launching the next forward, the worker's Python would
take the GIL from it.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from infer.api import DetokenizedDelta, DeviceWaits, RegisterFn
from infer.api.hookspecs import hookimpl
from infer.api.request import Request
from infer.plugins.detokenizer.streams import DecodeBatch, Stream, StreamTable, run_streams


class ParallelDetokenizer:
    def __init__(self, tokenizer: Any, waits: DeviceWaits | None = None) -> None:
        # a job starts at the engine's next wait on the device (alone, without `waits`: when collected)
        self._waits = waits if waits is not None else DeviceWaits()
        backend = tokenizer.backend_tokenizer
        # one Rust call for the whole batch: parallel over windows, GIL released
        self._decode: DecodeBatch = lambda ws: backend.decode_batch(ws, skip_special_tokens=True)
        self._table = StreamTable()
        self._ready: dict[str, DetokenizedDelta] = {}
        self._pending: Future[dict[str, DetokenizedDelta]] | None = None
        self._queued: tuple[list[Stream], list[tuple[str, Stream]]] | None = None  # submitted, not started
        self._starting = threading.Lock()  # a start queued in one thread may run while another collects
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="infer-detokenizer")

    def submit(self, updates: list[tuple[Request, list[int]]]) -> None:
        self._wait()  # the worker owns the streams until its job is done
        self._queued = self._table.feed(updates)
        self._waits.defer(self._start)

    def _start(self) -> None:
        with self._starting:
            queued, self._queued = self._queued, None
            if queued is not None:
                self._pending = self._worker.submit(self._job, *queued)

    def _job(self, work: list[Stream], submitted: list[tuple[str, Stream]]) -> dict[str, DetokenizedDelta]:
        run_streams(work, self._decode)
        return {rid: s.delta() for rid, s in submitted}

    def _wait(self) -> None:
        self._start()  # nobody announced a wait on the device since the submit: the job runs now
        pending = self._pending
        if pending is None:
            return
        try:
            deltas = pending.result()
        except BaseException:
            if pending.done():  # the job failed: report it once; interrupted waiting keeps the job
                self._pending = None
            raise
        self._pending = None
        self._ready.update(deltas)

    def collect(self) -> dict[str, DetokenizedDelta]:
        self._wait()
        ready, self._ready = self._ready, {}
        return ready

    def release(self, request_id: str) -> None:
        self._table.streams.pop(request_id, None)  # a running job keeps its own reference

    def close(self) -> None:
        try:
            self._wait()
        finally:
            self._worker.shutdown(wait=True)
            self._table.streams.clear()


@hookimpl
def infer_register_detokenizers(register: RegisterFn) -> None:
    register("parallel", ParallelDetokenizer)
