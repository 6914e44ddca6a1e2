"""Tensor-parallel engines started from user scripts (CPU, gloo, spawned ranks): a script with no
main guard ends with one line saying so; Ctrl-C sent to the whole process group (as a terminal
does) reaches rank 0 alone, which drops its requests, while the ranks print nothing."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # each script starts ranks and waits out a signal

REPO = Path(__file__).resolve().parents[2]


def script(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "user_script.py"
    path.write_text(textwrap.dedent(body))
    return path


def start(path: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen(
        [sys.executable, str(path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,  # its own process group, as a terminal's job
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


def test_script_without_main_guard_gets_one_line(tmp_path, tiny_llama_dir):
    path = script(
        tmp_path,
        f"""
        from infer.llm import LLM
        llm = LLM(model={str(tiny_llama_dir)!r}, device="cpu", attention="torch", tensor_parallel_size=2)
        print("built")
    """,
    )
    proc = start(path)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode != 0 and "built" not in out
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert 'if __name__ == "__main__":' in lines[0] and str(path) in lines[0]


def test_ctrl_c_reaches_rank_zero_only(tmp_path, tiny_llama_dir):
    path = script(
        tmp_path,
        f"""
        from infer import SamplingParams
        from infer.llm import LLM

        if __name__ == "__main__":
            with LLM(model={str(tiny_llama_dir)!r}, device="cpu", attention="torch", tensor_parallel_size=2,
                     max_model_len=512) as llm:
                print("built", flush=True)
                try:
                    llm.generate([[5, 6, 7]] * 64, SamplingParams(max_tokens=500, temperature=0, ignore_eos=True))
                except KeyboardInterrupt:
                    print("interrupted; unfinished:", llm.has_unfinished(), flush=True)
                    raise SystemExit(130)
            print("finished without an interrupt", flush=True)
    """,
    )
    proc = start(path)
    assert proc.stdout.readline().strip() == "built"
    import time

    time.sleep(2.0)  # mid-generate: 64 x 500 tokens take far longer
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, (out, err)
    assert out.strip() == "interrupted; unfinished: False"
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err


def test_ctrl_c_during_infer_run_with_ranks_is_one_line(tmp_path, tiny_llama_dir):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [
        sys.executable,
        "-m",
        "infer.cli.main",
        "run",
        "--model",
        str(tiny_llama_dir),
        "--device",
        "cpu",
        "--attention",
        "torch",
        "--tp",
        "2",
        "--dataset",
        "random-256x256",
        "--num-prompts",
        "1000",
        "--max-tokens",
        "250",
        "--max-model-len",
        "512",
        "--no-progress",
    ]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    import time

    seen = []
    while not any("engine built" in line for line in seen):  # the ranks are up
        seen.append(proc.stderr.readline())
        assert seen[-1] or proc.poll() is None, seen
    time.sleep(3.0)  # stepping: 1000 x 250 tokens take far longer on two CPU cores
    assert proc.poll() is None, proc.communicate()
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    err = "".join(seen) + err
    assert proc.returncode == 130, (out, err)
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert err.strip().splitlines()[-1] == "interrupted", err
    assert len([line for line in err.splitlines() if "interrupted" in line]) == 1, err
