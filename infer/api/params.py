"""Sampling parameters: what a caller asks of each request, checked before it is queued."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any, Callable, Literal

from infer.api.errors import RequestError
from infer.api.pooling import PoolingParams
from infer.api.structured import StructuredOutputs

# the fields the logits processors serve (beam search takes none of them)
CONSTRAINTS = ("structured", "logit_bias", "bad_words", "min_tokens", "allowed_token_ids")


@dataclass(slots=True)
class SamplingParams:
    """Per-request sampling settings; field names follow vLLM's."""

    n: int = 1  # independent samples per prompt
    max_tokens: int = 16  # new tokens to generate at most
    temperature: float = 1.0  # 0 means greedy
    top_k: int = 0  # 0 (or -1) disables
    top_p: float = 1.0  # nucleus mass kept, in (0, 1]
    min_p: float = 0.0  # drop tokens below min_p * max prob, in [0, 1]
    repetition_penalty: float = 1.0  # > 0; 1 disables (HF/CTRL style, prompt + output tokens)
    presence_penalty: float = 0.0  # [-2, 2], OpenAI style, output tokens
    frequency_penalty: float = 0.0  # [-2, 2], OpenAI style, output tokens
    seed: int | None = None  # per-request seed: same seed, same tokens, in any batch
    stop: list[str] | str | None = None  # stop strings (excluded from the text)
    stop_token_ids: list[int] | None = None  # extra stop tokens (kept in token_ids)
    ignore_eos: bool = False  # keep generating past EOS (benchmarks)
    logprobs: int | None = None  # top-k logprobs per output token, plus the sampled token's
    # per prompt token after the first: its logprob given the tokens before it, plus the top-k others'
    # (None: not computed). A request that asks for them computes its whole prompt: no cached prefix.
    prompt_logprobs: int | None = None
    # beam search (vLLM's API): `best_of` beams, the best `n` returned, scored as HF transformers
    # does: sum of logprobs / generated_len ** length_penalty. Deterministic: temperature, top-k/p
    # and seed are ignored; penalties and stop strings are not supported with it.
    use_beam_search: bool = False
    best_of: int | None = None  # beam width (with use_beam_search); None: n
    length_penalty: float = 1.0
    early_stopping: bool | Literal["never"] = False  # as HF: True, False (heuristic) or "never"
    # logits processors (`infer.api.LogitsProcessor`): what the output must match (a
    # StructuredOutputs, or a dict of its fields: {"json": schema}, {"regex": r"..."}, {"choice": [...]})
    structured: StructuredOutputs | dict[str, Any] | None = None
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, in [-100, 100] (OpenAI's)
    bad_words: list[str] | None = None  # words never generated (as spelt alone and after a space)
    min_tokens: int = 0  # EOS and stop tokens are banned until this many tokens are out
    allowed_token_ids: list[int] | None = None  # only these tokens are generated
    # lower runs first (vLLM's sense): schedulers that honour it (fcfs) admit and preempt by priority,
    # then arrival, a level worth --priority-aging-s of waiting so that nothing starves
    priority: int = 0
    # an embedding request (plugin API 2.2, `infer.api.pooling`): its prompt's hidden states pooled into
    # `RequestOutput.embedding`; it ends once its prompt is computed (max_tokens 1, its one token unused)
    pooling: PoolingParams | None = None
    # vLLM's output options (plugin API 2.3)
    include_stop_str_in_output: bool = False  # the stop string that ended the text stays in it
    skip_special_tokens: bool = True  # the text leaves special tokens out (their ids stay in token_ids)
    detokenize: bool = True  # False: token ids alone, the text "" (no stop strings then)
    # keep the prompt's last k tokens (-1: as many as the context holds beside one output token); None: all
    truncate_prompt_tokens: int | None = None
    structured_outputs: StructuredOutputs | dict[str, Any] | None = None  # vLLM's name for `structured`
    # vLLM's, refused unless left as they are (`infer.api.vllm.SAMPLING` says why)
    spaces_between_special_tokens: bool = True
    logits_processors: Any = None
    output_kind: Any = None

    def __post_init__(self) -> None:
        # vLLM's forms: one string or a sequence of them, None for none; anything else is left for validate
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is None or isinstance(self.stop, tuple):
            self.stop = list(self.stop or [])
        if self.stop_token_ids is None or isinstance(self.stop_token_ids, tuple):
            self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        if self.structured_outputs is not None:  # vLLM's name: the same field
            if self.structured is not None:
                raise _bad("structured_outputs", self.structured_outputs, "give it or structured, not both")
            self.structured, self.structured_outputs = self.structured_outputs, None
        self.validate()

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        """Types and ranges of every field; raises RequestError naming the field and the fix."""
        _integer("n", self.n, 1, fix="use an integer >= 1")
        _integer("max_tokens", self.max_tokens, 1, fix="use an integer >= 1 (--max-tokens)")
        _real("temperature", self.temperature, lambda v: v >= 0, "use a number >= 0 (0 is greedy)")
        _integer("top_k", self.top_k, 0, 2**31 - 1, fix="use 0 (or -1) to disable, or a positive integer below 2**31")
        _real("top_p", self.top_p, lambda v: 0 < v <= 1, "use a number in (0, 1]; 1 disables it (--top-p)")
        _real("min_p", self.min_p, lambda v: 0 <= v <= 1, "use a number in [0, 1]; 0 disables it")
        _real("repetition_penalty", self.repetition_penalty, lambda v: v > 0, "use a number > 0; 1 disables it")
        for name, value in (("presence_penalty", self.presence_penalty), ("frequency_penalty", self.frequency_penalty)):
            _real(name, value, lambda v: -2 <= v <= 2, "use a number in [-2, 2]; 0 disables it")
        _integer(
            "priority", self.priority, -(2**31), 2**31 - 1, fix="use an integer (lower runs first; 0 is the default)"
        )
        if self.seed is not None:
            _integer("seed", self.seed, -(2**63), 2**63 - 1, fix="use None or an integer in [-2**63, 2**63)")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise _bad("stop", self.stop, "use a non-empty string or a list of them (token ids go in stop_token_ids)")
        if not isinstance(self.stop_token_ids, list):
            raise _bad("stop_token_ids", self.stop_token_ids, "use a list of token ids (integers >= 0)")
        for token in self.stop_token_ids:
            _integer("stop_token_ids", token, 0, fix="use a list of token ids (integers >= 0)")
        _boolean("ignore_eos", self.ignore_eos)
        for name in ("include_stop_str_in_output", "skip_special_tokens", "detokenize"):
            _boolean(name, getattr(self, name))
        if not self.skip_special_tokens:
            raise _bad(
                "skip_special_tokens",
                False,
                "infer's detokenizers leave special tokens out of the text (their ids are in token_ids): drop it",
            )
        for name, left in (
            ("spaces_between_special_tokens", self.spaces_between_special_tokens is True),
            ("logits_processors", self.logits_processors is None),
            ("output_kind", self.output_kind is None),
        ):
            if not left:
                from infer.api.vllm import SAMPLING, Refused

                why = next(r.why for r in SAMPLING if isinstance(r, Refused) and r.vllm == name)
                raise _bad(name, getattr(self, name), f"vLLM's {name} has no equivalent here: {why}")
        if not self.detokenize and self.stop:
            raise _bad("detokenize", False, "stop strings are found in the text: use stop_token_ids, or detokenize")
        if self.truncate_prompt_tokens is not None and self.truncate_prompt_tokens != -1:
            _integer("truncate_prompt_tokens", self.truncate_prompt_tokens, 1, fix="use an integer >= 1, -1, or None")
        if self.logprobs is not None:
            _integer("logprobs", self.logprobs, 0, fix="use None or an integer >= 0")
        if self.prompt_logprobs is not None:
            _integer("prompt_logprobs", self.prompt_logprobs, 0, fix="use None or an integer >= 0")
        self._validate_processors()
        _boolean("use_beam_search", self.use_beam_search)
        if self.pooling is not None:
            self._validate_pooling()
        if self.best_of is not None:
            _integer("best_of", self.best_of, self.n, fix=f"use an integer >= n ({self.n}), or None")
        if not self.use_beam_search:
            if self.best_of not in (None, self.n):
                raise _bad(
                    "best_of",
                    self.best_of,
                    "best_of > n is used by beam search only: set use_beam_search=True (--beam-width)",
                )
            return
        if not (isinstance(self.early_stopping, bool) or self.early_stopping == "never"):
            raise _bad("early_stopping", self.early_stopping, "use True, False or 'never'")
        _real("length_penalty", self.length_penalty, lambda v: True, "use a finite number")
        penalised = self.repetition_penalty != 1.0 or self.presence_penalty or self.frequency_penalty
        if penalised or self.stop:
            raise _bad("use_beam_search", True, "beam search takes no penalties or stop strings: drop them")
        constrained = [name for name, value in self._constraints() if value]
        if constrained:
            raise _bad(
                "use_beam_search", True, f"beam search takes no constraints ({', '.join(constrained)}): drop them"
            )

    def _validate_pooling(self) -> None:
        if not isinstance(self.pooling, PoolingParams):
            raise _bad("pooling", self.pooling, "use an infer.api.pooling.PoolingParams, or None")
        self.pooling.validate()
        if self.n != 1 or self.use_beam_search or self.max_tokens != 1:
            raise _bad("pooling", self.pooling, "an embedding request takes n=1, max_tokens=1 and no beam search")

    def _constraints(self) -> tuple[tuple[str, Any], ...]:
        """(name, value) of each field that asks a logits processor for something (`CONSTRAINTS`)."""
        return (
            ("structured", self.structured),
            ("logit_bias", self.logit_bias),
            ("bad_words", self.bad_words),
            ("min_tokens", self.min_tokens),
            ("allowed_token_ids", self.allowed_token_ids),
        )

    def _validate_processors(self) -> None:
        # the forms a caller may also set after construction: a dict of StructuredOutputs' fields,
        # logit_bias keys as strings (JSON object keys)
        self.structured = StructuredOutputs.coerce(self.structured)
        if isinstance(self.logit_bias, dict):
            self.logit_bias = {_token_key(k): v for k, v in self.logit_bias.items()}
        if self.structured is not None:  # coerce refused any other form
            self.structured.validate()
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise _bad("logit_bias", self.logit_bias, "use a dict of token id -> bias in [-100, 100]")
            for token, bias in self.logit_bias.items():
                _integer("logit_bias key", token, 0, fix="use token ids (integers >= 0) as its keys")
                _real(f"logit_bias[{token}]", bias, lambda v: -100 <= v <= 100, "use biases in [-100, 100]")
        if self.bad_words is not None and (
            not isinstance(self.bad_words, list) or not all(isinstance(w, str) and w.strip() for w in self.bad_words)
        ):
            raise _bad("bad_words", self.bad_words, "use a list of non-empty strings")
        _integer("min_tokens", self.min_tokens, 0, fix="use an integer >= 0")
        if self.min_tokens > self.max_tokens:
            raise _bad("min_tokens", self.min_tokens, f"use at most max_tokens ({self.max_tokens})")
        if self.allowed_token_ids is not None:
            if not isinstance(self.allowed_token_ids, list) or not self.allowed_token_ids:
                raise _bad("allowed_token_ids", self.allowed_token_ids, "use a non-empty list of token ids")
            for token in self.allowed_token_ids:
                _integer("allowed_token_ids", token, 0, fix="use token ids (integers >= 0)")

    # all the rest of the engine knows of beam search (the scheduler's): these two
    @property
    def num_sequences(self) -> int:
        """Requests the engine runs for one prompt: n samples, or best_of beams (the first n are returned)."""
        return (self.best_of or self.n) if self.use_beam_search else self.n

    @property
    def tokens_are_final(self) -> bool:
        """False for beams, whose tokens the scheduler rewrites: decoded once, at the end; never drafted
        for or run ahead; their logprobs are the scheduler's."""
        return not self.use_beam_search


def _token_key(key: object) -> object:
    if isinstance(key, str) and key.strip().lstrip("-").isdigit():
        return int(key)
    return key


def _bad(field_name: str, value: object, fix: str) -> RequestError:
    return RequestError(f"invalid {field_name}={value!r}: {fix}")


def _integer(name: str, value: object, lo: int, hi: int | None = None, *, fix: str) -> None:
    # bool is an int subclass, but True as a count or a seed is a mistake
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Integral)
        or value < lo
        or (hi is not None and value > hi)
    ):
        raise _bad(name, value, fix)


def _real(name: str, value: object, in_range: Callable[[float], bool], fix: str) -> None:
    # NaN fails every comparison, so it is caught by isfinite before the range test
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or not math.isfinite(value)
        or not in_range(value)
    ):
        raise _bad(name, value, fix)


def _boolean(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise _bad(name, value, "use True or False")
