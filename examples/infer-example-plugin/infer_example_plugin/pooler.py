"""`example-max`: an embedding that is each hidden dimension's largest value over the prompt's tokens
(sentence-transformers' `pooling_mode_max_tokens`). Written only against `infer.api.pooling`:
`LLM.embed(prompts, PoolingParams("example-max"))`, or `/v1/embeddings` on a model whose default it is not.
"""

from __future__ import annotations

from typing import Sequence

import torch

import infer

INFER_PLUGIN_API = ">=2.2,<3"  # 2.2 added the pooler slot


class MaxPooler:
    def pool(self, hidden: torch.Tensor, token_ids: Sequence[int]) -> torch.Tensor:
        return hidden.max(dim=0).values


@infer.hookimpl
def infer_register_poolers(register) -> None:
    register("example-max", MaxPooler)
