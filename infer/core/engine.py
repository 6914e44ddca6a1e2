"""Engine: add_request / step / abort / generate — the loop. Strategies come from the builder."""

from __future__ import annotations

import contextlib
import itertools
import queue
import random
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence, runtime_checkable

import torch

from infer.api import (
    Decoder,
    KVAllocator,
    KVUsage,
    ResettableStats,
    Scheduler,
    StatsSummary,
    TokenBudgeted,
)
from infer.api.adapters import LoRARequest
from infer.api.config import EngineConfig, ModelConfig
from infer.api.constrain import admit
from infer.api.errors import RequestError, one_line
from infer.api.request import FinishReason, Request, RequestOutput, RequestStatus, SamplingParams
from infer.core.adapters import Adapters
from infer.core.block_mover import BlockMover
from infer.core.output import Group, OutputProcessor
from infer.core.preparing import Preparations, Preparing, prepare
from infer.core.step_budget import StepBudget
from infer.core.stream import EngineStep, Streams
from infer.inputs.prompts import tokenize

CLOSED = "this engine is closed (its memory was given back): build a new LLM"

Prompt = Any  # str, token ids, {"prompt": str} or {"prompt_token_ids": [...]}: see infer.inputs.prompts


@dataclass(slots=True)
class EngineParts:
    """Everything `Engine` runs on, built and checked by `infer.runtime.builder.build_engine`."""

    config: EngineConfig
    model_config: ModelConfig
    scheduler: Scheduler
    allocator: KVAllocator  # the scheduler's: what kv_usage() reports and reset_stats() resets
    decoder: Decoder
    output: OutputProcessor
    tokenizer: Any | None
    max_model_len: int
    vocab_size: int
    eos_token_ids: frozenset[int]
    describe: dict[str, Any]  # plugin set, device, dtype, KV blocks: bound into logs and reports
    closers: tuple[Any, ...] = ()
    block_mover: BlockMover | None = None  # applies each step's KV block copies (copy-on-write, swap)
    # every model's ModelRunner in build order (target, then drafts)
    runners: tuple[Any, ...] = ()
    processors: tuple[Any, ...] = ()  # every logits processor built (`LogitsProcessor`)
    adapters: Adapters | None = None  # the run's adapters (--enable-lora), the target runner's
    # seconds each phase of the build took: "checks", "load" (weights), "kv_cache" (sized and allocated),
    # "wiring" (scheduler, decode paths: CUDA graphs captured, kernels tuned and compiled for them)
    build_phases: dict[str, float] | None = None


