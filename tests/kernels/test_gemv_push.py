"""One-token partial sums pushed by the GEMV into the ranks' exchange slots and summed there
(`infer.distributed.all_reduce.lamport`), with the ranks' peer memory played by CPU tensors in one process (Triton's
interpreter): each GEMV stores into every rank's slot through the addresses a real exchange maps."""

import pytest
import torch

pytest.importorskip("infer.kernels.gemv")
from infer.distributed.all_reduce.lamport import RESET, PushTarget  # noqa: E402
from infer.kernels import gemv as triton_gemv  # noqa: E402
from infer.kernels import layers as triton_layers
from infer.plugins.layer import torch_layers as plain  # noqa: E402

WORLD, N, K = 2, 48, 64  # K: whole interpreter tiles (masked columns would add +0.0)


def ranks_slots(dtype):
    """Each rank's two slots [2, world, N], reset, and the [slot, rank] address table every rank holds."""
    slots = [torch.full((2, WORLD, N), RESET, dtype=torch.int16).view(dtype) for _ in range(WORLD)]
    peers = torch.tensor(
        [[s.data_ptr() + slot * WORLD * N * s.element_size() for s in slots] for slot in range(2)], dtype=torch.int64
    )
    return slots, peers


def push(rank, slot, slots, peers, x, w, gated=False):
    target = PushTarget(peers[slot], rank * N, slots[rank][slot, rank].view(1, N))
    fn = triton_gemv.gemv_silu_mul if gated else triton_gemv.gemv
    return fn(x, w, push=target)


class OneRankAllReduce:
    """A fast all-reduce over one rank holding `exchange`: the steps that do not push sum through it, x itself."""

    add_rms_norm = None

    def __init__(self, exchange):
        self.exchange = exchange

    def fits(self, x):
        return True

    def __call__(self, x):
        return x


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
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


def test_a_row_parallel_mlp_pushes_one_token_and_the_norm_after_takes_it_from_the_exchange():
    """The model's wiring, one rank: the down projection's fused GEMV pushes a one-token partial sum,
    `reduce_add_norm` finds it in the exchange; more tokens take the all-reduce."""
    import types

    from infer.api import Layers
    from infer.distributed.all_reduce.lamport import LamportExchange
    from infer.distributed.layers import reduce_add_norm
    from infer.distributed.state import ParallelState
    from infer.plugins.layer.fused import FusedLinear, FusedRMSNorm, FusedRotaryEmbedding, FusedSiluAndMul
    from infer.plugins.model.transformer import MLP

    dtype, hidden = torch.float16, 32
    slots = torch.full((3, 1, hidden), RESET, dtype=torch.int16).view(dtype)
    exchange = LamportExchange(slots, [slots.data_ptr()], rank=0)

    parallel = ParallelState(rank=0, world_size=1, fast_all_reduce=OneRankAllReduce(exchange))
    fused = Layers(
        rms_norm=FusedRMSNorm, rotary_embedding=FusedRotaryEmbedding, silu_and_mul=FusedSiluAndMul, linear=FusedLinear
    )
    config = types.SimpleNamespace(hidden_size=hidden, intermediate_size=48)
    torch.manual_seed(0)
    mlp = MLP(config, fused, parallel).to(dtype)
    for weight in mlp.parameters():  # the shards are allocated, not initialised
        torch.nn.init.normal_(weight, std=0.2)
    assert mlp.fused_down and getattr(mlp.down_matmul, "pushes", False)
    mlp.down_proj.push = True
    norm = FusedRMSNorm(hidden, 1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.normal_()
    for tokens, pushes in ((1, 1), (3, 0)):
        x, residual = torch.randn(tokens, hidden, dtype=dtype), torch.randn(tokens, hidden, dtype=dtype)
        before = exchange.pushes
        part = mlp(x)
        assert exchange.pushes - before == pushes and exchange.takes(part) == bool(pushes)
        expected = norm(part.clone(), residual)
        out, res = reduce_add_norm(parallel, part, residual, norm)
        torch.testing.assert_close(res, expected[1], atol=0, rtol=0)
        torch.testing.assert_close(out, expected[0], atol=0, rtol=0)
        assert (slots.view(torch.int16) == RESET).all() and not exchange.takes(part)
    with pytest.raises(RuntimeError, match="never reduced"):
        exchange.target(), exchange.target()


def test_a_one_token_vocab_parallel_embedding_is_pushed_and_summed_by_the_first_norm():
    """Two ranks' embedding shards (CPU tensors for their exchanges): each pushes its row or zeros
    into the embedding slot of both; the first layer's norm sums and normalises, and the sum is the
    residual. Then the same through the model's layer on one rank."""
    from infer.distributed.all_reduce.lamport import EMBED_SLOT, LamportExchange
    from infer.distributed.layers import VocabParallelEmbedding, reduce_norm
    from infer.distributed.state import ParallelState
    from infer.plugins.layer.fused import FusedRMSNorm

    dtype, hidden, vocab = torch.float16, 32, 10
    torch.manual_seed(0)
    table = torch.randn(vocab, hidden, dtype=dtype)
    slots = [torch.full((3, WORLD, hidden), RESET, dtype=torch.int16).view(dtype) for _ in range(WORLD)]
    exchanges = [LamportExchange(slots[r], [s.data_ptr() for s in slots], rank=r) for r in range(WORLD)]
    norm = FusedRMSNorm(hidden, 1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.normal_()
    for token in (2, 7):  # rank 0's rows 0-4, rank 1's 5-9
        ids = torch.tensor([token])
        parts = [
            triton_layers.embedding_push(ids, table[5 * r : 5 * r + 5], 5 * r, 5, exchanges[r].embed_target())
            for r in range(WORLD)
        ]
        owner = token // 5
        assert torch.equal(slots[1 - owner][EMBED_SLOT, owner], table[token])
        assert (slots[owner][EMBED_SLOT, 1 - owner] == 0).all() and (
            slots[owner][EMBED_SLOT, 1 - owner].view(torch.int16) == 0
        ).all()
        for r in range(WORLD):
            out, residual = exchanges[r].reduce(parts[r], None, norm.weight, norm.eps)
            assert torch.equal(residual, table[token : token + 1])
            torch.testing.assert_close(out, norm(table[token : token + 1]), atol=0, rtol=0)
            assert (slots[r].view(torch.int16) == RESET).all()

    one = torch.full((3, 1, hidden), RESET, dtype=torch.int16).view(dtype)
    parallel = ParallelState(world_size=1, fast_all_reduce=OneRankAllReduce(LamportExchange(one, [one.data_ptr()], 0)))
    embed = VocabParallelEmbedding(vocab, hidden, parallel).to(dtype)
    with torch.no_grad():
        embed.weight.copy_(table)
    embed.push = True
    for ids, pushed in ((torch.tensor([4]), True), (torch.tensor([4, 8]), False)):
        x = embed(ids)
        assert parallel.exchange.takes(x) == pushed
        out, residual = reduce_norm(parallel, x, norm)
        assert torch.equal(residual, table[ids]) and torch.equal(out, norm(table[ids]))
