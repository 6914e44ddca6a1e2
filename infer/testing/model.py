"""Model conformance: a model plugin beside HF transformers' own implementation of each architecture it
claims (`hf_architectures`), on the same tiny random weights.

`write_checkpoint` builds transformers' config class for the architecture at small sizes (`SIZES`,
where the class has the field, then the plugin's `KitConfig.kit_config`), the HF model itself (fp32,
eager attention, a fixed seed) and saves it with save_pretrained. The weights are redrawn larger than
HF's init, so that greedy choices are not near-ties, and every norm weight and bias is moved off its
constant, so that one tensor loaded in another's place shows. Each `Setting` loads the folder through
infer with the plugin under test (`model_impl=NAME`) on the CPU in fp32 and generates greedily from
token-id prompts. Every output is checked against HF's forward over the same tokens (teacher-forced):
the greedy token at each step must be HF's argmax, and each logprob infer reports must be within
`LOGPROB_TOLERANCE` of HF's. A failure names the first layer whose output differs (`model_layers`).
"""

from __future__ import annotations

import contextlib
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch

from infer.api import KitConfig
from infer.api.request import RequestOutput, SamplingParams
from infer.loading.config import kv_layout

SIZES: dict[str, Any] = dict(  # set where the architecture's config class has the field
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,  # grouped-query attention, and still 1 KV head per rank at tp 2
    head_dim=16,
    max_position_embeddings=256,
)
SPECIAL_TOKENS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)  # where set: inside the small vocabulary
SLIDING_WINDOW = 16  # where the config has a window: shorter than most sequences, so that it is exercised
# fp32 on the CPU: infer and HF differ only in summation order (fused projections, blocked softmax over
# the paged cache, the all-reduce's partial sums), about 1e-6 in logprobs on these sizes; a real fault (a
# swapped norm, a wrong RoPE, a missed bias) moves them by 1e-2 or more
LOGPROB_TOLERANCE = 1e-4
MAX_TOKENS = 24
PARAMS = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=5)


def hf_class(architecture: str) -> Any:
    import transformers

    cls = getattr(transformers, architecture, None)  # the class a plugin names: this transformers may lack it
    if cls is None or not hasattr(cls, "config_class"):  # a transformers name that is no model class
        raise AssertionError(
            f"transformers {transformers.__version__} has no model class {architecture}: the model kit runs HF "
            f"transformers' implementation beside the plugin, so it needs one (upgrade transformers, or drop "
            f"{architecture} from hf_architectures)"
        )
    return cls


def tiny_config(architecture: str, overrides: dict[str, Any] | None = None) -> Any:
    """transformers' config for `architecture` at the kit's sizes, then `overrides` (a plugin's kit_config)."""
    from transformers.utils import logging

    config_class = hf_class(architecture).config_class
    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()  # the defaults' warnings (Arcee's bos_token_id 128000 past 32000 tokens)
    try:
        defaults = config_class()
    finally:
        logging.set_verbosity(verbosity)
    # an HF config: which of these fields a family has (and which it leaves None) varies by architecture
    fields = {k: v for k, v in SIZES.items() if hasattr(defaults, k)}
    # an HF config: the special tokens a family defines
    fields.update({k: v for k, v in SPECIAL_TOKENS.items() if getattr(defaults, k, None) is not None})
    if isinstance(getattr(defaults, "sliding_window", None), int):  # an HF config: windowed families only
        fields["sliding_window"] = SLIDING_WINDOW
    unknown = sorted(k for k in overrides or {} if not hasattr(defaults, k))  # kit_config names HF config fields
    if unknown:
        raise AssertionError(
            f"kit_config for {architecture} sets {', '.join(unknown)}, which {config_class.__name__} does not "
            f"have: use its field names"
        )
    return config_class(**{**fields, **(overrides or {})})


def kit_overrides(factory: Any, architecture: str) -> dict[str, Any]:
    return dict(factory.kit_config.get(architecture, {})) if isinstance(factory, KitConfig) else {}


