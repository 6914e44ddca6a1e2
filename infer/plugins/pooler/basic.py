"""`last`, `mean` and `cls`: the pooling modes of sentence-transformers' Pooling module.

`last`: the last prompt token's hidden state (a causal model's only row that has read the whole prompt:
Qwen3-Embedding, E5-Mistral). `mean`: the mean over every prompt token. `cls`: the first token's (BERT's
[CLS]; for a causal model it has seen only itself, so it serves encoder-style checkpoints).
"""

from __future__ import annotations

from typing import Sequence

import torch

from infer.api.hookspecs import hookimpl


class LastPooler:
    def pool(self, hidden: torch.Tensor, token_ids: Sequence[int]) -> torch.Tensor:
        return hidden[-1]


class MeanPooler:
    def pool(self, hidden: torch.Tensor, token_ids: Sequence[int]) -> torch.Tensor:
        return hidden.mean(dim=0)


class ClsPooler:
    def pool(self, hidden: torch.Tensor, token_ids: Sequence[int]) -> torch.Tensor:
        return hidden[0]


@hookimpl
def infer_register_poolers(register) -> None:
    register("last", LastPooler)
    register("mean", MeanPooler)
    register("cls", ClsPooler)
