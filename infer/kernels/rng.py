"""Counter-based randomness: a draw is a pure function of (seed, position, token).

No generator state is carried between steps or shared between rows, so a request's tokens do not
depend on which other requests share its batch, nor on its row index. The hash is lowbias32
(Chris Wellons' hash-prospector) computed on int64 tensors holding 32-bit values: every product
stays below 2**63 and is masked back to 32 bits, so nothing overflows.
"""

from __future__ import annotations

import torch

MASK32 = 0xFFFFFFFF
_M1 = 0x7FEB352D
_M2 = 0x846CA68B
_M2_NEG = _M2 - 2**32  # x * _M2 == x * _M2_NEG (mod 2**32), and |x * _M2_NEG| < 2**63
_SALT_SEED = 0x9E3779B9
_SALT_MULT = 0x85EBCA6B


def lowbias32(x: torch.Tensor, scratch: torch.Tensor | None = None) -> torch.Tensor:
    # x: int64 in [0, 2**32), hashed in place; scratch: a buffer like x for the shifts
    s = torch.empty_like(x) if scratch is None else scratch
    x.bitwise_xor_(torch.bitwise_right_shift(x, 16, out=s))
    x.mul_(_M1).bitwise_and_(MASK32)
    x.bitwise_xor_(torch.bitwise_right_shift(x, 15, out=s))
    x.mul_(_M2_NEG).bitwise_and_(MASK32)
    return x.bitwise_xor_(torch.bitwise_right_shift(x, 16, out=s))


def lowbias32_int(x: int) -> int:
    x ^= x >> 16
    x = (x * _M1) & MASK32
    x ^= x >> 15
    x = (x * _M2) & MASK32
    return x ^ (x >> 16)


def split_seed(seed: int) -> tuple[int, int]:
    return seed & MASK32, (seed >> 32) & MASK32


def row_key_int(seed: int, position: int) -> tuple[int, int]:
    lo, hi = split_seed(seed)
    key = lowbias32_int(lo ^ lowbias32_int(hi ^ _SALT_SEED))
    key = lowbias32_int(key ^ (position & MASK32))
    return key, lowbias32_int(key ^ _SALT_MULT) | 1


def row_keys(seeds: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # seeds: [B, 2] int64 (low, high 32 bits); positions: [B] int64 -> key, odd multiplier: [B] each
    key = lowbias32(seeds[:, 1] ^ _SALT_SEED)
    key = lowbias32(key.bitwise_xor_(seeds[:, 0]))
    key = lowbias32(key.bitwise_xor_(positions & MASK32))
    mult = lowbias32(key ^ _SALT_MULT).bitwise_or_(1)
    return key, mult


def token_hash(
    key: torch.Tensor, mult: torch.Tensor, tokens: torch.Tensor, scratch: torch.Tensor | None = None
) -> torch.Tensor:
    # key, mult: [B]; tokens: [V] -> [B, V] in [0, 2**32)
    # the per-row odd multiplier scatters a row's counters, so two rows never share a shifted copy
    x = (tokens[None, :] * mult[:, None]).bitwise_and_(MASK32).bitwise_xor_(key[:, None])
    return lowbias32(x, scratch)


def token_hash_int(seed: int, position: int, token: int) -> int:
    key, mult = row_key_int(seed, position)
    return lowbias32_int(((token * mult) & MASK32) ^ key)


def hash_to_exponential(h: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    # h: int64 in [0, 2**32) -> float64 E = -log(u), u = (h + 0.5) / 2**32 in (0, 1), so E > 0;
    # float32 would round u to 1 near the top. out: a float64 buffer shaped like h, or None
    e = torch.empty_like(h, dtype=torch.float64) if out is None else out
    return e.copy_(h).add_(0.5).mul_(2.0**-32).log_().neg_()


def exponential(key: torch.Tensor, mult: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    # key, mult: [B]; tokens: [V] -> [B, V] float64, E ~ Exp(1); two [B, V] buffers in all
    scratch = torch.empty(key.shape[0], tokens.shape[0], dtype=torch.int64, device=key.device)
    h = token_hash(key, mult, tokens, scratch)
    return hash_to_exponential(h, out=scratch.view(torch.float64))


def generator_seed(seed: int, position: int) -> int:
    key, mult = row_key_int(seed, position)
    return (key << 32) | mult


def row_positions(logits, requests, positions: list[int] | None) -> list[int]:
    """Row i samples output token `positions[i]` (default: the next one); checks the batch shape."""
    if positions is None:
        positions = [len(r.output_token_ids) for r in requests]
    assert logits.dim() == 2 and logits.shape[0] == len(requests) == len(positions)
    return positions