@dataclass(slots=True)
class Checkpoint:
    """A tiny random HF model of one architecture, saved, and kept in memory as the reference."""

    architecture: str
    folder: Path
    hf_model: Any  # transformers' model, fp32, eval

    def describe(self) -> str:
        c = self.hf_model.config
        heads = f"{c.num_attention_heads} heads over {kv_layout(c)[0]}"
        # an HF config: windowed families only
        window = f", window {c.sliding_window}" if isinstance(getattr(c, "sliding_window", None), int) else ""
        # an HF config: newer transformers versions only
        rope = (getattr(c, "rope_parameters", None) or {}).get("rope_type")
        rope = f", {rope} RoPE" if rope not in (None, "default") else ""
        return f"{c.num_hidden_layers} layers, hidden {c.hidden_size}, {heads} KV heads, vocab {c.vocab_size}{window}{rope}"

    @torch.no_grad()
    def logits(self, ids: Sequence[int]) -> torch.Tensor:
        """HF's logits at every position of `ids`: [len(ids), vocab] float32."""
        return self.hf_model(torch.tensor([list(ids)])).logits[0].float()


def write_checkpoint(
    architecture: str, folder: Path, overrides: dict[str, Any] | None = None, seed: int = 0
) -> Checkpoint:
    config = tiny_config(architecture, overrides)
    torch.manual_seed(seed)
    model = hf_class(architecture)._from_config(config, attn_implementation="eager", dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.08)
            else:  # norm weights (1 or 0) and biases (0): each its own values
                p.add_(torch.randn_like(p), alpha=0.1)
    model.eval().save_pretrained(folder)
    return Checkpoint(architecture, folder, model)


def _prompts(lens: Sequence[int], seed: int, prefix: Sequence[int] = ()) -> list[list[int]]:
    rng = random.Random(seed)
    vocab = SIZES["vocab_size"]
    return [[*prefix, *(rng.randrange(3, vocab) for _ in range(n))] for n in lens]


SHARED_PREFIX = _prompts([20], seed=1)[0]  # 5 blocks of 4 tokens
PROMPTS: dict[str, list[list[int]]] = {  # batch name -> token-id prompts
    "plain": _prompts((5, 13, 24, 37), seed=0),
    "shared prefix": _prompts((3, 9, 14), seed=2, prefix=SHARED_PREFIX),
    "shared prefix again": _prompts((6, 11), seed=3, prefix=SHARED_PREFIX),  # hits the blocks the first batch left
}


@dataclass(frozen=True, slots=True)
class Setting:
    """One engine, the batches it generates in order, and what must have happened for it to count."""

    name: str  # test id
    what: str  # for messages
    options: dict[str, Any] = field(default_factory=dict)  # EngineConfig fields
    batches: tuple[str, ...] = ("plain",)
    tp: int = 1
    pp: int = 1
    expects: tuple[str, ...] = ()  # "prefix hits", "preemptions"


SETTINGS = (
    Setting("tp1", "tp 1"),
    Setting(
        "prefix-caching",
        "tp 1, prefix caching: a second batch shares the first's 20-token prefix (blocks of 4)",
        dict(block_size=4),
        ("shared prefix", "shared prefix again"),
        expects=("prefix hits",),
    ),
    Setting("chunked-prefill", "tp 1, chunked prefill (max_num_batched_tokens=8)", dict(max_num_batched_tokens=8)),
    Setting(
        "preemption",
        "tp 1, a KV cache of 20 blocks of 4 tokens (requests preempted)",
        dict(num_kv_blocks=20, block_size=4, max_model_len=64),
        expects=("preemptions",),
    ),
    Setting(  # one start of the ranks for all three
        "tp2",
        "tp 2 (gloo), chunked prefill (max_num_batched_tokens=16) and prefix caching (blocks of 4)",
        dict(block_size=4, max_num_batched_tokens=16),
        ("plain", "shared prefix", "shared prefix again"),
        tp=2,
        expects=("prefix hits",),
    ),
    Setting(  # prompts cut between micro-batches, and between stages' layers
        "pp2",
        "pp 2 (gloo), 2 micro-batches a step, chunked prefill (max_num_batched_tokens=16) and prefix caching "
        "(blocks of 4)",
        dict(block_size=4, max_num_batched_tokens=16),
        ("plain", "shared prefix"),  # a second batch: its prefix is the first's
        pp=2,
        expects=("prefix hits",),
    ),
)


