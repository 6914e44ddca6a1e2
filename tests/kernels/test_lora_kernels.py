"""`infer.kernels.lora` (on the CPU under Triton's interpreter, small shapes): BGMV and SGMV add each
token's adapter's delta as their torch reference does, slot -1 leaving its rows untouched, for ranks and
widths that are not powers of two, a slot's tokens past one tile, and a slot's rows scattered among
others' (SGMV gathers them). On a GPU: tests/gpu/test_lora_gpu.py."""

import pytest
import torch

pytest.importorskip("triton")
from infer.kernels.lora import bgmv, group_by_slot, sgmv  # noqa: E402
from infer.kernels.lora_reference import lora_reference, segments_of  # noqa: E402

CASES = {  # name -> (K, N, R, slots per token)
    "decode, mixed": (40, 70, 24, [0, 2, -1, 1, 1, 0, -1, 2]),
    "prompts, a segment past a tile": (33, 65, 16, [1] * 37 + [-1] * 3 + [0] * 5),
    "decode rows of one slot apart": (40, 70, 8, [1, -1, 1, 2, 1, 0, 1, 2, 1, -1, 1, 1, 2, 0, 1, 1, 1, 1, 1]),
    "rank 48 (three fused pieces of 16)": (64, 96, 48, [2, 2, 0, -1, 1]),
}


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
@pytest.mark.parametrize("split", [512, 16])  # one partial sum, and several (K split across programs)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("kernel", ["bgmv", "sgmv"])
def test_kernels_add_each_tokens_adapter_delta_as_the_reference(case, kernel, split, monkeypatch):
    from infer.kernels import lora

    monkeypatch.setattr(lora, "SPLIT_K", split)
    K, N, R, slots = CASES[case]
    g = torch.Generator().manual_seed(len(slots))
    T, S = len(slots), 3
    x, y = torch.randn(T, K, generator=g), torch.randn(T, N, generator=g)
    a, b = torch.randn(S, R, K, generator=g), torch.randn(S, N, R, generator=g)
    want = lora_reference(x, y.clone(), a, b, segments_of(slots))
    got, scratch = y.clone(), torch.full((lora.parts(K), T, R), float("nan"))  # every value read was written
    if kernel == "bgmv":
        bgmv(x, got, a, b, torch.tensor(slots, dtype=torch.int32), scratch)
    else:
        order, tiles = group_by_slot(slots, S)
        sgmv(x, got, a, b, torch.tensor(order, dtype=torch.int32), torch.tensor(tiles, dtype=torch.int32), scratch)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    base = torch.tensor([s < 0 for s in slots])
    assert torch.equal(got[base], y[base])  # the base model's rows: untouched, bit for bit
    assert not torch.allclose(got[~base], y[~base])  # and the adapters' rows changed


def test_group_by_slot():
    # slot 0: tokens 2, 5; slot 1: 0, 3; slot 2: 4; max_tiles(6, 4) = 1 + 4 tiles, the unused one (-1, 0, 0)
    assert group_by_slot([1, -1, 0, 1, 2, 0], 4) == ([2, 5, 0, 3, 4], [0, 0, 2, 1, 2, 4, 2, 4, 5, -1, 0, 0, -1, 0, 0])


def test_group_by_slot_cuts_a_slots_tokens_into_tiles_of_block_m():
    from infer.kernels.lora import BLOCK_M, max_tiles

    slots = [0] * (BLOCK_M + 3) + [1] * (2 * BLOCK_M) + [-1] * 5
    order, tiles = group_by_slot(slots, 8)
    used = [tuple(tiles[i : i + 3]) for i in range(0, len(tiles), 3) if tiles[i] >= 0]
    assert used == [
        (0, 0, BLOCK_M),
        (0, BLOCK_M, BLOCK_M + 3),
        (1, BLOCK_M + 3, 2 * BLOCK_M + 3),
        (1, 2 * BLOCK_M + 3, 3 * BLOCK_M + 3),
    ]
    assert len(tiles) == 3 * max_tiles(len(slots), 8) and order == list(range(3 * BLOCK_M + 3))
    for n_slots in (1, 3, 8):  # the bound holds for any spread of the rows over the slots
        for spread in (
            [i % n_slots for i in range(70)],
            [0] * 69 + [n_slots - 1],
            [min(i, n_slots - 1) for i in range(70)],
        ):
            _, tiles = group_by_slot(spread, n_slots)
            assert len(tiles) == 3 * max_tiles(70, n_slots)
