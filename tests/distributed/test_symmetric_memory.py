"""The symmetric-memory all-reduce's set-up and choices, without GPUs (the sums themselves are checked
on two GPUs in tests/gpu/test_all_reduce_gpu.py)."""

from __future__ import annotations

import types

import pytest
import torch

symm_mem = pytest.importorskip("torch.distributed._symmetric_memory")

from infer.distributed.all_reduce import make_all_reduce  # noqa: E402
from infer.distributed.all_reduce.symm_mem import SymmetricAllReduce, forget_group  # noqa: E402


@pytest.fixture(autouse=True)
def peers_reachable(monkeypatch):
    """The "GPUs" these tests name see each other's memory (this machine may have no CUDA at all)."""
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b: True)
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)


@pytest.fixture
def fake_symm_mem(monkeypatch):
    """symm_mem.empty/rendezvous on the CPU, recording the calls."""
    calls = []
    monkeypatch.setattr(symm_mem, "empty", lambda n, dtype, device: torch.zeros(n, dtype=dtype))
    monkeypatch.setattr(symm_mem, "rendezvous", lambda buf, group: calls.append(("rendezvous", group.group_name)))
    return calls


GROUP = types.SimpleNamespace(group_name="0")


def test_a_deprecated_enable_is_not_called(fake_symm_mem, monkeypatch):
    # newer torch caches the first group's store under its name: calling it again for a second
    # engine's same-named group would rendezvous through a dead store
    def enable(name):
        fake_symm_mem.append(("enable", name))

    enable.__deprecated__ = "There is no need to call this function anymore."
    monkeypatch.setattr(symm_mem, "enable_symm_mem_for_group", enable)
    SymmetricAllReduce(GROUP, torch.device("cpu"), max_bytes=64)
    assert fake_symm_mem == [("rendezvous", "0")]


def test_an_older_torch_gets_the_group_enabled_first(fake_symm_mem, monkeypatch):
    monkeypatch.setattr(symm_mem, "enable_symm_mem_for_group", lambda name: fake_symm_mem.append(("enable", name)))
    SymmetricAllReduce(GROUP, torch.device("cpu"), max_bytes=64)
    assert fake_symm_mem == [("enable", "0"), ("rendezvous", "0")]


def test_forget_group_drops_the_cached_store(monkeypatch):
    cache = {"0": object(), "1": object()}
    monkeypatch.setattr(symm_mem, "_group_name_to_store", cache, raising=False)
    forget_group("0")
    assert list(cache) == ["1"]


def test_fits_by_shape_and_dtype_only(fake_symm_mem):
    fast = SymmetricAllReduce(GROUP, torch.device("cpu"), max_bytes=4096)
    assert fast.fits(torch.empty(1, 1024, dtype=torch.float32))  # 4 KiB
    assert not fast.fits(torch.empty(2, 1024, dtype=torch.float32))  # 8 KiB: NCCL's
    assert fast.fits(torch.empty(1, 8, dtype=torch.bfloat16))
    assert not fast.fits(torch.empty(1, 8, dtype=torch.float16))  # no one-shot kernel for fp16
    assert not fast.fits(torch.empty(1, 3, dtype=torch.bfloat16))  # 6 bytes: not whole 16-byte vectors
    assert not fast.fits(torch.empty(0, 8, dtype=torch.bfloat16))


def test_flashinfer_all_reduce_says_why_it_cannot_run():
    from infer.distributed.all_reduce import flashinfer_fused as flashinfer_all_reduce

    cpu = flashinfer_all_reduce.unavailable_reason(torch.device("cpu"), 2, torch.bfloat16)
    assert "needs CUDA devices" in cpu
    assert "not float32" in flashinfer_all_reduce.unavailable_reason(torch.device("cuda", 0), 2, torch.float32)


@pytest.fixture
def no_flashinfer(monkeypatch):
    """FlashInfer's all-reduce unavailable on this rank (auto's first choice)."""
    from infer.distributed.all_reduce import flashinfer_fused as flashinfer_all_reduce

    monkeypatch.setattr(flashinfer_all_reduce, "unavailable_reason", lambda *args, **kwargs: "not installed")


def test_float16_models_keep_nccl_and_say_why(no_flashinfer):
    parallel = types.SimpleNamespace(
        is_parallel=True, world_size=2, rank=0, device=torch.device("cuda", 0), min=lambda v: v
    )
    fast, line = make_all_reduce("auto", parallel, torch.float16, 64)
    assert fast is None and "has no float16" in line and "--dtype bfloat16" in line
    assert "flashinfer unavailable: not installed" in line
    with pytest.raises(Exception, match="--all-reduce symm-mem cannot run: .*float16"):
        make_all_reduce("symm-mem", parallel, torch.float16, 64)
    assert make_all_reduce("nccl", parallel, torch.bfloat16, 64) == (None, "nccl")


class RankZero:
    """Rank 0 of two: `min` answers with the other rank's values, one per collective call, in order."""

    def __init__(self, peer_values):
        self.is_parallel, self.world_size, self.rank, self.device = True, 2, 0, torch.device("cuda", 0)
        self.group = GROUP
        self.peer_values = list(peer_values)

    def min(self, value):
        return min(value, self.peer_values.pop(0))


