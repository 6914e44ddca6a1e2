"""The README's examples, run as written: every Python block (the OpenAI client's against `infer serve`
started by the README's own command on a free port), every line of its command-line block that runs on
a CPU, and the `infer run` table's header as `infer run` prints it. So the README cannot drift from the
code."""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from launchers import free_port  # tests/, on sys.path

README = Path(__file__).resolve().parents[1] / "README.md"
TEXT = README.read_text()


def blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", TEXT, re.S)


def section(title: str) -> str:
    start = TEXT.index(title)
    end = TEXT.find("\n## ", start + len(title))
    return TEXT[start : end if end != -1 else None]


PYTHON = blocks("python")
CLIENT = [code for code in PYTHON if "OpenAI(" in code]
IN_PROCESS = [code for code in PYTHON if "OpenAI(" not in code]


def test_the_readme_has_the_examples_these_tests_run():
    assert len(IN_PROCESS) >= 4 and len(CLIENT) == 1
    assert TEXT.count("\n## ") >= 6 and "## Contents" in TEXT
    for link in re.findall(r"\]\((docs/[^)#]+)", TEXT):
        assert (README.parent / link).exists(), link


@pytest.mark.slow  # an engine per example, on the real SmolLM2
@pytest.mark.parametrize("code", IN_PROCESS, ids=[f"block{i}" for i in range(len(IN_PROCESS))])
def test_each_python_example_runs_as_written(smollm2_dir, code, capsys):
    exec(compile(code, "README.md", "exec"), {"__name__": "readme"})
    assert capsys.readouterr().out.strip() or "engine.close()" in code  # each prints what it shows


@pytest.mark.slow  # a server process of its own
def test_the_serving_example_runs_against_the_readmes_serve_command(smollm2_dir, capsys):
    command = next(line for line in blocks("bash") if line.startswith("infer serve"))
    argv = shlex.split(command.split("#")[0])
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "infer", *argv[1:], "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env={**os.environ, "INFER_CPU_THREADS": "1"},
    )
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:] if proc.stderr else ""
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as answer:
                    if answer.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "infer serve did not come up"
            time.sleep(0.5)
        code = CLIENT[0].replace("127.0.0.1:8000", f"127.0.0.1:{port}")
        exec(compile(code, "README.md", "exec"), {"__name__": "readme"})
        printed = [line for line in capsys.readouterr().out.splitlines() if line.strip()]
        assert len(printed) >= 2, printed  # the completion's text, then the streamed chat's
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)


def cli_lines() -> list[str]:
    block = re.search(r"```bash\n(.*?)```", section("### The command line"), re.S)
    assert block is not None
    return [line.split("   #")[0].strip() for line in block.group(1).splitlines() if line.strip()]


def cpu_runnable(line: str) -> bool:
    return "paged-cuda" not in line and "--load-format dummy" not in line


@pytest.mark.slow  # each line a CLI process of its own
@pytest.mark.parametrize("line", [x for x in cli_lines() if cpu_runnable(x)])
def test_each_command_line_example_runs(smollm2_dir, line):
    argv = shlex.split(line)
    assert argv[0] == "infer"
    done = subprocess.run(
        [sys.executable, "-m", "infer", *argv[1:]],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "INFER_CPU_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr[-2000:]


def test_the_gpu_lines_are_the_only_ones_left_out():
    left_out = [line for line in cli_lines() if not cpu_runnable(line)]
    assert left_out == [line for line in cli_lines() if "llama3-8b" in line]


def test_the_run_tables_header_is_the_one_infer_run_prints():
    from infer.bench.report import RunRecord, format_table

    record = RunRecord("infer", {}, 1, 1, 1, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0, 1)
    HEADER = format_table([record]).splitlines()[0].split()

    sample = re.search(r"```\n(run .*?)\n", TEXT)
    assert sample is not None
    assert sample.group(1).split() == HEADER
