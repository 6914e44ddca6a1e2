"""Logits processor checks, on synthetic logits and a tiny byte-level BPE tokenizer.

A processor tells the kit how to build a request it admits with a class attribute (or an
attribute of its factory) `kit_params`: the `SamplingParams` fields of such a request, e.g.
`kit_params = {"logit_bias": {70: 5.0}}`. Token ids below 257 are in the kit's vocabulary (0 is
EOS, 1 + b is the byte b); words are spelt with `kit_tokenizer()`, in which the words of
`MERGED_WORDS` are one token each (alone and after a space) and every other word is several.

Each check builds the processor with `kit_context`, admits the request, and walks it: each step
draws logits (noise, with the next token of `SCRIPT`, or EOS at EOS_STEPS, far ahead: the walk
spells real text where the processor lets it), constrains them, and samples the next token from
what is left, for NUM_STEPS tokens (past EOS too: an ignore_eos request's output goes on).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from infer.api import KitParams, LogitsRow, ProcessorContext
from infer.api.request import Request, SamplingParams

EOS = 0
MERGED_WORDS = ("the", "hello", "name", "true", "false", "null")
SCRIPT = '{"name":"hello the world","ok":true,"list":[1,2,3]}'  # text a walk favours
EOS_STEPS = (2, 14)  # steps at which a walk favours EOS instead (not inside the script's " world")
VOCAB_SIZE = 320  # the logits' width: past the tokenizer's, as a model's padded vocabulary is
NUM_STEPS = 16
MAX_DRAFT = 3


def kit_tokenizer() -> Any:
    """A GPT-2 style byte-level BPE tokenizer: EOS, the 256 bytes, then the merges of MERGED_WORDS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    chars = bytes_to_unicode()  # byte -> the printable character that stands for it
    vocab = {"<|endoftext|>": EOS, **{chars[b]: 1 + b for b in range(256)}}
    merges: list[tuple[str, str]] = []
    for word in MERGED_WORDS:
        for spelt in (" " + word, word):  # the spaced form first: its merges rank ahead
            symbols = [chars[b] for b in spelt.encode()]
            piece = symbols[0]
            for symbol in symbols[1:]:
                if (piece, symbol) not in merges:
                    merges.append((piece, symbol))
                piece += symbol
                vocab.setdefault(piece, len(vocab))
    backend = Tokenizer(models.BPE(vocab, merges))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>")


def kit_context(device: torch.device | str = "cpu", tokenizer: Any = None) -> ProcessorContext:
    return ProcessorContext(tokenizer or kit_tokenizer(), VOCAB_SIZE, frozenset({EOS}), torch.device(device))


def kit_params(name: str, factory: Any) -> SamplingParams:
    fields = factory.kit_params if isinstance(factory, KitParams) else None
    assert isinstance(fields, dict) and fields, (
        f"logits processor {name}: declare `kit_params` on it, the SamplingParams fields of a request it admits "
        f"(e.g. kit_params = {{'logit_bias': {{70: 5.0}}}}), so the kit can build one"
    )
    return SamplingParams(**{"max_tokens": 64, "temperature": 1.0, **fields})


@dataclass(slots=True)
class Walk:
    """One admitted request stepped through NUM_STEPS constrained tokens."""

    name: str
    processor: Any
    params: SamplingParams
    raw: list[torch.Tensor] = field(default_factory=list)  # step -> the logits drawn [V]
    rows: list[torch.Tensor] = field(default_factory=list)  # step -> the row after apply [V]
    tokens: list[int] = field(default_factory=list)  # step -> the token sampled

    def request(self, i: int = 0, output: Sequence[int] = ()) -> Request:
        """A new request of the walk's params, admitted, with `output` as its output tokens."""
        r = Request(f"kit-{i}", [EOS], self.params, arrival=i, eos_token_ids=frozenset({EOS}))
        r.output_token_ids = list(output)
        state = self.processor.admit(r)
        assert state is not None, (
            f"logits processor {self.name}: admit returned None for its own kit_params request ({self.params})"
        )
        r.constraints = ((self.processor, state),)
        return r


def apply(processor: Any, logits: torch.Tensor, rows: Sequence[LogitsRow]) -> torch.Tensor:
    """processor.apply as the engine calls it (in place, on inference tensors); returns the logits."""
    with torch.inference_mode():
        logits = logits.clone()
        processor.apply(logits, rows)
    return logits


def row_of(r: Request, index: int = 0, draft: Sequence[int] = ()) -> LogitsRow:
    return LogitsRow(index, r, r.constraints[0][1], tuple(draft))


def draw(step: int, device: torch.device, script: Sequence[int]) -> torch.Tensor:
    """Step `step`'s logits [V]: noise, with EOS favoured at EOS_STEPS and else the script's token."""
    gen = torch.Generator().manual_seed(1000 + step)
    logits = torch.randn(VOCAB_SIZE, generator=gen)
    if step in EOS_STEPS:
        logits[EOS] += 20.0
    elif step < len(script):
        logits[script[step]] += 14.0
    return logits.to(device)


