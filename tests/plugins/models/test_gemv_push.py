"""One-token partial sums pushed by the GEMV into the ranks' exchange slots and summed there
(`infer.core.lamport`), with the ranks' peer memory played by CPU tensors in one process (Triton's
interpreter): each GEMV stores into every rank's slot through the addresses a real exchange maps."""

import pytest
import torch

pytest.importorskip("infer.plugins.models.triton_gemv")
from infer.core.lamport import RESET, PushTarget  # noqa: E402
from infer.plugins.models import layers as plain  # noqa: E402
from infer.plugins.models import triton_gemv, triton_layers  # noqa: E402

WORLD, N, K = 2, 48, 64  # K: whole interpreter tiles (masked columns would add +0.0)


def ranks_slots(dtype):
    """Each rank's two slots [2, world, N], reset, and the [slot, rank] address table every rank holds."""
    slots = [torch.full((2, WORLD, N), RESET, dtype=torch.int16).view(dtype) for _ in range(WORLD)]
    peers = torch.tensor([[s.data_ptr() + slot * WORLD * N * s.element_size() for s in slots] for slot in range(2)],
                         dtype=torch.int64)
    return slots, peers


def push(rank, slot, slots, peers, x, w, gated=False):
    target = PushTarget(peers[slot], rank * N, slots[rank][slot, rank].view(1, N))
    fn = triton_gemv.gemv_silu_mul if gated else triton_gemv.gemv
    return fn(x, w, push=target)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_pushed_partial_sums_are_summed_normed_and_the_slots_reset(dtype):
    torch.manual_seed(0)
    slots, peers = ranks_slots(dtype)
    norm = plain.RMSNorm(N, 1e-5)
    with torch.no_grad():
        norm.weight.normal_()
    norm = norm.to(dtype)
    residual = torch.randn(1, N, dtype=dtype)
    xs = [torch.randn(1, K, dtype=dtype) for _ in range(WORLD)]
    ws = [torch.randn(N, K, dtype=dtype) / K**0.5 for _ in range(WORLD)]
    # rank 1's part of output 3 is zero, of output 5 a negative sum too small for the dtype (-0.0 in
    # float16): both stored as +0.0, which is not taken for "not yet written"
    ws[1][3] = 0.0
    if dtype == torch.float16:
        ws[1][5], xs[1][:] = 1e-6, -1e-4
        assert triton_gemv.gemv(xs[1], ws[1])[0, 5].view(torch.int16) == RESET
    parts = [push(r, 0, slots, peers, xs[r], ws[r]).clone() for r in range(WORLD)]
    for r in range(WORLD):  # the part returned is the plain GEMV's result, and every rank's slot holds it
        torch.testing.assert_close(parts[r], triton_gemv.gemv(xs[r], ws[r]), atol=0, rtol=0)
        for holder in range(WORLD):
            torch.testing.assert_close(slots[holder][0, r], parts[r][0], atol=0, rtol=0)
    assert slots[0][0, 1, 3].view(torch.int16) == 0 and slots[0][0, 1, 5].view(torch.int16) != RESET
    assert (slots[0][1].view(torch.int16) == RESET).all(), "the other slot is untouched"

    total = (parts[0].float() + parts[1].float()).to(dtype)  # up to the rounding of the sum
    expected_out, expected_res = norm(total, residual)
    results = [triton_layers.lamport_reduce(slots[r][0], residual, norm.weight, norm.eps) for r in range(WORLD)]
    for out, res in results:
        torch.testing.assert_close(res, expected_res, atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(out, expected_out, atol=3e-2, rtol=3e-2)
    # every rank sums in rank order: the same bits everywhere
    assert all(torch.equal(a, b) for a, b in zip(results[0], results[1]))
    for r in range(WORLD):
        assert (slots[r].view(torch.int16) == RESET).all(), "read slots are reset for their next use"


def test_the_gated_down_projection_pushes_and_the_sum_alone_is_given_without_a_norm():
    torch.manual_seed(1)
    dtype = torch.float16  # (the interpreter multiplies bfloat16 wrongly in the activation; the GPU tests take it)
    slots, peers = ranks_slots(dtype)
    hs = [torch.randn(1, 2 * K, dtype=dtype) for _ in range(WORLD)]
    ws = [torch.randn(N, K, dtype=dtype) / K**0.5 for _ in range(WORLD)]
    # the parts returned are the slots' own rows, valid until the sum resets them: kept here as copies
    parts = [push(r, 1, slots, peers, hs[r], ws[r], gated=True).clone() for r in range(WORLD)]
    for r in range(WORLD):
        torch.testing.assert_close(parts[r], triton_gemv.gemv_silu_mul(hs[r], ws[r]), atol=0, rtol=0)
    summed = triton_layers.lamport_reduce(slots[0][1])
    # fp32 sum rounded once (the interpreter rounds bfloat16 toward zero, the GPU to nearest: within a step)
    torch.testing.assert_close(summed, (parts[0].float() + parts[1].float()).to(dtype), atol=1e-2, rtol=1e-2)
    assert (slots[0].view(torch.int16) == RESET).all()
