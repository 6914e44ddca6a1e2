"""`xgrammar`: structured output (a JSON schema, any JSON object, a regex, a choice, an EBNF grammar).

A request's constraint compiles beside the step loop (`prepare`: a small pool of threads; xgrammar
releases the GIL while it compiles), and the request waits outside the running batch until it has;
then it gets a matcher that follows its tokens. Requests asking for the same constraint share one
compile, and the last COMPILED_KEPT compiled grammars are kept, so a repeated schema compiles once;
a compile whose every request left before it began never runs.
Each step needs a token bitmask per row, filled on the host. It starts ahead (`AheadProcessor`): as
soon as a step's tokens reach the host, up to four workers (a quarter of the cores), each with a
contiguous chunk of the rows, have the matchers take them and fill the masks for the next token
(xgrammar spreads each chunk's matchers over a bounded pool of its own threads and lets go of the
GIL), while the engine goes on with its host work (outputs, the scheduler, the next
step's inputs) and the GPU with the next forward. The next step's `apply` waits for it and fills only
the rows it did not (a request new to the batch, a request whose state moved since); one copy takes
the masks to the device and one kernel sets the masked logits to -inf for all the rows. Speculative
decoding's accepted tokens are taken ahead the same way; its verify rows are filled after the matcher
has taken the draft before them (the draft is known only then); rejected tokens are rolled back.

JSON is generated compact (", " and ": ", no other whitespace), so no raw control character
(U+0000-U+001F) belongs anywhere in it: inside a string JSON escapes them. xgrammar 0.2.8 lets a
string with minLength or maxLength hold them (a tab: mlc-ai/xgrammar#800), and json.loads refuses
the document; so on a JSON request's rows the tokens holding a byte below 0x20 are masked too.
"""

from __future__ import annotations

import importlib.util
import json
import os
import queue
import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from infer.api import AheadRow, Capabilities, LogitsRow, ProcessorContext, RegisterFn
from infer.api.errors import RequestError, one_line
from infer.api.hookspecs import hookimpl
from infer.api.request import Request
from infer.api.structured import StructuredOutputs
from infer.api.transfer import row_index
from infer.common import cpus
from infer.common.log import get_logger