def walk(name: str, factory: Any, device: torch.device, tokenizer: Any = None) -> Walk:
    """Admit the kit request and step it: draw, apply, sample (a request that saw every step)."""
    ctx = kit_context(device, tokenizer)
    w = Walk(name, factory(ctx), kit_params(name, factory))
    script = ctx.tokenizer.encode(SCRIPT, add_special_tokens=False)
    r = w.request()
    for step in range(NUM_STEPS):
        raw = draw(step, device, script)
        row = apply(w.processor, raw[None], [row_of(r)])[0]
        check_finite(name, row, f"step {step} (output so far {r.output_token_ids})")
        u = torch.rand(1, generator=torch.Generator().manual_seed(step), dtype=torch.float64)
        cdf = row.double().softmax(-1).cumsum(-1).cpu()  # inverse-CDF draw
        token = min(int(torch.searchsorted(cdf, u * cdf[-1])), VOCAB_SIZE - 1)
        w.raw.append(raw)
        w.rows.append(row)
        w.tokens.append(token)
        r.output_token_ids.append(token)
    return w


def check_finite(name: str, row: torch.Tensor, where: str) -> None:
    assert bool(torch.isfinite(row).any()), (
        f"logits processor {name}: every logit of the row is -inf at {where}: a row must keep at least one "
        f"finite logit (the sampler has nothing to draw)"
    )


def check_plain_not_admitted(name: str, factory: Any, device: torch.device) -> None:
    processor = factory(kit_context(device))
    r = Request("plain", [EOS], SamplingParams(), arrival=0, eos_token_ids=frozenset({EOS}))
    state = processor.admit(r)
    assert state is None, (
        f"logits processor {name}: admit returned {state!r} for a plain SamplingParams(): a processor must "
        f"admit only the requests that ask for it (every other request runs no processor code)"
    )
    kit_request = walk(name, factory, device).request()  # and its own request is admitted
    assert kit_request.constraints


def check_only_given_rows(name: str, factory: Any, device: torch.device) -> None:
    """Rows 1 and 4 of six are two admitted requests at different steps: the other rows are left
    exactly as they were, and each given row is what it is when its request is alone."""
    w = walk(name, factory, device)
    late = min(len(w.tokens) - 1, 4)
    requests = {1: w.request(1), 4: w.request(4, w.tokens[:late])}
    gen = torch.Generator().manual_seed(7)
    logits = (torch.randn(6, VOCAB_SIZE, generator=gen) * 2.0).to(device)
    logits[1], logits[4] = w.raw[0], w.raw[late]
    out = apply(w.processor, logits, [row_of(r, i) for i, r in requests.items()])
    for i in (0, 2, 3, 5):
        assert torch.equal(out[i], logits[i]), (
            f"logits processor {name}: apply changed row {i}, which it was not given (it was given rows 1 and 4 "
            f"of 6): write only to each LogitsRow's `index`"
        )
    for i, step in ((1, 0), (4, late)):
        assert torch.equal(out[i], w.rows[step]), (
            f"logits processor {name}: row {i} of a batch differs from the same request's row alone (output "
            f"{w.tokens[:step]}): a row must depend on its own request only"
        )


def check_drafts(name: str, factory: Any, device: torch.device) -> None:
    """The speculative contract: rows of one request after drafts of 0..k of the walk's own tokens
    equal the rows of requests whose output already holds them; the draft leaves no trace."""
    w = walk(name, factory, device)
    for start in range(0, len(w.tokens) - 1, 2):
        k = min(MAX_DRAFT, len(w.tokens) - 1 - start)
        r = w.request(start, w.tokens[:start])
        apply(w.processor, w.raw[start][None], [row_of(r)])  # the step before: its state has caught up
        logits = torch.stack(w.raw[start : start + k + 1])
        rows = [row_of(r, j, w.tokens[start : start + j]) for j in range(k + 1)]
        out = apply(w.processor, logits, rows)
        for j in range(k + 1):
            draft = w.tokens[start : start + j]
            assert torch.equal(out[j], w.rows[start + j]), (
                f"logits processor {name}: the row after draft {draft} (output {w.tokens[:start]}) differs from "
                f"the row of a request whose output already holds those tokens: a LogitsRow's draft comes after "
                f"the request's output tokens"
            )
        again = apply(w.processor, w.raw[start][None], [row_of(r)])[0]
        assert torch.equal(again, w.rows[start]), (
            f"logits processor {name}: after rows with drafts, the request's next row (output {w.tokens[:start]}, "
            f"no draft) changed: drafts may be rejected, so they must leave the state as it was"
        )


def check_catch_up(name: str, factory: Any, device: torch.device) -> None:
    """A request that sees several new output tokens at once (a speculative step, or a state
    admitted after the output began: a preempted request's) gives the rows of the one that saw
    every step."""
    w = walk(name, factory, device)
    for stride in (2, 3):
        r = w.request(stride)
        for step in range(0, len(w.tokens), stride):
            r.output_token_ids = w.tokens[:step]
            row = apply(w.processor, w.raw[step][None], [row_of(r)])[0]
            assert torch.equal(row, w.rows[step]), (
                f"logits processor {name}: applied every {stride} steps, the row at output {w.tokens[:step]} "
                f"differs from the row of a request applied at every step: apply must catch up with all the "
                f"output tokens it has not seen"
            )
    for step in range(1, len(w.tokens)):
        row = apply(w.processor, w.raw[step][None], [row_of(w.request(step, w.tokens[:step]))])[0]
        assert torch.equal(row, w.rows[step]), (
            f"logits processor {name}: a request admitted with output {w.tokens[:step]} already out gives a "
            f"different first row from one that saw every step: apply must catch up with the output tokens"
        )
