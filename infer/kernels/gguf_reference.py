"""GGUF's block formats taken apart in torch: each row of blocks as small integers q, and per group a scale s
and an offset o, with w = q * s + o computed in float32 exactly as the `gguf` package's own dequantization
computes it (d * q, d * q + m, (d * sc) * q - dmin * m, ...), so the values equal llama.cpp's reference.

| type | bits | group | q | s | o |
|---|---|---|---|---|---|
| Q4_0 | 4 | 32 | nibble - 8 | d | 0 |
| Q4_1 | 4 | 32 | nibble | d | m |
| Q8_0 | 8 | 32 | int8 | d | 0 |
| Q4_K | 4 | 32 | nibble | d * sc | -(dmin * m) |
| Q5_K | 5 | 32 | nibble + 16 * bit | d * sc | -(dmin * m) |
| Q6_K | 6 | 16 | 6 bits - 32 | d * sc | 0 |

`Parts.q` holds an int8 a value; `infer.plugins.layer.gguf` stores a 4-bit type's two to a byte.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

QK_K = 256
# bytes a block holds, and the values in it
BLOCKS = {
    "Q4_0": (18, 32),
    "Q4_1": (20, 32),
    "Q8_0": (34, 32),
    "Q4_K": (144, 256),
    "Q5_K": (176, 256),
    "Q6_K": (210, 256),
}
TYPES = tuple(BLOCKS)


@dataclass(frozen=True, slots=True)
class Parts:
    """One tensor's rows taken apart: w = (q - 0) * scale + offset per group of `group` columns."""

    q: torch.Tensor  # int8 [N, K]: the values, signed as the type reads them
    scale: torch.Tensor  # float32 [N, K / group]
    offset: torch.Tensor | None  # float32 [N, K / group], or None for 0
    group: int
    bits: int

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K]: q * s + o, as the gguf package computes it."""
        s = self.scale.repeat_interleave(self.group, dim=1)
        w = self.q.float() * s
        return w if self.offset is None else w + self.offset.repeat_interleave(self.group, dim=1)


def _f16(raw: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 2] little-endian float16 -> float32 [...]."""
    return raw.contiguous().view(torch.float16).squeeze(-1).float()


def _nibbles(qs: torch.Tensor, chunk: int) -> torch.Tensor:
    """uint8 [..., B] -> [..., 2B]: each `chunk`-byte run's low nibbles, then its high nibbles (ggml's order)."""
    runs = qs.reshape(*qs.shape[:-1], -1, 1, chunk)
    both = torch.cat([runs & 0x0F, runs >> 4], dim=-2)
    return both.reshape(*qs.shape[:-1], -1)


def _scale_min_k4(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K's 12 bytes of 6-bit scales and mins -> ([..., 8], [..., 8]) (ggml's get_scale_min_k4)."""
    s = scales.reshape(*scales.shape[:-1], 3, 4).to(torch.int32)
    d, m, md = s[..., 0, :], s[..., 1, :], s[..., 2, :]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def take_apart(kind: str, rows: torch.Tensor, k: int) -> Parts:
    """uint8 [N, K / block values * block bytes]: a GGUF tensor's rows (each row its blocks in order) -> Parts."""
    if kind not in BLOCKS:
        raise ValueError(f"GGUF type {kind} is not one of {', '.join(TYPES)}")
    size, values = BLOCKS[kind]
    n = rows.shape[0]
    if k % values or rows.shape[1] != k // values * size:
        raise ValueError(f"a {kind} row of {k} values is {k // values * size} bytes, not {rows.shape[1]}")
    b = rows.reshape(n, k // values, size)
    if kind in ("Q4_0", "Q4_1"):
        d = _f16(b[..., 0:2])
        qs = b[..., 4:] if kind == "Q4_1" else b[..., 2:]
        q = _nibbles(qs, 16).to(torch.int16) - (8 if kind == "Q4_0" else 0)
        offset = _f16(b[..., 2:4]) if kind == "Q4_1" else None
        return Parts(q.reshape(n, k).to(torch.int8), d, offset, 32, 4)
    if kind == "Q8_0":
        return Parts(b[..., 2:].contiguous().view(torch.int8).reshape(n, k), _f16(b[..., 0:2]), None, 32, 8)
    if kind in ("Q4_K", "Q5_K"):
        d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
        sc, mn = _scale_min_k4(b[..., 4:16])
        scale = (d[..., None] * sc.float()).reshape(n, -1)
        offset = -(dmin[..., None] * mn.float()).reshape(n, -1)
        if kind == "Q4_K":
            q = _nibbles(b[..., 16:], 32).to(torch.int16)
        else:
            qh, qs = b[..., 16:48], b[..., 48:]
            low = _nibbles(qs, 32).to(torch.int16).reshape(n, -1, 8, 32)
            high = torch.stack([(qh.to(torch.int16) >> i) & 1 for i in range(8)], dim=-2)  # [n, blocks, 8, 32]
            q = (low | (high << 4)).reshape(n, -1)
        return Parts(q.reshape(n, k).to(torch.int8), scale, offset, 32, 4 if kind == "Q4_K" else 5)
    # Q6_K
    ql, qh, scales, d = b[..., :128], b[..., 128:192], b[..., 192:208], _f16(b[..., 208:210])
    low = ql.reshape(n, -1, 2, 64).to(torch.int16)  # two halves of 128 values
    low = torch.stack([low & 0x0F, low >> 4], dim=-2).reshape(n, -1, 2, 2, 64)  # [.., half, nibble, 64]
    high = qh.reshape(n, -1, 2, 32).to(torch.int16)
    high = torch.stack([(high >> s) & 3 for s in (0, 2, 4, 6)], dim=-2)  # [.., half, 4, 32]
    low = low.reshape(n, -1, 2, 4, 32)  # the 128 values of a half as 4 runs of 32: (l & 0xF, l >> 4) x 2
    q = (low | (high << 4)) - 32
    scale = (d[..., None] * scales.contiguous().view(torch.int8).float()).reshape(n, -1)
    return Parts(q.reshape(n, k).to(torch.int8), scale, None, 16, 6)
