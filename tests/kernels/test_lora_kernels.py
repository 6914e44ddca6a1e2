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
@pytest.mark.parametrize("kernel", ["bgmv", "sgmv", "sgmv-part-by-part"])
def test_kernels_add_each_tokens_adapter_delta_as_the_reference(case, kernel, split, monkeypatch):
    from infer.kernels import lora

    monkeypatch.setattr(lora, "SPLIT_K", split)
    if kernel == "sgmv-part-by-part":  # the expand's partial sums a load each (what high ranks take)
        monkeypatch.setattr(lora, "ONE_LOAD_MOST", 0)
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


def test_a_tile_list_shorter_than_the_grid_is_refused():
    from infer.kernels.lora import max_tiles

    x, y = torch.zeros(20, 8), torch.zeros(20, 8)
    a, b = torch.zeros(3, 4, 8), torch.zeros(3, 8, 4)
    short = torch.zeros(3 * max_tiles(20, 3) - 3, dtype=torch.int32)
    with pytest.raises(ValueError, match="group_by_slot makes them"):
        sgmv(x, y, a, b, torch.zeros(20, dtype=torch.int32), short, torch.zeros(1, 20, 4))


@pytest.mark.parametrize("rows", [3, 20])  # BGMV's rows, SGMV's
def test_the_shrink_begun_before_the_projection_gives_the_references_deltas(rows, monkeypatch):
    """`AdapterLayer.begin` then the layer, as the model calls them (on the CPU the kernels run under the
    interpreter and begin shrinks at once; on a GPU, tests/gpu/test_lora_gpu.py: the side stream), for two
    targets one after the other: each layer's y is the reference's."""
    from infer.api.adapters import AdapterBatch, AdapterSpec, AdapterTarget, begin_adapter
    from infer.plugins.adapter import lora as plugin

    monkeypatch.setattr(plugin, "_triton_ready", lambda device: True)
    targets = (
        AdapterTarget("layers.0.self_attn.qkv_proj", 0, ("q_proj", "k_proj", "v_proj"), 40, (24, 8, 8)),
        AdapterTarget("layers.0.mlp.down_proj", 0, ("down_proj",), 56, (40,)),
    )
    spec = AdapterSpec(
        targets, max_adapters=3, max_rank=8, dtype=torch.float32, device=torch.device("cpu"), max_tokens=32
    )
    kind = plugin.LoRAKind(spec)
    g = torch.Generator().manual_seed(rows)
    for t in targets:
        kind.a[t.module].copy_(torch.randn(kind.a[t.module].shape, generator=g))
        kind.b[t.module].copy_(torch.randn(kind.b[t.module].shape, generator=g))
    layers = kind.layers()
    slots = [i % 4 - 1 for i in range(rows)]
    kind.plan(AdapterBatch(slots, [1] * rows, rows))
    assert kind.kernels and kind.per_token == (rows <= plugin.BGMV_MAX_TOKENS)
    for t in targets:
        x = torch.randn(rows, t.in_features, generator=g)
        y = torch.randn(rows, sum(t.out_features), generator=g)
        want = lora_reference(x, y.clone(), kind.a[t.module], kind.b[t.module], segments_of(slots))
        begin_adapter(layers[t.module], x)
        assert kind.begun == t.module
        got = layers[t.module](x, y.clone())
        assert kind.begun is None and kind.begun_x is None  # joined, and x let go
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
