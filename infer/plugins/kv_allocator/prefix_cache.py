"""Prefix caching: full KV blocks found again by the tokens they hold.

A block's key is its token ids together with its parent block's key, so a key stands for the whole
token sequence from position 0 to the block's end. Keys compare by that content, never by hash
alone: two different token sequences can never map to the same cached block. The hash is computed
once per key from the parent's hash and the block's tokens, and a lookup chains each new key onto
the *stored* key of the previous hit, so comparing a key costs O(block_size), not O(prefix).
"""

from __future__ import annotations

from typing import Sequence


class BlockKey:
    __slots__ = ("parent", "token_ids", "hash")

    def __init__(self, parent: "BlockKey | None", token_ids: tuple[int, ...], hash_: int | None = None) -> None:
        self.parent = parent
        self.token_ids = token_ids
        # hash_: only tests pass one, to force collisions
        self.hash = hash((0 if parent is None else parent.hash, token_ids)) if hash_ is None else hash_

    def __hash__(self) -> int:
        return self.hash

    def __eq__(self, other: object) -> bool:
        a: BlockKey | None = self
        b = other
        while a is not b:  # walk both chains; shared ancestors end the walk early
            if not isinstance(a, BlockKey) or not isinstance(b, BlockKey):
                return False
            if a.token_ids != b.token_ids:
                return False
            a, b = a.parent, b.parent
        return True

    def prefix(self) -> list[int]:
        """All tokens from position 0 to this block's end."""
        chunks: list[tuple[int, ...]] = []
        key: BlockKey | None = self
        while key is not None:
            chunks.append(key.token_ids)
            key = key.parent
        return [t for chunk in reversed(chunks) for t in chunk]

    def __repr__(self) -> str:
        return f"BlockKey(len={len(self.prefix())}, tail={self.token_ids})"


def root_key(prefix_key: tuple | None) -> BlockKey | None:
    """The parent of a request's first block: None, or one made of its `Request.prefix_key`, so that
    requests of different keys (adapters) never find each other's blocks."""
    return None if prefix_key is None else BlockKey(None, prefix_key)


class PrefixCache:
    """Which physical blocks hold which full-block prefixes. Owned by the BlockPool, which calls
    `forget` when it evicts a block; registered blocks are immutable (never written again)."""

    def __init__(self) -> None:
        self.blocks: dict[BlockKey, int] = {}  # key -> block
        self.keys: dict[int, BlockKey] = {}  # block -> key
        self.num_query_tokens = 0  # tokens of admitted requests looked up
        self.num_hit_tokens = 0  # of those, tokens found cached

    def __len__(self) -> int:
        return len(self.keys)

    def is_cached(self, block: int) -> bool:
        return block in self.keys

    def lookup(
        self, token_ids: Sequence[int], block_size: int, max_blocks: int, root: BlockKey | None = None
    ) -> tuple[list[int], list[BlockKey]]:
        """The longest cached chain of full blocks over `token_ids`, at most `max_blocks` long; `root`:
        the chain's start for requests of a `prefix_key` (`root_key`), None for the others."""
        blocks: list[int] = []
        keys: list[BlockKey] = []
        parent: BlockKey | None = root
        for i in range(max_blocks):
            block = self.blocks.get(BlockKey(parent, tuple(token_ids[i * block_size : (i + 1) * block_size])))
            if block is None:
                break
            parent = self.keys[block]
            blocks.append(block)
            keys.append(parent)
        return blocks, keys

    def register(self, block: int, key: BlockKey) -> BlockKey:
        """Cache `block` under `key` unless that content is cached already; returns the stored key."""
        existing = self.blocks.get(key)
        if existing is not None:
            return self.keys[existing]
        assert block not in self.keys, f"block {block} is cached under another prefix"
        self.blocks[key] = block
        self.keys[block] = key
        return key

    def forget(self, block: int) -> None:
        del self.blocks[self.keys.pop(block)]

    def record(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        self.num_query_tokens += num_query_tokens
        self.num_hit_tokens += num_hit_tokens

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_query_tokens if self.num_query_tokens else 0.0
