"""Workloads: the built-in prompt set, the named benchmark shapes, and prompt files.

All synthetic workloads are seeded and ignore EOS, so every run computes the same tokens.
"""

from __future__ import annotations

import difflib
import json
import math
import random
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from infer.api.errors import DatasetError
from infer.api.request import SamplingParams

BUILTIN_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue.",
    "Give me three tips for learning to cook.",
    "What is a prime number? Give two examples.",
    "Translate 'good morning' into Spanish and German.",
    "Name three planets of the solar system.",
    "Summarise the story of Little Red Riding Hood in one sentence.",
]


@dataclass(slots=True)
class Workload:
    name: str
    prompts: list[str | list[int]]  # text, or token ids
    max_tokens: list[int]
    chat: bool = False  # apply the model's chat template to text prompts
    ignore_eos: bool = False
    notes: dict[str, Any] = field(default_factory=dict)

    def params(self, base: SamplingParams) -> list[SamplingParams]:
        return [replace(base, max_tokens=m, ignore_eos=self.ignore_eos or base.ignore_eos) for m in self.max_tokens]


PASSAGE = (
    "The committee met on Tuesday to review the budget for the new library. After a long discussion, "
    "they agreed to fund the children's section first, then the reading room, and finally the archive. "
    "The work will start in March and should be finished before the end of the year."
)
CODE = (
    "def mean(values):\n    total = 0\n    for v in values:\n        total += v\n    return total / len(values)\n\n"
    "def variance(values):\n    m = mean(values)\n    return sum((v - m) ** 2 for v in values) / len(values)\n"
)
EDIT_PROMPTS = [
    f"Repeat the following text exactly, word for word:\n\n{PASSAGE}",
    f"Rewrite this text, replacing 'Tuesday' with 'Friday' and changing nothing else:\n\n{PASSAGE}",
    f"Copy this Python code exactly as it is:\n\n{CODE}",
    f"Rename the function `mean` to `average` everywhere in this code and print the whole code:\n\n{CODE}",
    f"Add a docstring to each function in this code and print the whole code:\n\n{CODE}",
    "Fix the spelling and print the corrected text: The comittee met on Tusday to reveiw the budjet for the new "
    "libary. They agred to fund the childrens section first.",
    f"Translate this text into plain bullet points, keeping every fact:\n\n{PASSAGE}",
    f"Print this code twice, one copy after the other:\n\n{CODE}",
]


def _random_ids(rng: random.Random, n: int, vocab_size: int) -> list[int]:
    return [rng.randrange(10, vocab_size) for _ in range(n)]  # low ids are often special tokens


def random_fixed(vocab_size: int, num_prompts: int, prompt_len: int, output_len: int, seed: int, name: str) -> Workload:
    rng = random.Random(seed)
    prompts: list[str | list[int]] = [_random_ids(rng, prompt_len, vocab_size) for _ in range(num_prompts)]
    return Workload(name, prompts, [output_len] * num_prompts, ignore_eos=True)


def edit(num_prompts: int, max_tokens: int) -> Workload:
    """Chat prompts that ask to repeat or edit a given text: most of the answer is in the prompt
    (what prompt lookup, `--draft ngram`, is for)."""
    prompts: list[str | list[int]] = [EDIT_PROMPTS[i % len(EDIT_PROMPTS)] for i in range(num_prompts)]
    return Workload("edit", prompts, [max_tokens] * num_prompts, chat=True)


def sharegpt_like(vocab_size: int, num_prompts: int, seed: int) -> Workload:
    """Lengths drawn from log-normals matching ShareGPT's means (prompt ~161, output ~338 tokens),
    dropping prompt > 1024 or prompt + output > 2048, as vLLM's benchmark filters real ShareGPT."""
    rng = random.Random(seed)
    sigma_p, sigma_o = 1.0, 0.9
    mu_p, mu_o = math.log(161) - sigma_p**2 / 2, math.log(338) - sigma_o**2 / 2
    prompts: list[str | list[int]] = []
    outputs: list[int] = []
    while len(prompts) < num_prompts:
        p = max(4, int(rng.lognormvariate(mu_p, sigma_p)))
        o = max(4, int(rng.lognormvariate(mu_o, sigma_o)))
        if p > 1024 or p + o > 2048:
            continue
        prompts.append(_random_ids(rng, p, vocab_size))
        outputs.append(o)
    return Workload("sharegpt-like", prompts, outputs, ignore_eos=True)


def chitchat(num_prompts: int, max_tokens: int, seed: int) -> Workload:
    try:
        import chitchat_dataset  # type: ignore[import-not-found]  # optional, installed by hand: no type information
    except ImportError as exc:
        raise DatasetError(
            "the `chat` workload needs the chitchat-dataset package: pip install chitchat-dataset==0.9.0"
        ) from exc
    data = chitchat_dataset.Dataset()
    rng = random.Random(seed)
    texts = [msgs[0][0]["text"] for msgs in (conv["messages"] for conv in data.values()) if msgs and msgs[0]]
    rng.shuffle(texts)
    texts = [t for t in texts if t.strip()][:num_prompts]
    return Workload("chat", list(texts), [max_tokens] * len(texts), chat=True)


