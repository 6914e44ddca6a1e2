"""Outside the core, an engine is used through its public stepping API only (`infer.core.engine.Engine`:
add_request, stream, step / step_outputs, abort, is_generating, abandon_all, the read-only `parts`
facts, stats): no code of infer outside `infer/core/` reads a private attribute of an engine
(`engine._x`) or one of the collaborators the engine steps (`engine.output`, `.scheduler`,
`.decoder`, `.block_mover`, and through `parts` its runners, scheduler, decoder, output)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "infer"
INTERNALS = {"output", "scheduler", "decoder", "block_mover"}  # the engine's collaborators
PART_INTERNALS = {"runners", "scheduler", "decoder", "output", "block_mover", "processors", "closers"}
# name -> why it may read an internal: a measuring tool that instruments the loop from outside, by design
ALLOWED = {
    "infer/bench/profiler.py": "times the scheduler's and decoder's calls by wrapping them (infer bench profile)",
    # a measurement of the forward itself, below the stepping API (the lab drivers in benchmarks/lab use it):
    "infer/bench/ceilings.py": "times the runner's forward without the scheduler or sampler (the step's floor)",
}


def _is_engine(node: ast.expr) -> bool:
    return (isinstance(node, ast.Name) and node.id == "engine") or (
        isinstance(node, ast.Attribute) and node.attr == "engine"
    )


def _violations(tree: ast.AST) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        if _is_engine(node.value):
            private = node.attr.startswith("_") and not node.attr.startswith("__")
            if private or node.attr in INTERNALS:
                found.append((node.lineno, f"engine.{node.attr}"))
        elif isinstance(node.value, ast.Attribute) and node.value.attr == "parts" and _is_engine(node.value.value):
            if node.attr in PART_INTERNALS:
                found.append((node.lineno, f"engine.parts.{node.attr}"))
    return found


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
def test_no_private_engine_state_is_read_outside_the_core():
    bad = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT.parent).as_posix()
        if rel.startswith("infer/core/") or rel in ALLOWED:
            continue
        bad += [f"{rel}:{line}: {what}" for line, what in _violations(ast.parse(path.read_text()))]
    assert not bad, "reads of engine internals outside the core:\n" + "\n".join(bad)


def test_the_check_finds_what_it_forbids():
    source = "engine._abandon([])\nself.engine.output.groups\nx = engine.parts.runners[0]\nengine.step()\n"
    assert [what for _, what in _violations(ast.parse(source))] == [
        "engine._abandon", "engine.output", "engine.parts.runners",
    ]  # fmt: skip