def test_an_engine_after_one_that_used_symmetric_memory_keeps_nccl(fake_symm_mem, no_flashinfer, monkeypatch):
    # torch numbers a process's rendezvous: rank 0, which already did one for an earlier engine, and
    # a freshly spawned rank 1 would wait for each other's keys forever
    from infer.distributed.all_reduce import symm_mem as symmetric_memory

    monkeypatch.setattr(symmetric_memory, "_rendezvous_done", 0)
    # first engine: both ranks have done none (flashinfer availability min, count min, -count min,
    # availability min)
    fast, line = make_all_reduce("auto", RankZero([0, 0, 0, 1]), torch.bfloat16, 64)
    assert isinstance(fast, SymmetricAllReduce) and line.startswith("symm-mem")
    assert symmetric_memory._rendezvous_done == 1 and fake_symm_mem == [("rendezvous", "0")]
    # second engine, new rank 1: no rendezvous is attempted, auto says why and keeps NCCL
    fast, line = make_all_reduce("auto", RankZero([0, 0, 0, 1]), torch.bfloat16, 64)
    assert fast is None and "an earlier tensor-parallel engine in this process" in line
    assert fake_symm_mem == [("rendezvous", "0")]
    with pytest.raises(Exception, match="--all-reduce symm-mem cannot run: an earlier tensor-parallel engine"):
        make_all_reduce("symm-mem", RankZero([0, 0, 1]), torch.bfloat16, 64)
    # ranks that all did one before (torchrun: every process ran the earlier engine) still agree
    fast, _ = make_all_reduce("auto", RankZero([0, 1, -1, 1]), torch.bfloat16, 64)
    assert isinstance(fast, SymmetricAllReduce) and symmetric_memory._rendezvous_done == 2


def test_ranks_ask_about_their_rendezvous_even_when_they_cannot_use_symmetric_memory(no_flashinfer):
    # the count comparison is collective: a rank that would skip it leaves the others waiting
    parallel = RankZero([0, 0, 0, 1])
    fast, line = make_all_reduce("auto", parallel, torch.float16, 64)
    assert fast is None and "has no float16" in line and parallel.peer_values == []


class FakeFlashInfer:
    max_tokens = 2048

    def __init__(self, parallel, hidden_size, dtype):
        self.hidden_size, self.dtype = hidden_size, dtype


@pytest.fixture
def flashinfer_here(monkeypatch):
    """FlashInfer's all-reduce available on this rank; its set-up recorded instead of run."""
    from infer.distributed.all_reduce import flashinfer_fused as flashinfer_all_reduce

    monkeypatch.setattr(flashinfer_all_reduce, "unavailable_reason", lambda *args, **kwargs: None)
    monkeypatch.setattr(flashinfer_all_reduce, "FlashInferAllReduce", FakeFlashInfer)


def test_auto_takes_flashinfer_when_every_rank_can(flashinfer_here, fake_symm_mem):
    parallel = RankZero([1])
    fast, line = make_all_reduce("auto", parallel, torch.float16, 64)  # FlashInfer sums fp16 too
    assert isinstance(fast, FakeFlashInfer) and line.startswith("flashinfer") and parallel.peer_values == []
    assert fake_symm_mem == []  # no symmetric-memory rendezvous asked for


def test_auto_passes_flashinfer_over_when_another_rank_cannot(flashinfer_here, fake_symm_mem, monkeypatch):
    from infer.distributed.all_reduce import symm_mem as symmetric_memory

    monkeypatch.setattr(symmetric_memory, "_rendezvous_done", 0)
    # rank 1 could not build FlashInfer's kernels: every rank goes on to symmetric memory together
    fast, line = make_all_reduce("auto", RankZero([0, 0, 0, 1]), torch.bfloat16, 64)
    assert isinstance(fast, SymmetricAllReduce) and line.startswith("symm-mem")
    with pytest.raises(Exception, match="--all-reduce flashinfer cannot run: another rank cannot use it"):
        make_all_reduce("flashinfer", RankZero([0]), torch.bfloat16, 64)


def test_peer_memory_needs_one_host_and_peer_access(monkeypatch):
    from infer.distributed.all_reduce import peer_access_reason

    rank0 = types.SimpleNamespace(is_parallel=True, world_size=2, rank=0, device=torch.device("cuda", 0))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")  # not torchrun's: ranks the engine spawns share this host
    asked = []
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b: asked.append((a, b)) or True)
    assert peer_access_reason(rank0) is None and asked == [(0, 1)]
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b: False)
    assert "GPU 0 has no peer access to GPU 1" in peer_access_reason(rank0)
    # torchrun over two hosts, one rank each
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert "span several hosts (1 on this one)" in peer_access_reason(rank0)
    assert (
        peer_access_reason(types.SimpleNamespace(is_parallel=True, world_size=2, rank=0, device=torch.device("cpu")))
        is None
    )


def test_no_peer_access_keeps_nccl_and_says_why(monkeypatch):
    from infer.distributed import all_reduce

    monkeypatch.setattr(all_reduce, "peer_access_reason", lambda parallel: "GPU 0 has no peer access to GPU 1")
    parallel = RankZero([1, 0, 0, 1])  # this rank's zeros decide: nothing is set up
    fast, line = make_all_reduce("auto", parallel, torch.bfloat16, 64)
    assert fast is None and line.count("no peer access") == 2
    with pytest.raises(Exception, match="--all-reduce flashinfer cannot run: GPU 0 has no peer access"):
        make_all_reduce("flashinfer", RankZero([1]), torch.bfloat16, 64)
