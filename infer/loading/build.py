"""A model built with its weights in place, and a draft model checked against its target."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch import nn

from infer.api.config import ModelConfig
from infer.api.errors import ConfigError
from infer.loading.loader import ModelSource, check_weight_shapes, init_dummy_weights, load_weights, meta_model


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def load_model(
    source: ModelSource,
    config: ModelConfig,
    layers: Any,
    attention: Any,
    device: torch.device,
    dtype: torch.dtype,
    seed: int,
    sharded: bool = False,
    **kwargs: Any,
) -> nn.Module:
    """`source`'s architecture on `device` in `dtype`, in eval mode: the checkpoint's weights (this
    rank's slices when `sharded`), or random ones seeded by `seed` for dummy weights. `kwargs` go to
    the architecture (`parallel=` under tensor parallelism)."""
    with torch.device(device), default_dtype(dtype):
        model = source.architecture.factory(config, layers, attention, **kwargs)
    model.eval().requires_grad_(False)
    if source.path is None:
        init_dummy_weights(model, seed)
    else:
        load_weights(model, source.path, sharded=sharded)
    return model


def check_draft(
    draft: ModelSource, target_name: str, target: ModelConfig, max_model_len: int, layers: Any
) -> ModelConfig:
    """The draft's config, checked against the target's (the vocabulary, the context) and against its
    own checkpoint's headers; no weight is read."""
    config = draft.model_config()
    if config.vocab_size != target.vocab_size:
        raise ConfigError(
            f"draft {draft.name} has a vocabulary of {config.vocab_size} tokens but {target_name} has "
            f"{target.vocab_size}: pick a draft with the target's tokenizer"
        )
    if config.max_position_embeddings < max_model_len:
        raise ConfigError(
            f"draft {draft.name} holds {config.max_position_embeddings} positions, fewer than the "
            f"context of {max_model_len}: lower --max-model-len to at most that"
        )
    if draft.path is not None:
        check_weight_shapes(meta_model(draft, config, layers), draft.path)
    return config
