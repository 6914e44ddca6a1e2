"""The GPU lab drivers of benchmarks/lab as far as a CPU reaches: each is a module with a `--help`
that states its question, and what they read from the engine."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from benchmarks.lab.graphs import decode_graph

MODULES = [
    "allreduce",
    "features",
    "gemv_rows",
    "gemv_sweep",
    "latency",
    "memory",
    "pdl",
    "tensor_parallel",
    "throughput",
]
REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", MODULES)
def test_help_states_the_question(name, capsys):
    module = importlib.import_module(f"benchmarks.lab.{name}")
    with pytest.raises(SystemExit) as exit_:
        module.main(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: python -m benchmarks.lab.{name}")
    assert "?" in module.__doc__.split("\n\n")[0] and f"python -m benchmarks.lab.{name}" in module.__doc__


@pytest.mark.slow  # a fresh interpreter imports torch
def test_runs_as_a_module():
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.lab.tensor_parallel", "--help"], capture_output=True, text=True, cwd=REPO
    )
    assert done.returncode == 0 and "two GPUs" in done.stdout


def test_tensor_parallel_refuses_an_unknown_part(capsys):
    from benchmarks.lab import tensor_parallel

    with pytest.raises(SystemExit) as exit_:
        tensor_parallel.parse_args(["7b", "13b"])
    assert exit_.value.code == 2
    assert "unknown part 13b: use 70b, 7b, spec" in capsys.readouterr().err


def test_decode_graph_is_the_target_runners_batch_graph():
    graph = object()
    engine = SimpleNamespace(parts=SimpleNamespace(runners=(SimpleNamespace(graphs=None),)))
    assert decode_graph(engine) is None
    engine.parts.runners[0].graphs = SimpleNamespace(graphs={1: (graph, None), 4: (None, None)})
    assert decode_graph(engine) is graph
    assert decode_graph(engine, num_seqs=2) is None
