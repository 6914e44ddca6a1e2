"""Torch's threads on the CPU (`infer.common.cpus`, --cpu-threads, INFER_CPU_THREADS): the cores this process
may use, one when the machine is busy (with a warning), the user's choice over both."""

from __future__ import annotations

import pytest
import torch

from infer.api.config import EngineConfig
from infer.api.errors import ConfigError
from infer.common import cpus


@pytest.fixture
def machine(monkeypatch):
    def set_(cores: int, load: float | None) -> None:
        monkeypatch.setattr(cpus, "available", lambda: cores)
        monkeypatch.setattr(cpus, "load", lambda: load)

    return set_


def test_threads_follow_the_machine(machine):
    machine(cores=2, load=0.3)
    assert cpus.choose(None, current=8) == (2, None)  # capped by the cores this process may use
    assert cpus.choose(None, current=1) == (1, None)  # never more than torch was given (a caller's one thread)
    machine(cores=2, load=12.0)
    threads, warning = cpus.choose(None, current=2)
    assert threads == 1 and "busy (load 12.0 on the 2 cores" in warning and "--cpu-threads" in warning
    assert cpus.choose(3, current=2) == (3, None)  # asked for: as asked, busy or not


def test_the_cgroup_quota_caps_the_cores(monkeypatch, tmp_path):
    quota = tmp_path / "cpu.max"
    quota.write_text("150000 100000\n")  # 1.5 cores' worth
    monkeypatch.setattr(cpus, "CGROUP_CPU_MAX", quota)
    assert cpus.available() == 1
    quota.write_text("max 100000\n")
    assert cpus.available() >= 1


def test_an_engine_on_a_busy_machine_runs_one_thread(machine, monkeypatch, tiny_llama_dir, caplog):
    from infer import LLM

    machine(cores=2, load=9.0)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with LLM(model=str(tiny_llama_dir), attention="torch", num_kv_blocks=16, max_model_len=64):
            assert torch.get_num_threads() == 1
        monkeypatch.setenv("INFER_CPU_THREADS", "2")
        with LLM(model=str(tiny_llama_dir), attention="torch", num_kv_blocks=16, max_model_len=64):
            assert torch.get_num_threads() == 2  # the variable chose
        with LLM(model=str(tiny_llama_dir), attention="torch", num_kv_blocks=16, max_model_len=64, cpu_threads=1):
            assert torch.get_num_threads() == 1  # the option wins
    finally:
        torch.set_num_threads(before)
    with pytest.raises(ConfigError, match="cpu_threads"):
        EngineConfig(cpu_threads=0).validate()


def test_a_gpu_option_on_the_cpu_says_it_does_nothing(tiny_llama_dir):
    from structlog.testing import capture_logs

    from infer import LLM

    with capture_logs() as logs:
        with LLM(
            model=str(tiny_llama_dir), attention="torch", num_kv_blocks=16, max_model_len=64, gpu_memory_utilization=0.5
        ):
            pass
    said = [e["event"] for e in logs if e.get("log_level") == "warning"]
    assert any("--gpu-memory-utilization 0.5 does nothing on the CPU" in line for line in said), said


def test_the_governor_leaves_busy_cores_and_comes_back(monkeypatch):
    """Others take a core while the engine runs: torch drops to one thread at once (one warning), and goes
    back to two after three quiet looks; a look comes at most every interval."""
    from structlog.testing import capture_logs

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        governor = cpus.Governor(threads=2, cores=2, interval_s=0.0)
        seen = iter([0.1, 1.2, 1.5, 0.1, 0.1, 0.8, 0.1, 0.1, 0.1])
        governor._use = lambda: next(seen)
        counts = []
        with capture_logs() as logs:
            for _ in range(9):
                governor.tick()
                counts.append(torch.get_num_threads())
        assert counts == [2, 1, 1, 1, 1, 1, 1, 1, 2]  # quiet looks reset by the busy one (0.8)
        warnings = [e["event"] for e in logs if e.get("log_level") == "warning"]
        assert len(warnings) == 1 and "took 1.2 of the 2 cores" in warnings[0]
        slow = cpus.Governor(threads=2, cores=2, interval_s=3600.0)
        slow._use = lambda: 2.0
        slow.tick()
        assert slow.current == 2  # not looked yet
    finally:
        torch.set_num_threads(before)


@pytest.mark.skipif(not cpus.PROC_STAT.exists(), reason="reads /proc/stat (Linux)")
def test_others_use_counts_another_process_and_not_this_one():
    import subprocess
    import sys
    import time

    use = cpus.OthersUse()
    deadline = time.monotonic() + 0.6
    while time.monotonic() < deadline:  # this process spins: not "others"
        pass
    alone = use()
    spinner = subprocess.Popen(
        [sys.executable, "-c", "import time\nt = time.time() + 1.5\nwhile time.time() < t: pass"]
    )
    try:
        time.sleep(1.0)
        beside = use()
    finally:
        spinner.wait()
    assert alone is not None and beside is not None
    assert beside >= 0.6 and beside > alone, (alone, beside)


def test_an_engine_on_the_cpu_runs_a_governor_unless_threads_are_chosen(machine, tiny_llama_dir):
    from infer import LLM

    machine(cores=2, load=0.1)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with LLM(model=str(tiny_llama_dir), attention="torch", num_kv_blocks=16, max_model_len=64) as llm:
            governor = llm.engine.parts.runners[0].threads
            assert isinstance(governor, cpus.Governor) and governor.threads == 2
        with LLM(
            model=str(tiny_llama_dir), attention="torch", num_kv_blocks=16, max_model_len=64, cpu_threads=2
        ) as llm:
            assert llm.engine.parts.runners[0].threads is None
    finally:
        torch.set_num_threads(before)
