"""The 4-bit weight dequantized by Triton (issue 47: products past the GEMV's rows) against
`Int4Linear.dequantized`'s arithmetic, in Triton's interpreter on the CPU or on a GPU: group sizes 32, 64,
128 and one a row, symmetric and not, act-order, a shape no tile divides, float32 and bf16 (bit for bit:
the same float32 values rounded once; within a bf16 step in the interpreter, which truncates)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
from infer.kernels.int4_reference import unpack_nibbles  # noqa: E402
from infer.testing.int4_layers import random_int4_layer  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "n, k, group, symmetric, act_order",
    [(48, 256, 32, True, False), (40, 256, 64, False, False), (33, 384, 128, True, False),
     (48, 192, -1, False, False), (40, 256, 32, False, True), (48, 256, 128, True, True)],
)  # fmt: skip
def test_int4_dequantize_gives_the_layers_values(n, k, group, symmetric, act_order, dtype):
    from infer.kernels.int4_dequant import int4_dequantize

    device = "cuda" if torch.cuda.is_available() else "cpu"
    (qweight, s, z, g_idx), width = random_int4_layer(n, k, group, symmetric, act_order, device)
    w = int4_dequantize(qweight, s, z, g_idx, width, act_order, dtype)
    cols = g_idx.long()
    expected = ((unpack_nibbles(qweight).float() - z.float()[:, cols]) * s[:, cols]).to(dtype)
    assert w.shape == (n, k) and w.dtype == dtype
    if dtype == torch.bfloat16 and device == "cpu":  # Triton's interpreter truncates to bf16 (a GPU rounds to nearest)
        torch.testing.assert_close(w.float(), expected.float(), rtol=2**-7, atol=0)
    else:
        assert torch.equal(w, expected)
