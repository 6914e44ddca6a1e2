"""`LLM`: the engine embedded in an application, with the same choices as the CLI."""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Mapping
from typing import Any, Callable, Iterable, Iterator, Sequence

from infer.api.adapters import LoRARequest
from infer.api.config import EngineConfig
from infer.api.errors import RequestError
from infer.api.pooling import PoolingParams
from infer.api.request import EmbeddingRequestOutput, RequestOutput, SamplingParams
from infer.api.vllm import engine_options as vllm_names
from infer.api.vllm import method_refusal
from infer.core.engine import Prompt
from infer.distributed.launch import launch
from infer.inputs.prompts import as_batch
from infer.runtime.builder import make_engine


class LLM:
    """Offline generation.

    >>> llm = LLM(model="smollm2-135m", attention="torch")
    >>> out = llm.generate(["Hello"], SamplingParams(max_tokens=8, temperature=0))
    """

    def __init__(
        self, model: str = "smollm2-135m", plugins: Iterable[Any] = (), tensor_parallel_size: int = 1, **options: Any
    ) -> None:
        # options: any EngineConfig field (attention, scheduler, sampler, block_size, num_kv_blocks, ...)
        import structlog

        if not structlog.is_configured():  # an embedding app that did not set up logging hears only warnings
            from infer.common.log import configure

            configure(level="warning")
        fields = {f.name for f in dataclasses.fields(EngineConfig)}
        options = vllm_names(options, fields)  # vLLM's keywords (kv_cache_memory, enforce_eager, ...) too
        config = EngineConfig().replace(model=model, tensor_parallel_size=tensor_parallel_size, **options)
        self.config = config
        self.engine = make_engine(config, extra_plugins=plugins, launch=launch)  # launch: --tp N's ranks
        self._lock = threading.Lock()  # one caller steps the engine at a time; abort only queues

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def __getattr__(self, name: str) -> Any:
        """vLLM's LLM methods that infer lacks: an AttributeError that says what to use instead."""
        refused = method_refusal(name)
        raise AttributeError(refused or f"'LLM' object has no attribute {name!r}")

    def get_tokenizer(self) -> Any:
        """The model's tokenizer (transformers'), as vLLM's `LLM.get_tokenizer`; None for a model without one."""
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """One prompt or a list: strings, token-id lists, {"prompt": str} or {"prompt_token_ids": [...]}.
        `lora_request`: the adapter they run with (an engine built with enable_lora=True), or one per
        prompt (None: the base model); the adapter's folder is read the first time it is named. `use_tqdm`:
        a progress bar of the prompts done, on stderr (vLLM's keyword; infer's default is none).

        A bad prompt or params gets an output with `error` set; the others run as they would alone.
        If stepping raises (KeyboardInterrupt included), this call's requests are dropped and their
        KV blocks freed before the exception propagates; the LLM stays usable (under tensor parallelism an
        interrupt inside a forward leaves the ranks out of step, and the next call asks for a new LLM)."""
        with self._lock:
            batch = as_batch(prompts)
            with _progress(use_tqdm, len(batch)) as done:
                return self.engine.generate(batch, sampling_params, lora_request, progress=done)

    def embed(
        self,
        prompts: Prompt | Sequence[Prompt],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[EmbeddingRequestOutput]:
        """Each prompt's embedding: its hidden states pooled (the model's default pooler unless `pooling_params`
        names one), L2-normalized unless it says otherwise; `out.outputs.embedding` is a list of floats. The
        engine runs them beside any generation, in the same steps. A bad prompt gets an output with `error`."""
        batch = as_batch(prompts)
        if isinstance(pooling_params, (list, tuple)):
            if len(pooling_params) != len(batch):
                raise RequestError(
                    f"got {len(batch)} prompts but {len(pooling_params)} PoolingParams: pass one, or one per prompt"
                )
            pooling = list(pooling_params)
        else:
            pooling = [pooling_params if pooling_params is not None else PoolingParams()] * len(batch)
        params = [SamplingParams(max_tokens=1, temperature=0, pooling=p) for p in pooling]
        with self._lock:
            with _progress(use_tqdm, len(batch)) as done:
                return [EmbeddingRequestOutput.of(o) for o in self.engine.generate(batch, params, progress=done)]

    # vLLM LLMEngine-style calls: add requests, step until done, abort from any thread

    def add_request(
        self,
        prompt: Prompt,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> str:
        """Queue one prompt (RequestError if it is bad); returns its request id."""
        with self._lock:
            return self.engine.add_request(prompt, sampling_params, request_id, lora_request)

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Serve an adapter ahead of its first request (its folder read now); vLLM's `add_lora`."""
        with self._lock:
            self.engine.add_adapter(lora_request)
        return True

    def remove_lora(self, name: str) -> bool:
        """Stop serving adapter `name`; its running requests finish. False: it was not served."""
        with self._lock:
            return self.engine.remove_adapter(name)

    def list_loras(self) -> list[LoRARequest]:
        return self.engine.list_adapters()

    def step(self) -> list[RequestOutput]:
        """Run one engine step; returns the requests that finished in it."""
        with self._lock:
            return self.engine.step()

    def has_unfinished(self) -> bool:
        return self.engine.has_unfinished()

    def abort(self, request_id: str) -> None:
        """End an unfinished request; a RequestError names an unknown or finished id. Ids are those
        `add_request` returned; `generate` gives its prompts the engine's automatic ids in order (the
        outputs' `request_id`). From another thread during `generate` or `step` it takes effect at the
        next step (the output's finish reason is "abort")."""
        self.engine.request_abort(request_id)
        if self._lock.acquire(blocking=False):  # idle: apply it now rather than at some later step
            try:
                self.engine.abort_pending()
            finally:
                self._lock.release()

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        use_tqdm: bool = False,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """messages: one conversation (a list of {"role", "content"} dicts) or a list of them, rendered
        by `chat_template` (a jinja file's path or text; default: the model's or --chat-template's).
        chat_template_kwargs reach the template (enable_thinking, ...); tools are OpenAI-style dicts.
        A conversation the template cannot render gets an output with `error` set; the others run."""
        from infer.inputs.chat_template import check_template_kwargs, load_chat_template, render_chat, template_for

        conversations = [messages] if messages and isinstance(messages[0], Mapping) else list(messages)
        template = template_for(self.engine.tokenizer, load_chat_template(chat_template))
        kwargs = check_template_kwargs(
            self.engine.tokenizer, chat_template_kwargs
        )  # the call's, not one conversation's
        if isinstance(sampling_params, (list, tuple)) and len(sampling_params) != len(conversations):
            raise RequestError(
                f"got {len(conversations)} conversations but {len(sampling_params)} SamplingParams: pass one, or one per conversation"
            )
        prompts: dict[int, list[int]] = {}  # conversation index -> prompt ids, for those that render
        errors: dict[int, str] = {}
        for i, conversation in enumerate(conversations):
            try:
                prompts[i] = render_chat(
                    self.engine.tokenizer,
                    conversation,
                    template,
                    add_generation_prompt,
                    kwargs,
                    tools,
                )
            except RequestError as exc:
                errors[i] = str(exc)
        params = (
            [sampling_params[i] for i in prompts] if isinstance(sampling_params, (list, tuple)) else sampling_params
        )
        loras = (
            [lora_request[i] for i in prompts] if isinstance(lora_request, (list, tuple)) else lora_request
        )  # fmt: skip
        outputs = iter(self.generate(list(prompts.values()), params, loras, use_tqdm) if prompts else [])
        results = []
        for i in range(len(conversations)):
            if i in errors:
                results.append(self.engine.refused(None, RequestError(errors[i])))
                continue
            out = next(outputs)
            if out.prompt is None and out.error is None:  # the rendered conversation, as text
                out.prompt = self.engine.tokenizer.decode(prompts[i])
            results.append(out)
        return results

    def close(self) -> None:
        with self._lock:
            self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextlib.contextmanager
def _progress(use_tqdm: bool, total: int) -> Iterator[Callable[[], None] | None]:
    """A callback that advances a tqdm bar of `total` prompts (None without `use_tqdm`)."""
    if not use_tqdm:
        yield None
        return
    from tqdm.auto import tqdm

    with tqdm(total=total, desc="prompts", unit="prompt") as bar:
        yield lambda: bar.update(1)