def generate(
    folder: Path, name: str, setting: Setting, plugins: Sequence[Any] = ()
) -> tuple[list[tuple[list[int], RequestOutput]], list[str]]:
    """Every batch of `setting` through infer with model plugin `name`: (prompt, output) pairs in
    order, and the premises that did not hold (a prefix cache never hit, no request preempted)."""
    from infer.llm import LLM

    results: list[tuple[list[int], RequestOutput]] = []
    options = dict(
        device="cpu", dtype="float32", tensor_parallel_size=setting.tp, pipeline_parallel_size=setting.pp,
        **setting.options,
    )  # fmt: skip
    with LLM(model=str(folder), model_impl=name, plugins=plugins, **options) as llm:
        for batch in setting.batches:
            results.extend(zip(PROMPTS[batch], llm.generate(PROMPTS[batch], PARAMS)))
        missed = []
        if "prefix hits" in setting.expects and llm.engine.kv_usage().prefix_hit_tokens == 0:
            missed.append("the prefix cache was never hit")
        if "preemptions" in setting.expects and llm.engine.stats()["preemptions"] == 0:
            missed.append("no request was preempted")
    return results, missed


@dataclass(frozen=True, slots=True)
class Mismatch:
    message: str
    ids: list[int]  # the tokens up to and including the position that differs (the prompt's, at least)


def first_mismatch(checkpoint: Checkpoint, results: list[tuple[list[int], RequestOutput]]) -> Mismatch | None:
    """The first output whose greedy tokens or logprobs are not HF's, teacher-forced on its own tokens."""
    for i, (prompt, out) in enumerate(results):
        where = f"prompt {i} (of {len(results)}, {len(prompt)} tokens)"
        if out.error:
            return Mismatch(f"{where} was rejected: {out.error}", prompt)
        tokens, logprobs = out.outputs[0].token_ids, out.outputs[0].logprobs or []
        if len(tokens) != MAX_TOKENS or len(logprobs) != MAX_TOKENS:
            return Mismatch(
                f"{where}: {len(tokens)} tokens and {len(logprobs)} logprobs, not max_tokens={MAX_TOKENS}", prompt
            )
        logits = checkpoint.logits(prompt + tokens[:-1])[len(prompt) - 1 :]  # [MAX_TOKENS, vocab]
        expected = logits.log_softmax(-1)
        for t, (token, reported) in enumerate(zip(tokens, logprobs)):
            ids = prompt + tokens[:t]
            want = int(logits[t].argmax())
            if token != want:
                gap = float(logits[t, want] - logits[t, token])
                tie = ", a near-tie" if gap < 1e-3 else ""
                before = f"; the {t} before it agree" if t else ""
                return Mismatch(
                    f"{where}: output token {t} is {token} where HF transformers' greedy token is {want} "
                    f"(HF's logit for {token} is {gap:.3g} below its top{tie}{before})",
                    ids,
                )
            for tok, value in reported.items():
                diff = abs(value - float(expected[t, tok]))
                if diff > LOGPROB_TOLERANCE:
                    return Mismatch(
                        f"{where}: output token {t}: logprob of token {tok} is {value:.6f}, HF's "
                        f"{float(expected[t, tok]):.6f} (differs by {diff:.2e}, more than {LOGPROB_TOLERANCE:g})",
                        ids,
                    )
    return None


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Torch on one CPU thread: these tensors are too small to share out, and on a busy machine a second
    thread's waits cost more than the work (on a busy two-core machine the tp 1 settings took 0.6 s of
    CPU on one thread, 14 s on two)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def check_model(checkpoint: Checkpoint, name: str, setting: Setting, plugins: Sequence[Any] = ()) -> None:
    """`plugins`: inline plugins that provide model plugin `name` when it is not installed."""
    with one_thread():
        _check_model(checkpoint, name, setting, plugins)


