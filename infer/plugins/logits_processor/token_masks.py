"""Shared by the token-level processors: one indexed write for all of a step's rows."""

from __future__ import annotations

import torch

from infer.api.errors import RequestError
from infer.api.transfer import to_device


def ban(logits: torch.Tensor, rows: list[int], tokens: list[int]) -> None:
    """logits[rows[i], tokens[i]] = -inf for every i, in one write."""
    if rows:
        index = to_device(rows + tokens, torch.int64, logits.device).view(2, -1)
        logits.index_put_((index[0], index[1]), torch.tensor(float("-inf"), device=logits.device))


def check_ids(name: str, tokens: list[int], vocab_size: int) -> None:
    bad = [t for t in tokens if t >= vocab_size]
    if bad:
        raise RequestError(
            f"invalid {name}: token id {bad[0]} is past the vocabulary ({vocab_size} tokens): use ids below {vocab_size}"
        )
