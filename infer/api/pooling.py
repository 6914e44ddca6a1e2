"""Embeddings: a prompt's hidden states pooled into one vector (plugin API 2.2).

An embedding request is an ordinary request whose `SamplingParams.pooling` is set: the engine runs it
beside generating requests, in the same steps and the same KV cache, and ends it once its prompt is
computed. Chunk by chunk, the target model's runner keeps the hidden states (after the final norm) of
the prompt positions it computes (`hidden_rows`); when the last one is in, the pooler named by
`PoolingParams.pooler` (else the model's default: a sentence-transformers folder's
`1_Pooling/config.json`, else "last") turns them into one vector, which is cut to `dimensions` and
L2-normalized as asked (`embed`). A request that pools computes its whole prompt: no cached prefix,
whose hidden states are not kept.

A pooler factory is `factory()`, built once per engine; `pool(hidden, token_ids)` gets the prompt's
hidden states [P, hidden] in float32, one row per prompt token, and returns [hidden'] (any length).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, Sequence

import torch

from infer.api.errors import RequestError

if TYPE_CHECKING:
    from infer.api.request import Request

DEFAULT_POOLER = "last"  # a causal model's last prompt token has seen the whole prompt


@dataclass(slots=True)
class PoolingParams:
    """What an embedding request asks: `SamplingParams(pooling=PoolingParams(...))`, or `LLM.embed`."""

    pooler: str | None = None  # a registered pooler ("last", "mean", "cls", ...); None: the model's default
    normalize: bool = True  # L2-normalize the vector (OpenAI's embeddings are)
    dimensions: int | None = None  # keep the first `dimensions` values (Matryoshka models only); None: all

    def validate(self) -> None:
        if self.pooler is not None and (not isinstance(self.pooler, str) or not self.pooler):
            raise RequestError(f"invalid pooler={self.pooler!r}: use a pooler's name (`infer plugins` lists them)")
        if not isinstance(self.normalize, bool):
            raise RequestError(f"invalid normalize={self.normalize!r}: use true or false")
        if self.dimensions is not None and (
            isinstance(self.dimensions, bool) or not isinstance(self.dimensions, int) or self.dimensions < 1
        ):
            raise RequestError(f"invalid dimensions={self.dimensions!r}: use an integer >= 1, or leave it out")


class Pooler(Protocol):
    def pool(self, hidden: torch.Tensor, token_ids: Sequence[int]) -> torch.Tensor:
        """One prompt's hidden states [P, hidden] float32 (row i: after prompt token i) -> [hidden']."""
        ...


def hidden_rows(request: Request, start: int, num_tokens: int) -> int:
    """How many leading positions of the chunk [start, start + num_tokens) of `request` are prompt positions
    whose hidden state it has not kept yet (0 for a request that does not pool). A request preempted and
    computed again keeps the rows it had: its chunk's first positions are then left out."""
    if request.params.pooling is None:
        return 0
    first = max(start, request.num_pooled_rows)
    end = min(start + num_tokens, request.num_prompt_tokens)
    return max(0, end - first)


def keep_hidden(request: Request, rows: torch.Tensor) -> None:
    """Keep `rows` [n, hidden], the hidden states of `request`'s next n prompt positions."""
    request.pooled_hidden.append(rows)
    request.num_pooled_rows += rows.shape[0]


def embed(pooler: Pooler, request: Request, max_dimensions: int | None) -> list[float]:
    """The embedding of a request whose every prompt position is kept: pooled, cut to `dimensions`, normalized.
    `max_dimensions`: how far the model may be cut (a Matryoshka model's width; None: it may not be)."""
    params = request.params.pooling
    assert params is not None and request.num_pooled_rows == request.num_prompt_tokens, "every prompt row kept"
    hidden = torch.cat([rows.float() for rows in request.pooled_hidden])
    vector = pooler.pool(hidden, request.prompt_token_ids).float()
    if params.dimensions is not None:
        check_dimensions(params.dimensions, max_dimensions)
        vector = vector[: params.dimensions]
    if params.normalize:
        vector = torch.nn.functional.normalize(vector, dim=-1)
    request.pooled_hidden.clear()  # the vector is all that is kept
    return vector.cpu().tolist()


def check_dimensions(dimensions: int, max_dimensions: int | None) -> None:
    if max_dimensions is None:
        raise RequestError(
            f"invalid dimensions={dimensions}: this model was not trained to be cut short (its config declares "
            "no Matryoshka dimensions), so a cut embedding would be poor: leave dimensions out"
        )
    if dimensions > max_dimensions:
        raise RequestError(f"invalid dimensions={dimensions}: this model's embeddings have {max_dimensions}")


def matryoshka_dimensions(hf_config: dict) -> int | None:
    """How far a model's embeddings may be cut, from its config.json (`is_matryoshka`, or
    `matryoshka_dimensions`: the widths it was trained at): its hidden size, else None."""
    if hf_config.get("is_matryoshka") or hf_config.get("matryoshka_dimensions"):
        return int(hf_config["hidden_size"]) if "hidden_size" in hf_config else None
    return None


def default_pooler(folder: Path | None) -> tuple[str | None, str]:
    """The pooler a sentence-transformers folder declares (`modules.json` -> its Pooling module's
    config.json: mean, cls or lasttoken), else `DEFAULT_POOLER`; (None, why) for a folder whose modules ask
    for what no built-in pooler computes (another pooling mode, several at once, a Dense layer after it)."""
    if folder is None:
        return DEFAULT_POOLER, ""
    try:
        modules = json.loads((folder / "modules.json").read_text())
        types = [str(m.get("type", "")) for m in modules]
        path = next(m["path"] for m in modules if str(m.get("type", "")).endswith("Pooling"))
        config = json.loads((folder / path / "config.json").read_text())
    except (OSError, ValueError, StopIteration, KeyError, TypeError, AttributeError):
        return DEFAULT_POOLER, ""
    where = f"{folder.name}'s sentence-transformers modules"
    if any(t.endswith("Dense") for t in types):
        return None, f"{where} apply a Dense layer after the pooling, which infer does not"
    modes = (
        ("pooling_mode_lasttoken", "last"),
        ("pooling_mode_mean_tokens", "mean"),
        ("pooling_mode_cls_token", "cls"),
    )
    asked = sorted(k for k, v in config.items() if k.startswith("pooling_mode_") and v)
    known = [name for key, name in modes if key in asked]
    if len(asked) == 1 and known:
        return known[0], ""
    if not asked:
        return DEFAULT_POOLER, ""
    return None, f"{where} ask for {' + '.join(asked)}, which no built-in pooler computes"
