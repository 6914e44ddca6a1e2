"""The KV block allocator, its usage report and the block copies a step asks for."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from infer.api.request import Request


class KVAllocator(Protocol):
    """Owns the physical KV blocks and every request's block table (`request.block_ids`).

    Called by the scheduler only. `allocate_slots` grows a request's block table so that it can
    hold `num_tokens` tokens in total, or returns None and changes nothing when there is no room
    (the scheduler then preempts). On an empty table it may first adopt cached prefix blocks and
    move `request.num_computed_tokens` past them (`num_cached_tokens` says how many, beforehand);
    a block about to be written that is shared is replaced by a copy (copy-on-write). `free`
    returns a request's blocks. Blocks are reference counted: `fork` shares a parent's blocks
    with a child (parallel samples), `reassign` swaps whole tables between requests (beams).
    `swap_out` moves a preempted request's blocks to CPU memory (False when that is full); its
    next `allocate_slots` brings them back. Every copy these imply is recorded, and the scheduler
    hands them to the engine once per step with `take_block_ops`.
    """

    block_size: int
    num_blocks: int

    def num_free_blocks(self) -> int: ...

    def allocate_slots(self, request: "Request", num_tokens: int) -> list[int] | None: ...

    def num_cached_tokens(self, request: "Request") -> int: ...

    def fork(self, parent: "Request", child: "Request", num_tokens: int) -> None: ...

    def reassign(self, pairs: list[tuple["Request", "Request"]]) -> None:
        """For each (dst, src): dst's table becomes a share of src's table as it was before the call."""
        ...

    def free(self, request: "Request") -> None: ...

    def swap_out(self, request: "Request") -> bool: ...

    def is_swapped(self, request: "Request") -> bool: ...

    def take_block_ops(self) -> "BlockOps": ...

    def can_ever_fit(self, num_tokens: int) -> bool: ...

    def can_ever_run(self, request: "Request", num_tokens: int) -> bool:
        """Whether `request` could be granted `num_tokens` slots on an empty cache."""
        ...

    def usage(self) -> "KVUsage": ...


@dataclass(slots=True)
class KVUsage:
    num_blocks: int  # physical blocks in the cache
    num_used_blocks: int  # blocks owned by at least one request
    num_reserved_slots: int  # token slots in used blocks
    num_filled_slots: int  # token slots holding a real token (a shared block counts once)
    num_saved_blocks: int = 0  # block-table entries minus used blocks: what sharing saves now
    num_cached_blocks: int = 0  # blocks the prefix cache maps (owned or evictable)
    prefix_query_tokens: int = 0  # since the start: tokens of admitted requests looked up in the prefix cache
    prefix_hit_tokens: int = 0  # of those, tokens found cached (not computed again)
    num_swapped_blocks: int = 0  # CPU blocks holding swapped-out requests

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else 0.0


@dataclass(slots=True)
class BlockOps:
    """KV block copies to make before a step's forward, in this order, each kind one batched copy.

    Block ids of `swap_out` and `swap_in` pairs name (device block, CPU block) and (CPU block,
    device block); `copies` are (src, dst) device blocks, copy-on-write. A step never both swaps
    out and swaps in. Every model cache indexed by the block tables (a draft's too) gets them.
    """

    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.swap_out or self.swap_in or self.copies)
