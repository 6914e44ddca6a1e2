"""What a decoder hands the model runner: one sequence's slice of a forward (`ForwardSeq`), and a
forward's flat inputs (`StepInputs`, what rank 0 broadcasts to the others under tensor parallelism)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from infer.api.request import Request

__all__ = ["ForwardSeq", "StepInputs"]


@dataclass(slots=True)
class ForwardSeq:
    """One sequence's slice of a forward pass: tokens [start, start + len(token_ids)) of it."""

    request: Request
    token_ids: list[int]  # the tokens computed (query)
    start: int  # position of the first one
    logits_rows: int  # how many trailing positions need logits (0: none, 1: the last, k: the last k)
    prompt_rows: int = 0  # positions just before those that score prompt tokens (`prompt_logprobs`)


@dataclass(slots=True)
class StepInputs:
    """One forward's flat inputs. Under tensor parallelism rank 0 broadcasts these and every rank runs them."""

    input_ids: list[int]  # [T], sequences one after another (ignored where input_ids_t is given)
    query_lens: list[int]  # seq i -> tokens computed
    seq_lens: list[int]  # seq i -> tokens in the cache after this forward
    block_tables: list[list[int]]  # seq i -> block ids
    logits_rows: list[int]  # which of the T tokens get logits, in order
    num_layers: int | None  # run only the first layers (early exit, self-draft); None: all
    use_graphs: bool  # replayed from a CUDA graph (a decode step, or a small one with prompt tokens)
    input_ids_t: torch.Tensor | None = None  # [T] int64 on the device: the ids, not yet on the host
    # which of the T tokens' hidden states an embedding request keeps (`infer.api.pooling`), in order; `run`
    # leaves them in `hidden` [len(hidden_rows), hidden_size] (plugin API 2.2)
    hidden_rows: list[int] = field(default_factory=list)
    hidden: torch.Tensor | None = None
    # adapters (plugin API 2.3): seq i -> its adapter's device slot (-1: the base model; empty: a run
    # without adapters), and the (slot, key, name, path) loads every rank applies before the forward
    adapter_slots: list[int] = field(default_factory=list)
    adapter_loads: list[tuple[int, int, str, str]] = field(default_factory=list)