class Engine:
    def __init__(self, parts: EngineParts) -> None:
        self.parts = parts
        self.scheduler = parts.scheduler
        self.decoder = parts.decoder
        self.output = parts.output
        self.tokenizer = parts.tokenizer
        self.block_mover = parts.block_mover if parts.block_mover is not None else BlockMover()
        self.requests: dict[str, Request] = {}  # child id -> request, while unfinished
        if parts.adapters is not None:  # the adapters unfinished requests run with keep their host copies
            parts.adapters.live = lambda: {r.adapter_key for r in self.requests.values() if r.adapter_key is not None}
        self._arrivals = itertools.count()
        self._ids = itertools.count()
        self._rejected = itertools.count()  # ids of refused prompts: a separate count, so refusals shift no other id
        self._abort_queue: queue.SimpleQueue[Group] = queue.SimpleQueue()  # requests to abort at the next step
        self._seed_rng = random.Random(parts.config.seed)
        self.num_steps = 0
        self.decoder_totals: dict[str, float] = {}  # StepResult.stats summed over steps
        self.closed = False
        self._preparing = Preparations()  # requests waiting for their constraint, outside the scheduler
        self._refusals: list[RequestOutput] = []  # requests refused after they were added: output next step
        target_ms = parts.config.max_step_ms
        self._streams = Streams()  # the requests `stream` asked news of
        self._budget = None  # the step budget that sizes the scheduler's token budget, with max_step_ms
        self._budgeted = token_budgeted(parts.scheduler) if target_ms is not None else None
        if self._budgeted is not None and target_ms is not None:
            self._budget = StepBudget(target_ms / 1000, self._budgeted.max_num_batched_tokens)
            self._budgeted.set_token_budget(self._budget.tokens)

    # ------------------------------------------------------------------ requests

    def tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        parts = self.parts
        return tokenize(prompt, self.tokenizer, parts.vocab_size, parts.max_model_len, parts.model_config.name)

    def add_request(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        lora_request: LoRARequest | None = None,
        load_adapter: bool = True,
    ) -> str:
        """Queue one request; returns its id. `lora_request`: the adapter it runs with, served from now on
        if it was not (`add_adapter`), unless `load_adapter` is False: then one not served is refused."""
        if self.closed:
            raise RequestError(CLOSED)
        adapter_key = None
        if lora_request is not None:
            adapter_key = self._adapter_key(lora_request, load_adapter)
        if params is None:
            params = SamplingParams()
        if not isinstance(params, SamplingParams):
            raise RequestError(
                f"sampling params must be a SamplingParams, not {type(params).__name__}: "
                f"write SamplingParams(...) (SamplingParams(**d) for a dict d)"
            )
        params.validate()
        for name, k in (("logprobs", params.logprobs), ("prompt_logprobs", params.prompt_logprobs)):
            if k is not None and k > self.parts.vocab_size:
                raise RequestError(f"invalid {name}={k}: the vocabulary has {self.parts.vocab_size} tokens")
        if params.pooling is not None:
            self.output.pooling.check(params.pooling)
        if request_id is not None and not isinstance(request_id, str):
            raise RequestError(f"request_id must be a string, not {type(request_id).__name__}")
        text, ids = self.tokenize(prompt)
        if (keep := params.truncate_prompt_tokens) is not None:  # vLLM's: the prompt's last tokens only
            ids = ids[-(self.parts.max_model_len - 1 if keep == -1 else keep) :]
        limit = self.parts.max_model_len
        parent_id = request_id
        while parent_id is None or (request_id is None and parent_id in self.output.groups):  # skip ids a caller took
            parent_id = str(next(self._ids))
        if parent_id in self.output.groups:
            raise RequestError(f"request id {parent_id!r} is already in use: pick a unique id")
        now = time.perf_counter()
        children: list[Request] = []
        count = params.num_sequences  # n samples, or best_of beams
        for i in range(count):
            seed = self._seed_rng.getrandbits(63) if params.seed is None else hash((params.seed, i)) & (2**63 - 1)
            if params.seed is not None and count == 1:
                seed = params.seed
            child = Request(
                request_id=parent_id if count == 1 else f"{parent_id}.{i}",
                prompt_token_ids=ids,
                params=params,
                arrival=next(self._arrivals),
                eos_token_ids=self.parts.eos_token_ids,
                seed=seed,
                max_model_len=limit,
                arrival_time=now,
                fork_parent=children[0] if children else None,  # shares the first one's prompt blocks
                lora_request=lora_request,
                adapter_key=adapter_key,
            )
            children.append(child)
        group = Group(parent_id, text, children)
        futures = prepare(self.parts.processors, children[0])
        if any(not f.done() for f in futures):  # its constraint is being prepared (compiled): it waits outside
            self.output.add(group)
            for child in children:
                self.requests[child.request_id] = child
            timeout = self.parts.config.structured_compile_timeout_s
            self._preparing[parent_id] = Preparing(group, futures, now + timeout)
            return parent_id
        for future in futures:
            future.result()  # prepared already (a grammar compiled before): raises what preparing it raised
        for child in children:
            child.constraints = admit(self.parts.processors, child)
        self.output.add(group)
        try:
            for child in children:
                self.requests[child.request_id] = child
                self.scheduler.add(child)
        except BaseException:  # all or nothing: a request half added would run as an orphan
            self._forget(parent_id)
            raise
        return parent_id

    def abort(self, request_id: str) -> None:
        """End an unfinished request now; its output (finish reason "abort") comes from the next step."""
        self.request_abort(request_id)
        self.abort_pending()

    def request_abort(self, request_id: str) -> None:
        """Safe from any thread: the request ends at the start of the next step (or `abort`)."""
        group = self.output.groups.get(request_id) if isinstance(request_id, str) else None
        if group is None or all(c.is_finished for c in group.children):
            raise RequestError(
                f"no unfinished request has id {request_id!r} (unknown, or already finished): "
                f"nothing to abort; check the id add_request returned"
            )
        self._abort_queue.put(group)  # the group, not its id: a later request may reuse the id

    def abort_pending(self) -> None:
        """Apply the aborts `request_abort` queued; runs on the thread that steps the engine."""
        while not self._abort_queue.empty():
            group = self._abort_queue.get()
            if self.output.groups.get(group.request_id) is not group:  # it finished and was output meanwhile
                continue
            for child in group.children:
                if not child.is_finished:
                    self.scheduler.finish(child, FinishReason.ABORT)  # one still preparing is in no queue
                self.output.mark_final(child)
                self.requests.pop(child.request_id, None)
            self._preparing.cancel(group.request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self.output.has_pending()

    # ------------------------------------------------------------------ the loop

    def step(self) -> list[RequestOutput]:
        """One step: the requests it ended, with their outputs (a streamed request's news is dropped: read
        it with `step_outputs`)."""
        return [output for output, _ in self.step_outputs().finished]

    def step_outputs(self) -> EngineStep:
        """One step, as per-request outputs: the news of the streamed requests (`stream`), and each request
        that ended with its output (and, if streamed, its last StreamOutput)."""
        if self.closed:
            raise RequestError(CLOSED)
        self.abort_pending()  # asked for from other threads since the last step
        if self._preparing:
            self._admit_prepared(wait=not self.scheduler.has_unfinished() and not self.output.in_flight)
        start = time.perf_counter()
        out = self.scheduler.schedule()
        for s in out.scheduled:
            if s.request.num_cached_tokens is None:  # first scheduled: what it did not have to compute
                s.request.num_cached_tokens = s.request.num_computed_tokens
                s.request.first_scheduled_time = start
        self.block_mover.apply(out.block_ops)  # copy-on-write and swap copies, batched, before the forward
        result = self.decoder.execute(out)  # forward pass (+ sampling)
        self._stop_strings(self.output.collect())  # the previous step's text, detokenized meanwhile
        finished = self.scheduler.update(out, result)
        self.output.submit([s.request for s in out.scheduled] + finished)
        self.num_steps += 1
        for key, value in result.stats.items():
            self.decoder_totals[key] = self.decoder_totals.get(key, 0.0) + value
        if self._budget is not None and self._budgeted is not None:
            self._budgeted.set_token_budget(self._budget.observe(out.num_tokens, time.perf_counter() - start))
        return self._streams.after_step(self._finished_outputs(), self.output.in_flight)

    # ------------------------------------------------------------------ streaming: the public stepping API

    def stream(self, request_id: str, prompt: str | None = None) -> None:
        """Have `step_outputs()` report request_id's news every step: each sample's new tokens (with
        logprobs if asked for) and new text, only what no stop string can still cut, so the pieces
        concatenate to its final output; beams (whose tokens change until the end) come whole at the end.
        prompt: its text, for the final output, when it was added as token ids."""
        group = self.output.groups.get(request_id)
        if group is None:
            raise RequestError(f"no unfinished request {request_id!r} to stream: add_request() it first")
        if request_id not in self._streams.tracked:  # a second call changes nothing
            self._streams.add(group, prompt)

    def is_generating(self, request_id: str) -> bool:
        """Whether some sample of this unfinished request still generates tokens (aborting it would change
        its output); False once every sample finished and only its text is on its way, or when unknown."""
        group = self.output.groups.get(request_id)
        return group is not None and not all(r.is_finished for r in group.children)

    def abandon_all(self) -> None:
        """After a step raised: end every request without an output, free their blocks, and leave the
        runners and the detokenizer idle, so the engine serves on (what `generate` does before it re-raises)."""
        self._abandon(list(self.output.groups))
        self._streams = Streams()  # those refused in the failed step too (no longer in output.groups)

    # ------------------------------------------------------------------ constraints being prepared

    def _admit_prepared(self, wait: bool) -> None:
        """Move the requests whose preparation is done into the scheduler; refuse those it failed or that
        waited past their deadline. wait: nothing else to do, so block a little for a future to finish."""
        ready, expired = self._preparing.settle(wait)
        for preparing in ready:
            self._admit_group(preparing)
        limit = self.parts.config.structured_compile_timeout_s
        for preparing in expired:
            error = RequestError(
                f"invalid structured: the output constraint did not compile within {limit:g} s (the engine's "
                f"structured_compile_timeout_s, --structured-compile-timeout-s): simplify the schema or grammar, "
                f"or raise that limit"
            )
            self._refuse(preparing.group, error)

    def _admit_group(self, preparing: Preparing) -> None:
        group = preparing.group
        try:
            for future in preparing.futures:
                future.result()  # raises the preparation's error
            for child in group.children:
                child.constraints = admit(self.parts.processors, child)
        except Exception as exc:
            self._refuse(group, exc)
            return
        for child in group.children:
            self.scheduler.add(child)

    def _refuse(self, group: Group, exc: BaseException) -> None:
        """A request refused after it was added: its output (with `error`) comes from the next step."""
        self._preparing.cancel(group.request_id)
        first = group.children[0]
        self._refusals.append(rejected_output(group.request_id, group.prompt, exc, first.prompt_token_ids))
        for child in group.children:
            child.status = RequestStatus.FINISHED
            self.requests.pop(child.request_id, None)
        self.output.discard(group.request_id)

    def _stop_strings(self, stops: list[tuple[Request, int]]) -> None:
        for request, stop_index in stops:
            del request.output_token_ids[stop_index + 1 :]
            del request.output_logprobs[stop_index + 1 :]
            if request.is_finished:
                request.finish_reason = FinishReason.STOP
            else:
                self.scheduler.finish(request, FinishReason.STOP)

    def _finished_outputs(self) -> list[RequestOutput]:
        outputs = self.output.finished_outputs()
        if self._refusals:
            outputs, self._refusals = outputs + self._refusals, []
        for o in outputs:
            self.requests.pop(o.request_id, None)
            i = 0
            while self.requests.pop(f"{o.request_id}.{i}", None) is not None:  # every sample or beam
                i += 1
        return outputs

    # ------------------------------------------------------------------ adapters

    def add_adapter(self, lora_request: LoRARequest) -> int:
        """Serve an adapter (`LoRARequest`), reading its folder now: a RequestError names what is wrong
        with it. Requests may then name it; adding it again changes nothing. Returns its key."""
        if self.parts.adapters is None:
            raise RequestError(
                "this engine serves no adapters, and a LoRA adapter was asked for: build it with "
                "enable_lora=True (--enable-lora)"
            )
        return self.parts.adapters.add(lora_request)

    def _adapter_key(self, lora_request: LoRARequest, load: bool) -> int:
        adapters = self.parts.adapters
        if load or adapters is None:
            return self.add_adapter(lora_request)
        key = adapters.key_of(getattr(lora_request, "lora_name", None))
        if key is None or adapters.known[key] != lora_request:
            raise RequestError(
                f"the adapter {lora_request.lora_name!r} is not served (it was unloaded): load it again, or name "
                f"a served model (GET /v1/models)"
            )
        return key

    def remove_adapter(self, name: str) -> bool:
        """Stop serving adapter `name` (False: it was not served); its running requests finish."""
        return self.parts.adapters is not None and self.parts.adapters.remove(name)

    def adapter(self, name: str) -> LoRARequest | None:
        """The served adapter of that name, or None."""
        found = self.parts.adapters.served.get(name) if self.parts.adapters is not None else None
        return None if found is None else found[1]

    def list_adapters(self) -> list[LoRARequest]:
        return self.parts.adapters.names() if self.parts.adapters is not None else []

    def generate(
        self,
        prompts: Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        progress: Callable[[], None] | None = None,
    ) -> list[RequestOutput]:
        """Run prompts to completion; a bad prompt (or params) gets an output with `error` set, the rest run.

        If stepping raises (a plugin's error, KeyboardInterrupt), this call's requests are dropped
        and their blocks freed before the exception propagates: the engine is left empty and usable
        (under tensor parallelism, an interrupt inside a forward leaves the ranks out of step: the next
        call raises a WorkerError asking for a new engine)."""
        if self.closed:
            raise RequestError(CLOSED)
        if self.has_unfinished():
            raise RequestError(
                f"{len(self.output.groups)} request(s) added with add_request are unfinished: step() "
                f"until has_unfinished() is False, or abort() them, before generate()"
            )
        params_list = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise RequestError(
                f"got {len(prompts)} prompts but {len(params_list)} SamplingParams: pass one, or one per prompt"
            )
        loras = list(lora_request) if isinstance(lora_request, (list, tuple)) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise RequestError(
                f"got {len(prompts)} prompts but {len(loras)} LoRA requests: pass one, or one per prompt (None: the base)"
            )
        order: list[str] = []
        results: dict[str, RequestOutput] = {}
        try:
            for prompt, p, lora in zip(prompts, params_list, loras):
                try:
                    order.append(self.add_request(prompt, p, lora_request=lora))
                except Exception as exc:  # this prompt alone is refused; its neighbours' ids and seeds are untouched
                    refused = self.refused(prompt, exc)
                    order.append(refused.request_id)
                    results[refused.request_id] = refused
            while self.has_unfinished():
                for o, _ in self.step_outputs().finished:
                    results[o.request_id] = o
                    if progress is not None:  # a prompt done (LLM.generate's use_tqdm)
                        progress()
        except BaseException:  # nothing else was unfinished when this call began: every group is this call's
            self._abandon(list(self.output.groups))
            raise
        return [results[rid] for rid in order]

    def refused(self, prompt: Any, exc: Exception) -> RequestOutput:
        """The output of a prompt refused before it ran, under an id of its own (`rejected-N`)."""
        return rejected_output(f"rejected-{next(self._rejected)}", prompt, exc)

    def _abandon(self, request_ids: list[str]) -> None:
        """After a failed step: end these requests, free their blocks and forget them, leaving the
        runners (no forward queued ahead) and the detokenizer (no job in flight) idle."""
        for runner in self.parts.runners:
            runner.discard_ahead()
        with contextlib.suppress(Exception):  # the detokenizer may be what failed
            self._stop_strings(self.output.collect())
        for rid in request_ids:
            self._forget(rid)
        self._refusals.clear()
        self._streams.submitted = []

    def _forget(self, request_id: str) -> None:
        """End a request group, free its blocks and drop it without an output."""
        self._preparing.cancel(request_id)
        self._streams.remove(request_id)
        group = self.output.groups.get(request_id)
        for child in group.children if group else []:
            self.scheduler.finish(child, FinishReason.ABORT)  # frees its blocks; no-op when finished or never added
            self.requests.pop(child.request_id, None)
        self.output.discard(request_id)

    # ------------------------------------------------------------------ reporting

    @property
    def model(self) -> Any:
        """The target model as built (a `CausalLM`), for kits and tools that inspect its layers; stepping
        never needs it."""
        return self.parts.runners[0].model

    def kv_usage(self) -> KVUsage:
        return self.parts.allocator.usage()

    def reset_stats(self) -> None:
        """Count from here on: steps, preemptions, the decoder's totals, pipelined steps and the prefix cache's
        lookups and hits (after a warm-up run)."""
        self.num_steps = 0
        self.decoder_totals.clear()
        if isinstance(self.parts.scheduler, ResettableStats):  # the scheduler as built, however wrapped since
            self.parts.scheduler.reset_stats()
        if isinstance(self.parts.allocator, ResettableStats):
            self.parts.allocator.reset_stats()
        for runner in self.parts.runners:
            if runner.pipeline is not None:
                runner.pipeline.hits = runner.pipeline.misses = 0

    def stats(self) -> dict[str, float]:
        stats = {"steps": self.num_steps, **self.scheduler.stats(), **self.decoder_stats()}
        runner = self.parts.runners[0] if self.parts.runners else None
        if runner is not None and runner.pipeline is not None:  # decode pipelining: steps served ahead (and
            # speculative verify steps that took their new tokens' rows from a forward queued ahead)
            stats.update(pipelined_steps=runner.pipeline.hits, pipeline_misses=runner.pipeline.misses)
        return stats

    def decoder_stats(self) -> dict[str, float]:
        """The decoder's step stats summed over the run, plus its own summary (acceptance rate, ...)."""
        summary = self.decoder.summarize(self.decoder_totals) if isinstance(self.decoder, StatsSummary) else {}
        return {**self.decoder_totals, **summary}

    def close(self) -> None:
        """Stop the workers and give the device memory back, even while this engine is still referenced.
        Idempotent; the engine cannot run after it."""
        if self.closed:
            return
        self.closed = True
        try:
            self.output.close()
            for closer in self.parts.closers:
                closer()
        finally:
            for runner in self.parts.runners:
                runner.release()
            if any(r.device.type == "cuda" for r in self.parts.runners):
                torch.cuda.empty_cache()  # the next engine's KV budget is read from the device's free memory


@runtime_checkable
class _BudgetAttribute(Protocol):
    """Plugin API 2.1's `TokenBudgeted`: a scheduler whose budget the engine wrote as an attribute."""

    max_num_batched_tokens: int


class _AttributeBudget:
    """Sets a `_BudgetAttribute` scheduler's budget the way plugin API 2.1 did: by writing the attribute."""

    def __init__(self, scheduler: _BudgetAttribute) -> None:
        self.scheduler = scheduler
        self.max_num_batched_tokens = scheduler.max_num_batched_tokens  # read once, at the engine's start

    def set_token_budget(self, tokens: int) -> None:
        self.scheduler.max_num_batched_tokens = self.max_num_batched_tokens = tokens


def token_budgeted(scheduler: Scheduler) -> TokenBudgeted | None:
    """The scheduler as a `TokenBudgeted`, whose budget the engine sizes with max_step_ms; None if it has no
    budget. One with the budget attribute alone (plugin API 2.1) still gets it, with a DeprecationWarning."""
    if isinstance(scheduler, TokenBudgeted):
        return scheduler
    if not isinstance(scheduler, _BudgetAttribute):
        return None
    warnings.warn(
        f"scheduler {type(scheduler).__name__} has max_num_batched_tokens but no set_token_budget(tokens): the "
        "engine writes the attribute for now; define set_token_budget (infer.api.TokenBudgeted), which plugin "
        "API 3 alone calls",
        DeprecationWarning,
        stacklevel=3,
    )
    return _AttributeBudget(scheduler)


def rejected_output(
    request_id: str, prompt: Any, exc: BaseException, prompt_token_ids: Sequence[int] = ()
) -> RequestOutput:
    """The output of a prompt refused before it ran: `error` is one line naming the problem and the fix."""
    error = (
        str(exc) if isinstance(exc, RequestError) else f"this prompt could not be added ({type(exc).__name__}: {exc})"
    )
    text = prompt if isinstance(prompt, str) else None
    return RequestOutput(request_id, text, list(prompt_token_ids), [], finished=True, error=one_line(error))