def from_file(path: Path, default_max_tokens: int) -> Workload:
    """JSON (a list) or JSONL: each item a string, a token-id list, or {"prompt": ..., "max_tokens": n}."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise DatasetError(f"cannot read dataset file {path} ({exc.strerror}): check the --dataset path") from exc
    where: list[str]  # each item's place in the file, for messages: "line 7" (JSONL) or "item 3" (JSON)
    if path.suffix == ".jsonl":
        items, where = [], []
        for lineno, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                items.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise DatasetError(
                    f"dataset file {path} is not valid JSONL (line {lineno}, column {exc.colno}: {exc.msg}): fix the file"
                ) from exc
            where.append(f"line {lineno}")
    else:
        try:
            items = json.loads(text)
        except json.JSONDecodeError as exc:
            raise DatasetError(
                f"dataset file {path} is not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg}): fix the file"
            ) from exc
        where = [f"item {i}" for i in range(len(items))] if isinstance(items, list) else []
    if not isinstance(items, list) or not items:
        raise DatasetError(f"dataset file {path} must hold a non-empty list of prompts")
    prompts: list[str | list[int]] = []
    max_tokens: list[int] = []
    for i, item in enumerate(items):
        if isinstance(item, dict):
            prompt, n = item.get("prompt"), item.get("max_tokens", default_max_tokens)
        else:
            prompt, n = item, default_max_tokens
        ok = isinstance(prompt, str) or (
            isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
        )
        if not ok:
            raise DatasetError(
                f"dataset file {path}, {where[i]}: expected a string, a list of token ids, or "
                f'{{"prompt": ..., "max_tokens": n}}; got {type(prompt if isinstance(item, dict) else item).__name__}'
            )
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise DatasetError(f"dataset file {path}, {where[i]}: max_tokens must be an integer >= 1, got {n!r}")
        prompts.append(prompt)
        max_tokens.append(n)
    return Workload(path.name, prompts, max_tokens, chat=False)


NAMED = ("builtin", "edit", "random-256x256", "sharegpt-like", "latency-1", "chat")
NEEDS_VOCAB = ("random-256x256", "sharegpt-like", "latency-1")  # token ids drawn from the model's vocabulary
RANDOM_SHAPE = re.compile(r"random-([1-9][0-9]*)x([1-9][0-9]*)")  # random-IxO: I prompt and O output tokens each


def needs_vocab(name: str) -> bool:
    """Whether the workload draws token ids from the model's vocabulary (so it loads once the model's known)."""
    return name in NEEDS_VOCAB or RANDOM_SHAPE.fullmatch(name) is not None


def load_workload(name: str, vocab_size: int, num_prompts: int | None, max_tokens: int | None, seed: int) -> Workload:
    """vocab_size is read only by the workloads that need_vocab: the others load before any model does."""
    if num_prompts is not None and (not isinstance(num_prompts, int) or num_prompts < 1):
        raise DatasetError(f"--num-prompts must be an integer >= 1, got {num_prompts!r}")
    if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
        raise DatasetError(f"--max-tokens must be an integer >= 1, got {max_tokens!r}")
    if name == "builtin":
        n = num_prompts or len(BUILTIN_PROMPTS)
        prompts: list[str | list[int]] = [BUILTIN_PROMPTS[i % len(BUILTIN_PROMPTS)] for i in range(n)]
        return Workload("builtin", prompts, [64 if max_tokens is None else max_tokens] * n, chat=True)
    if name == "edit":
        return edit(num_prompts or len(EDIT_PROMPTS), 160 if max_tokens is None else max_tokens)
    if shape := RANDOM_SHAPE.fullmatch(name):
        w = random_fixed(vocab_size, num_prompts or 1000, int(shape[1]), int(shape[2]), seed, name)
    elif name == "latency-1":
        w = random_fixed(vocab_size, num_prompts or 1, 128, 256, seed, name)
    elif name == "sharegpt-like":
        w = sharegpt_like(vocab_size, num_prompts or 1000, seed)
    elif name == "chat":
        w = chitchat(num_prompts or 64, 128 if max_tokens is None else max_tokens, seed)
    else:
        path = Path(name)
        if not path.exists() and path.suffix not in (".json", ".jsonl"):
            close = difflib.get_close_matches(name, NAMED, n=1)
            guess = f"did you mean {close[0]!r}? " if close else ""
            raise DatasetError(
                f"unknown dataset {name!r}: {guess}use a JSON/JSONL file, random-IxO, or one of {', '.join(NAMED)}"
            )
        w = from_file(path, 64 if max_tokens is None else max_tokens)
        if num_prompts:
            w.prompts, w.max_tokens = w.prompts[:num_prompts], w.max_tokens[:num_prompts]
    if max_tokens is not None:
        w.max_tokens = [max_tokens] * len(w.prompts)
    return w