def _check_model(checkpoint: Checkpoint, name: str, setting: Setting, plugins: Sequence[Any]) -> None:
    from infer.testing.model_layers import locate  # which imports this module

    results, missed = generate(checkpoint.folder, name, setting, plugins)
    where = f"model {name} ({checkpoint.architecture}: {checkpoint.describe()}; {setting.what})"
    if missed:
        raise AssertionError(f"{where}: {' and '.join(missed)}, so this setting tested nothing of what it names")
    mismatch = first_mismatch(checkpoint, results)
    if mismatch is None:
        return
    found = locate(checkpoint, name, mismatch.ids, plugins) or (  # a whole prefill at tp 1 is right
        f"the embeddings, every layer and the next token's logprobs agree with HF's there: the difference "
        f"comes with {setting.what}, or with decode steps"
    )
    raise AssertionError(
        f"{where} differs from HF transformers: {mismatch.message}. On a tp 1 prefill of those "
        f"{len(mismatch.ids)} tokens: {found}"
    )


EMBEDDING_TOLERANCE = 1e-5  # fp32 on the CPU: each value of a normalized embedding, against HF's hidden states pooled
POOLERS = ("last", "mean", "cls")


@torch.no_grad()
def hf_embedding(checkpoint: Checkpoint, ids: Sequence[int], pooler: str) -> torch.Tensor:
    """HF transformers' last hidden state (after the final norm) over `ids`, pooled by `pooler` and normalized."""
    hidden = checkpoint.hf_model.base_model(torch.tensor([list(ids)])).last_hidden_state[0].float()  # [P, hidden]
    pooled = {"last": hidden[-1], "mean": hidden.mean(0), "cls": hidden[0]}[pooler]
    return torch.nn.functional.normalize(pooled, dim=-1)


def check_embeddings(checkpoint: Checkpoint, name: str, plugins: Sequence[Any] = ()) -> None:
    """Embeddings through model plugin `name`, every built-in pooler, equal to HF's hidden states pooled the
    same way within `EMBEDDING_TOLERANCE`: in one batch with generating requests, prefills chunked by 8
    tokens (so a prompt's hidden states come from several steps), and again once the prefix cache holds
    every prompt (an embedding computes its whole prompt all the same)."""
    from infer.api.pooling import PoolingParams
    from infer.llm import LLM

    prompts = PROMPTS["plain"]
    where = f"model {name} ({checkpoint.architecture}: {checkpoint.describe()})"
    options = dict(device="cpu", dtype="float32", max_num_batched_tokens=8, block_size=4)
    with one_thread(), LLM(model=str(checkpoint.folder), model_impl=name, plugins=plugins, **options) as llm:
        for round_ in ("beside generation, chunked", "after the prefix cache holds the prompts"):
            params = [SamplingParams(max_tokens=1, temperature=0, pooling=PoolingParams(p)) for p in POOLERS]
            batch = [(prompt, p) for prompt in prompts for p in params]
            generating = [(prompt, SamplingParams(max_tokens=6, temperature=0)) for prompt in prompts]
            outputs = llm.generate([b[0] for b in generating + batch], [b[1] for b in generating + batch])
            for (prompt, p), out in zip(batch, outputs[len(generating) :]):
                label = f"{where}, pooler {p.pooling.pooler}, prompt of {len(prompt)} tokens, {round_}"
                if out.error or out.embedding is None:
                    raise AssertionError(f"{label}: no embedding ({out.error})")
                want = hf_embedding(checkpoint, prompt, p.pooling.pooler)
                diff = float((torch.tensor(out.embedding) - want).abs().max())
                if diff > EMBEDDING_TOLERANCE:
                    raise AssertionError(
                        f"{label}: differs from HF transformers' hidden states pooled the same way by {diff:.2e}, "
                        f"more than {EMBEDDING_TOLERANCE:g}"
                    )
            if not all(o.outputs[0].token_ids for o in outputs[: len(generating)]):
                raise AssertionError(f"{where}: a generating request beside the embeddings produced no token")