log = get_logger()
COMPILED_KEPT = 64  # compiled grammars kept for requests that repeat a constraint
COMPILE_THREADS = max(1, min(2, (os.cpu_count() or 1) // 2))  # compiles at once (each a pool thread)
FILL_THREADS = 8  # at most this many threads fill one step's masks (xgrammar's pools; half the usable cores)
AHEAD_WORKERS = 4  # at most this many workers take a step's tokens and fill its masks ahead (a quarter of the cores)
AHEAD_ROWS_PER_WORKER = 8  # a worker for each this many rows, up to AHEAD_WORKERS
XGRAMMAR_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")  # "[21:45:25] /project/cpp/regex_converter.cc:83: "


def _missing() -> str | None:
    if importlib.util.find_spec("xgrammar") is None:
        return "xgrammar is not installed: pip install xgrammar"
    return None


@dataclass(slots=True)
class MatcherState:
    matcher: Any  # xgrammar.GrammarMatcher
    consumed: int = 0  # output tokens the matcher has taken
    broken: bool = False  # it refused an output token: the request runs unconstrained from there
    ended: bool = False  # it took a stop token: the grammar is over
    is_json: bool = False  # a JSON document (compact): tokens holding a raw control character are masked
    ahead: int = -1  # the ahead job (its number) that filled this matcher's next mask, at row `ahead_row`
    ahead_row: int = -1


class XGrammarProcessor:
    serves = ("structured",)  # the SamplingParams fields it answers for: a request asking for one is refused without it
    # the conformance kit's request (infer.testing.constraints): SamplingParams fields this admits
    kit_params = {"structured": {"json_object": True}}
    capabilities = Capabilities(available=_missing)

    def __init__(self, ctx: ProcessorContext) -> None:
        self.ctx = ctx
        self._compiler: Any = None  # built at the first structured request: a run without one pays nothing
        self._batch: Any = None
        self._host: torch.Tensor | None = None  # [rows, words] int32 bitmask, pinned for a GPU
        self._no_control: torch.Tensor | None = None  # [words] int32: the tokens without a byte below 0x20
        self._pool: _DaemonPool | None = None  # compiles beside the step loop, made at the first
        self._compiles: OrderedDict[tuple[str, str], _Compile] = OrderedDict()  # constraint -> its compile
        self._lock = threading.Lock()  # _compiles is read by the engine's thread and the pool's callbacks
        # the masks filled ahead (`ahead`): a step's rows in chunks, one job per worker, into _ahead_host
        self._ahead_pool: _DaemonPool | None = None
        self._ahead_jobs: list[Future] = []
        self._ahead_batches: list[Any] = []  # one xgrammar BatchGrammarMatcher per ahead worker
        self._ahead_host: torch.Tensor | None = None  # [rows, words] int32, pinned for a GPU
        self._jobs = 0  # the number of the newest ahead job: a state filled by an older one is stale
        self._copied: Any = None  # a CUDA event after the last copy of a host bitmask to the device
        self.rows_ahead = 0  # one-row-per-request masks the ahead job filled, and those filled in their step
        self.rows_in_step = 0
        self.seconds_ahead = 0.0  # the ahead jobs' time (beside the step), and `apply`'s (in it: waits included)
        self.seconds_waited = 0.0  # of which `apply` waited for an ahead job
        self.seconds_applying = 0.0
        self.seconds_filling = 0.0  # of the ahead jobs' time, the mask fill alone (the rest: taking the tokens)

    def prepare(self, request: Request) -> Future | None:
        spec = request.params.structured
        if spec is None or spec.backend not in (None, "xgrammar") or self.ctx.tokenizer is None:
            return None  # admit answers (or refuses) it at once
        key = _key(spec)
        with self._lock:
            entry = self._compiles.get(key)
            if entry is None or entry.shared.cancelled():
                if self._pool is None:
                    self._pool = _DaemonPool(COMPILE_THREADS)
                grammar = grammar_of(spec)  # fast (milliseconds): a bad constraint is refused here, at once
                entry = _Compile(self._pool.submit(self.compile, spec, grammar))
                self._compiles[key] = entry
            self._compiles.move_to_end(key)
            self._evict()
            return entry.waiter()

    def _evict(self) -> None:
        done = [k for k, e in self._compiles.items() if e.shared.done()]
        for key in done[: max(0, len(done) - COMPILED_KEPT)]:
            del self._compiles[key]

    def admit(self, request: Request) -> MatcherState | None:
        spec = request.params.structured
        if spec is None or spec.backend not in (None, "xgrammar"):
            return None
        if self.ctx.tokenizer is None:
            raise RequestError(
                "structured output needs the model's tokenizer, and this model has none on disk: "
                "pass --tokenizer NAME_OR_PATH"
            )
        import xgrammar as xgr

        with self._lock:
            entry = self._compiles.get(_key(spec))
        compiled = entry.shared.result() if entry is not None and entry.shared.done() else self.compile(spec)
        return MatcherState(xgr.GrammarMatcher(compiled), is_json=spec.kind in ("json", "json_object"))

    def compile(self, spec: StructuredOutputs, grammar: Any = None) -> Any:
        """The compiled grammar (slow: a pool thread runs it); `grammar`: `grammar_of(spec)` if known."""
        grammar = grammar_of(spec) if grammar is None else grammar
        with self._lock:  # one compiler, built once, whichever thread asks first
            compiler = self._compiler or self._build_compiler()
        try:
            return compiler.compile_grammar(grammar)
        except Exception as exc:  # xgrammar raises RuntimeError / ValueError with the parser's message
            raise _invalid(spec.kind, exc) from None

    def _build_compiler(self) -> Any:
        import xgrammar as xgr

        info = xgr.TokenizerInfo.from_huggingface(
            self.ctx.tokenizer, vocab_size=self.ctx.vocab_size, stop_token_ids=sorted(self.ctx.eos_token_ids)
        )
        self._compiler = xgr.GrammarCompiler(info, max_threads=COMPILE_THREADS, cache_limit_bytes=512 << 20)
        self._no_control = no_control_bitmask(info.decoded_vocab, self.ctx.vocab_size)
        threads = max(1, min(FILL_THREADS, cpus.available() // 2))
        self._batch = xgr.BatchGrammarMatcher(max_threads=threads)
        workers = max(1, min(AHEAD_WORKERS, cpus.available() // 4))
        self._ahead_batches = [xgr.BatchGrammarMatcher(max_threads=max(1, threads // workers)) for _ in range(workers)]
        return self._compiler

    def ahead(self, rows: Sequence[AheadRow]) -> None:
        """Start the next step's masks for `rows` on the ahead workers: each matcher takes its new tokens
        and fills its next mask into row i of `_ahead_host` (i: its place in `rows`), the rows split into
        one contiguous chunk per worker. Returns at once."""
        self._settle_ahead()  # jobs `apply` never waited for: their states are theirs until they end
        self._jobs += 1
        work = [
            (row.request, row.state, tuple(row.tokens), len(row.request.output_token_ids))
            for row in rows
            if not row.state.broken and not row.state.ended
        ]
        if not work or not self._ahead_batches:
            return
        if self._copied is not None:  # the last copy of the host masks to the device is done: they may change
            self._copied.synchronize()
        if self._ahead_host is None or self._ahead_host.shape[0] < len(work):
            self._ahead_host = self._host_bitmask(len(work))
        if self._ahead_pool is None:
            self._ahead_pool = _DaemonPool(len(self._ahead_batches), "infer-grammar-ahead")
        workers = min(len(self._ahead_batches), max(1, len(work) // AHEAD_ROWS_PER_WORKER))
        size = -(-len(work) // workers)
        self._ahead_jobs = [
            self._ahead_pool.submit(self._fill_ahead, work[start : start + size], self._jobs, start, batch)
            for start, batch in zip(range(0, len(work), size), self._ahead_batches)
        ]

    def _fill_ahead(
        self, work: list[tuple[Request, MatcherState, tuple[int, ...], int]], job: int, offset: int, batch: Any
    ) -> tuple[float, float]:
        """An ahead worker: each matcher (caught up to its request's `had` tokens) takes `tokens`, then the
        live ones fill their next masks, rows offset.. of `_ahead_host`, in one call of `batch`."""
        started = time.perf_counter()
        filling = self._take_and_fill(work, job, offset, batch)
        return time.perf_counter() - started, filling  # summed by `_settle_ahead`, on the engine's thread

    def _take_and_fill(
        self, work: list[tuple[Request, MatcherState, tuple[int, ...], int]], job: int, offset: int, batch: Any
    ) -> float:
        """Returns the seconds the fill took."""
        stops = self.ctx.eos_token_ids
        one: list[tuple[Request, MatcherState, int]] = []
        for request, state, tokens, had in work:
            if state.consumed != had:  # behind (or ahead of) its request: `apply` catches it up
                continue
            if len(tokens) == 1:
                one.append((request, state, tokens[0]))
                continue
            for token in tokens:  # speculation: several tokens, one at a time
                if state.broken or state.ended:
                    break
                _took(request, state, state.matcher.accept_token(token), True)
        if one:
            accepted = batch.batch_accept_token([s.matcher for _, s, _ in one], [t for _, _, t in one])
            for (request, state, token), ok in zip(one, accepted):
                _took(request, state, ok, token in stops)
        filling = [
            (offset + i, s)
            for i, (r, s, t, had) in enumerate(work)
            if s.consumed == had + len(t) and not s.broken and not s.ended
        ]
        if not filling:
            return 0.0
        assert self._ahead_host is not None
        started = time.perf_counter()
        batch.batch_fill_next_token_bitmask([s.matcher for _, s in filling], self._ahead_host, [i for i, _ in filling])
        for i, state in filling:
            state.ahead, state.ahead_row = job, i
        return time.perf_counter() - started

    def _settle_ahead(self) -> None:
        """Wait for the ahead jobs; one that failed leaves its states to `apply` (which fills them again)."""
        jobs, self._ahead_jobs = self._ahead_jobs, []
        for job in jobs:
            waited = not job.done()
            started = time.perf_counter()
            try:
                seconds, filling = job.result()
                self.seconds_ahead += seconds
                self.seconds_filling += filling
            except Exception as exc:  # noqa: BLE001 - the masks are filled again on the step's own path
                self._jobs += 1
                log.warning(
                    "structured output: the masks filled ahead failed; filling them in the step", error=one_line(exc)
                )
            if waited:
                self.seconds_waited += time.perf_counter() - started

    def apply(self, logits: torch.Tensor, rows: Sequence[LogitsRow]) -> None:
        started = time.perf_counter()
        try:
            self._apply(logits, rows)
        finally:
            self.seconds_applying += time.perf_counter() - started

    def _apply(self, logits: torch.Tensor, rows: Sequence[LogitsRow]) -> None:
        import xgrammar as xgr

        self._settle_ahead()
        live = self._catch_up(rows)
        if all(not row.draft for row in live):  # one row per request: the masks filled ahead, the rest at once
            bitmask = self._one_per_request(live, logits.shape[0])
            indices = [row.index for row in live]
        else:
            bitmask = self._bitmask(logits.shape[0])
            indices = _fill_drafts(live, bitmask)
        if not indices:
            return
        bits = bitmask
        if logits.device.type != "cpu":
            bits = bitmask.to(logits.device, non_blocking=True)
            if logits.device.type == "cuda":
                self._copied = torch.cuda.Event()
                self._copied.record()
        filled = set(indices)
        if json_rows := [row.index for row in live if row.state.is_json and row.index in filled]:
            assert self._no_control is not None
            if self._no_control.device != bits.device:  # on the logits' device: the AND runs there
                self._no_control = self._no_control.to(bits.device)
            forbid_control_bytes(bits, row_index(json_rows, bits.shape[0], bits.device), self._no_control)
        xgr.apply_token_bitmask_inplace(logits, bits, vocab_size=self.ctx.vocab_size, indices=indices)

    def _one_per_request(self, live: Sequence[LogitsRow], num_rows: int) -> torch.Tensor:
        """The bitmask of a step with a row per request: row `row.index` for each live row. The rows the
        ahead job filled come from its buffer (that buffer itself when they are the step's rows, in
        order); the others are filled now."""
        done: list[LogitsRow] = []
        rest: list[LogitsRow] = []
        for row in live:
            fresh = row.state.ahead == self._jobs and row.state.consumed == len(row.request.output_token_ids)
            (done if fresh else rest).append(row)
        self.rows_ahead += len(done)
        self.rows_in_step += len(rest)
        if len(done) == len(live) == num_rows and all(row.index == row.state.ahead_row for row in live):
            assert self._ahead_host is not None
            return self._ahead_host[:num_rows]
        bitmask = self._bitmask(num_rows)
        if done:
            assert self._ahead_host is not None
            src = torch.tensor([row.state.ahead_row for row in done])
            dst = torch.tensor([row.index for row in done])
            bitmask.index_copy_(0, dst, self._ahead_host.index_select(0, src))
        if rest:
            self._batch.batch_fill_next_token_bitmask(
                [row.state.matcher for row in rest], bitmask, [row.index for row in rest]
            )
        return bitmask

    def _catch_up(self, rows: Sequence[LogitsRow]) -> list[LogitsRow]:
        """Feed each matcher its request's output tokens it has not seen (the usual one: all of them in
        one call); returns the rows still constrained (not ended, no token refused)."""
        one: list[LogitsRow] = []
        tokens: list[int] = []
        seen: set[int] = set()
        for row in rows:
            state, out = row.state, row.request.output_token_ids
            if id(state) in seen:  # speculative verify rows: several rows per request
                continue
            seen.add(id(state))
            if state.consumed == len(out) - 1 and not state.broken:
                one.append(row)
                tokens.append(out[-1])
            elif state.consumed < len(out):
                _catch_up_one(row.request, state)
        if one:
            accepted = self._batch.batch_accept_token([row.state.matcher for row in one], tokens)
            stops = self.ctx.eos_token_ids
            for row, token, ok in zip(one, tokens, accepted):
                _took(row.request, row.state, ok, token in stops)
        return [row for row in rows if not row.state.broken and not row.state.ended]

    def _bitmask(self, num_rows: int) -> torch.Tensor:
        if self._host is None or self._host.shape[0] < num_rows:
            self._host = self._host_bitmask(num_rows)
        return self._host[:num_rows]

    def _host_bitmask(self, num_rows: int) -> torch.Tensor:
        """[at least num_rows, words] int32 on the host, pinned when the logits are on a GPU."""
        host = torch.empty(max(num_rows, 64), (self.ctx.vocab_size + 31) // 32, dtype=torch.int32)
        return host.pin_memory() if torch.device(self.ctx.device).type == "cuda" else host


def grammar_of(spec: StructuredOutputs) -> Any:
    """The constraint as an xgrammar Grammar, not yet compiled against the vocabulary (milliseconds)."""
    import xgrammar as xgr

    kind = spec.kind
    try:
        if kind == "json":
            return xgr.Grammar.from_json_schema(spec.schema(), any_whitespace=False)
        if kind == "json_object":
            return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False)
        if kind == "regex":
            return xgr.Grammar.from_regex(spec.regex)
        if kind == "choice":
            return xgr.Grammar.from_ebnf(choice_grammar(spec.choice or []))
        return xgr.Grammar.from_ebnf(spec.grammar)
    except Exception as exc:  # xgrammar raises RuntimeError / ValueError with the parser's message
        raise _invalid(kind, exc) from None


def _invalid(kind: str, exc: BaseException) -> RequestError:
    reason = XGRAMMAR_LOG_PREFIX.sub("", one_line(exc))
    return RequestError(f"invalid structured.{kind}: {reason}: fix the {kind}")


def _key(spec: StructuredOutputs) -> tuple[str, str]:
    """What a compile is shared by: the constraint's kind and text."""
    if spec.kind == "json":
        return "json", spec.schema()
    text = {"regex": spec.regex, "choice": json.dumps(spec.choice), "grammar": spec.grammar}.get(spec.kind)
    return spec.kind, str(text)


class _DaemonPool:
    """Threads that run submitted calls into futures; daemons, unlike ThreadPoolExecutor's, so a runaway
    compile never holds the interpreter's exit (or a server's shutdown) hostage."""

    def __init__(self, num_threads: int, name: str = "infer-grammar") -> None:
        self._queue: queue.SimpleQueue[tuple[Future, Any, tuple[Any, ...]]] = queue.SimpleQueue()
        for i in range(num_threads):
            threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True).start()

    def submit(self, fn: Any, *args: Any) -> Future:
        future: Future = Future()
        self._queue.put((future, fn, args))
        return future

    def _work(self) -> None:
        while True:
            future, fn, args = self._queue.get()
            if not future.set_running_or_notify_cancel():  # cancelled while queued
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as exc:
                future.set_exception(exc)


class _Compile:
    """One compile shared by the requests that ask for it: each waits on a future of its own; when every
    waiter is cancelled (its request left) before the compile starts, it does not run."""

    def __init__(self, shared: Future) -> None:
        self.shared = shared
        self.num_waiting = 0

    def waiter(self) -> Future:
        mine: Future = Future()
        self.num_waiting += 1

        def settle(shared: Future) -> None:
            if not mine.set_running_or_notify_cancel():
                return
            if shared.cancelled():
                mine.set_exception(RequestError("the output constraint's compile was cancelled: retry the request"))
            elif shared.exception() is not None:
                mine.set_exception(shared.exception())
            else:
                mine.set_result(None)

        def left(f: Future) -> None:
            if f.cancelled():
                self.num_waiting -= 1
                if self.num_waiting == 0:
                    self.shared.cancel()  # not started yet: it never runs; running: it ends on its own

        mine.add_done_callback(left)
        self.shared.add_done_callback(settle)
        return mine


def _catch_up_one(request: Request, state: MatcherState) -> None:
    """Feed the matcher the request's output tokens it has not seen, one at a time."""
    out = request.output_token_ids
    while state.consumed < len(out) and not state.broken:
        token = out[state.consumed]
        _took(request, state, state.matcher.accept_token(token), True)


def _took(request: Request, state: MatcherState, accepted: bool, may_end: bool) -> None:
    """Record the matcher's answer to the next output token (`may_end`: it may have ended the grammar)."""
    if not accepted:
        state.broken = True
        log.warning("structured output: token refused, request unconstrained", request_id=request.request_id)
        return
    state.consumed += 1
    if may_end:
        state.ended = state.matcher.is_terminated()


def _fill_drafts(rows: Sequence[LogitsRow], bitmask: torch.Tensor) -> list[int]:
    """Verify rows: each request's rows in draft order; the matcher takes the draft one token at a
    time, filling each row's mask, then gives it back. A row after a token the grammar refuses is
    never kept (the mask of the row before rejects that token), so it is left unmasked."""
    indices: list[int] = []
    groups: dict[int, list[LogitsRow]] = {}
    for row in rows:
        groups.setdefault(id(row.state), []).append(row)
    for group in groups.values():
        group.sort(key=lambda r: len(r.draft))
        matcher, fed, ok = group[0].state.matcher, 0, True
        for row in group:
            while ok and fed < len(row.draft):
                ok = matcher.accept_token(row.draft[fed])
                fed += ok
            if ok and not matcher.is_terminated():
                matcher.fill_next_token_bitmask(bitmask, row.index)
                indices.append(row.index)
        if fed:
            matcher.rollback(fed)
    return indices


def no_control_bitmask(vocab: Sequence[bytes], vocab_size: int) -> torch.Tensor:
    """[ceil(vocab_size / 32)] int32, xgrammar's bit layout (token t: word t // 32, bit t % 32): the
    tokens of `vocab` (their bytes) that hold no byte below 0x20; ids past `vocab` are left out."""
    allowed = np.zeros(-(-vocab_size // 32) * 32, dtype=bool)
    allowed[: min(len(vocab), vocab_size)] = [not any(b < 0x20 for b in token) for token in vocab[:vocab_size]]
    return torch.from_numpy(np.packbits(allowed, bitorder="little").view("<i4").copy())


def forbid_control_bytes(bitmask: torch.Tensor, rows: torch.Tensor | slice, no_control: torch.Tensor) -> None:
    """Mask the tokens holding a control character on `rows` of the filled `bitmask`, where it is (on
    a GPU: a few small kernels, no host work); a row that would keep nothing (a grammar that asks for
    one) is left as it was."""
    old = bitmask[rows]
    masked = old & no_control
    kept = masked.ne(0).any(dim=1, keepdim=True)
    bitmask[rows] = torch.where(kept, masked, old)


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose sentences are exactly `choices`."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


@hookimpl
def infer_register_logits_processors(register: RegisterFn) -> None:
    register("xgrammar", XGrammarProcessor)
