"""`infer bench serve` through the CLI against the fake server: a rate sweep's table, JSON and PNG, the
workload's prompts on the wire, and every user error as one line with a non-zero exit."""

from __future__ import annotations

import json
import sys

import pytest
from click.testing import CliRunner
from launchers import free_port  # tests/, on sys.path

from infer.cli.main import cli


def invoke(*args: str):
    return CliRunner().invoke(cli, ["bench", "serve", *args])


def one_error_line(result, expected: str) -> None:
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    lines = [line for line in result.output.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and expected in lines[0], result.output


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
def test_a_sweep_writes_a_row_per_rate_json_and_png(fake_server, tmp_path):
    fake_server.first_s, fake_server.gap_s = 0.02, 0.005
    out, png = tmp_path / "serve.json", tmp_path / "serve.png"
    args = ["--base-url", fake_server.url + "/v1", "--workload", "random-8x4", "--vocab-size", "100"]
    args += ["--num-prompts", "6", "--request-rate", "40", "--request-rate", "80,inf", "--seed", "2"]
    args += ["--goodput", "ttft:1000", "e2e:5000", "--json", str(out), "--png", str(png)]
    result = invoke(*args)
    assert result.exit_code == 0, result.output
    table = result.stdout.splitlines()
    assert table[0].startswith("rate req/s") and [line.split()[0] for line in table[2:5]] == ["40", "80", "inf"]
    assert table[5:] == [f"wrote {out}", f"wrote {png}"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    record = json.loads(out.read_text())
    settings = record["settings"]
    assert settings["model"] == "fake-model" and settings["base_url"] == fake_server.url
    assert settings["request_rate"] == ["40", "80", "inf"] and settings["slo_ms"] == {"ttft": 1000.0, "e2e": 5000.0}
    assert settings["workload"] == "random-8x4" and settings["num_prompts"] == 6 and "api_key" not in settings
    assert [run["request_rate"] for run in record["runs"]] == ["40", "80", "inf"]
    for run in record["runs"]:
        assert (run["completed"], run["failed"], run["output_tokens"], run["prompt_tokens"]) == (6, 0, 24, 48)
        assert run["goodput"] == pytest.approx(run["request_throughput"])  # every request within a loose SLO
        assert run["ttft_ms"]["p50"] >= 20.0 and len(run["requests"]) == 6
        assert all(len(r["itl_ms"]) == 3 and r["error"] is None for r in run["requests"])
    prompts = [b["prompt"] for b in fake_server.bodies]
    assert len(prompts) == 18 and all(len(p) == 8 and all(10 <= t < 100 for t in p) for p in prompts)
    assert {b["max_tokens"] for b in fake_server.bodies} == {4}
    assert sorted(map(tuple, prompts[:6])) == sorted(map(tuple, prompts[6:12]))  # the same workload at each rate


def test_one_rate_prints_the_percentiles_and_chat_sends_text(fake_server):
    result = invoke("--base-url", fake_server.url, "--endpoint", "chat", "--workload", "builtin", "--max-tokens", "3")
    assert result.exit_code == 0, result.output
    assert any(line.startswith("TTFT ms") for line in result.output.splitlines())
    assert any(line.startswith("normalized ms/tok") for line in result.output.splitlines())
    assert len(fake_server.bodies) == 8 and all(b["max_completion_tokens"] == 3 for b in fake_server.bodies)
    assert fake_server.bodies[0]["messages"][0]["role"] == "user"


def test_failures_are_reported_and_the_run_completes(fake_server):
    fake_server.fail_every = 2
    args = ["--base-url", fake_server.url, "--workload", "random-4x2", "--vocab-size", "50", "--num-prompts", "6"]
    result = invoke(*args, "--max-concurrency", "1")
    assert result.exit_code == 0, result.output
    assert "rate inf: 3 failed: HTTP 500: the engine failed" in result.output
    assert "3/3" in result.output  # done/failed


def test_connection_refused_is_one_line():
    one_error_line(invoke("--base-url", f"http://127.0.0.1:{free_port()}"), "start the server, or fix --base-url")


def test_a_url_that_is_no_url_is_one_line():
    one_error_line(invoke("--base-url", "127.0.0.1:8000"), "write it as http://HOST:PORT")


def test_a_wrong_path_is_one_line(fake_server):
    one_error_line(invoke("--base-url", fake_server.url + "/api"), "answered HTTP 404: no route /api/v1/models")


@pytest.mark.parametrize("key, fix", [(None, "pass the server's key with --api-key"), ("wrong", "check --api-key")])
def test_a_refused_key_is_one_line(fake_server, key, fix):
    fake_server.api_key = "secret"
    args = ["--base-url", fake_server.url] + (["--api-key", key] if key else [])
    one_error_line(invoke(*args), f"HTTP 401: invalid API key): {fix}")


def test_the_right_key_is_sent(fake_server):
    fake_server.api_key = "secret"
    args = ["--base-url", fake_server.url, "--api-key", "secret", "--workload", "builtin", "--max-tokens", "2"]
    assert invoke(*args).exit_code == 0 and len(fake_server.bodies) == 8


def test_an_unknown_model_lists_the_served_ones(fake_server):
    one_error_line(invoke("--base-url", fake_server.url, "--model", "gpt-9"), "pass --model with one of fake-model")


def test_every_request_failing_exits_non_zero(fake_server):
    fake_server.fail_every = 1
    result = invoke("--base-url", fake_server.url, "--workload", "builtin", "--max-tokens", "2")
    one_error_line(result, "every request failed (HTTP 500: the engine failed)")


def test_chat_needs_text_or_a_tokenizer(fake_server):
    args = ["--base-url", fake_server.url, "--endpoint", "chat", "--workload", "random-4x2", "--vocab-size", "50"]
    one_error_line(invoke(*args), "pass --tokenizer to decode them, or use --endpoint completions")


def test_token_ids_need_a_known_vocabulary(fake_server):
    one_error_line(invoke("--base-url", fake_server.url, "--workload", "random-4x2"), "--vocab-size N")


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--goodput", "ttft=200"], "write NAME:MS"),
        (["--goodput", "ttft:200", "stray"], "'stray' is not an SLO"),
        (["--request-rate", "0"], "write requests per second (> 0) or inf"),
        (["--request-rate", "1,fast"], "'fast' is not a rate"),
        (["--max-concurrency", "0"], "'--max-concurrency'"),
        (["--json", "/no/such/folder/x.json"], "does not exist"),
        (["--priority-mix", "high:1"], "write PRIORITY:WEIGHT pairs"),
        (["--priority-mix", "0:0"], "write PRIORITY:WEIGHT pairs"),
        (["--priority-mix", "0:nan"], "write PRIORITY:WEIGHT pairs"),
    ],
)
def test_bad_options_are_one_line(args, expected):
    one_error_line(invoke(*args), expected)


def test_png_without_matplotlib_names_the_extra(fake_server, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    result = invoke("--base-url", fake_server.url, "--workload", "builtin", "--png", str(tmp_path / "x.png"))
    one_error_line(result, "pip install 'infer[bench]'")
    assert fake_server.bodies == []  # refused before any request


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
def test_the_vocabulary_and_the_chat_text_come_from_the_model_on_this_machine(fake_server, smollm2_dir):
    from infer.loading.loader import load_tokenizer

    fake_server.models = ["smollm2-135m"]
    args = ["--base-url", fake_server.url, "--workload", "random-16x2", "--num-prompts", "40"]
    assert invoke(*args).exit_code == 0  # the vocabulary of the served model, found in infer's cache
    ids = [t for b in fake_server.bodies for t in b["prompt"]]
    tokenizer = load_tokenizer(smollm2_dir)
    assert max(ids) < len(tokenizer) and max(ids) > 0.9 * len(tokenizer)  # 640 draws reach the top tenth
    fake_server.bodies.clear()
    result = invoke(*args, "--endpoint", "chat", "--tokenizer", str(smollm2_dir), "--num-prompts", "2")
    assert result.exit_code == 0, result.output
    sent = [b["messages"][0]["content"] for b in fake_server.bodies]
    assert sorted(sent) == sorted(tokenizer.decode(p) for p in load_ids("random-16x2", len(tokenizer), 2))


def load_ids(workload: str, vocab_size: int, n: int) -> list[list[int]]:
    from infer.bench.workloads import load_workload

    return load_workload(workload, vocab_size, n, None, seed=0).prompts


def test_a_priority_mix_sends_priorities_and_reports_ttft_by_priority(fake_server, tmp_path):
    out = tmp_path / "serve.json"
    args = ["--base-url", fake_server.url, "--workload", "random-8x4", "--vocab-size", "100", "--num-prompts", "40"]
    before = len(fake_server.bodies)  # the server may have served other tests
    result = invoke(*args, "--priority-mix", "0:1,3:3", "--seed", "5", "--json", str(out))
    assert result.exit_code == 0, result.output
    sent = [b["priority"] for b in fake_server.bodies[before:]]
    assert set(sent) == {0, 3} and 4 <= sent.count(0) <= 18  # about a quarter at priority 0
    run = json.loads(out.read_text())["runs"][0]
    assert run["by_priority"]["0"]["completed"] == sent.count(0) and run["by_priority"]["3"]["completed"] == sent.count(
        3
    )
    assert [r["index"] for r in run["requests"]] == list(range(40))
    assert "TTFT by priority" in result.output and json.loads(out.read_text())["settings"]["priority_mix"] == [
        [0, 1.0],
        [3, 3.0],
    ]
    assert invoke(*args, "--priority-mix", "0:1,3:3", "--seed", "5").exit_code == 0
    # seeded: the same priorities again (the server sees concurrent requests in any order)
    assert sorted(b["priority"] for b in fake_server.bodies[before + 40 :]) == sorted(sent)


def test_priorities_are_drawn_per_request_and_seeded():
    from infer.bench.online import OnlineRequest
    from infer.bench.online_sweep import with_priorities

    requests = [OnlineRequest([i], 4) for i in range(200)]
    first, again = (
        with_priorities(requests, ((0, 1.0), (3, 3.0)), 5),
        with_priorities(requests, ((0, 1.0), (3, 3.0)), 5),
    )
    assert [r.priority for r in first] == [r.priority for r in again] and [r.prompt for r in first] == [
        r.prompt for r in requests
    ]
    assert 30 <= [r.priority for r in first].count(0) <= 70  # a quarter of 200, loosely
    assert [r.priority for r in with_priorities(requests, (), 5)] == [None] * 200


def test_without_a_mix_no_priority_is_sent(fake_server):
    before = len(fake_server.bodies)
    result = invoke(
        "--base-url", fake_server.url, "--workload", "random-8x4", "--vocab-size", "100", "--num-prompts", "3"
    )
    assert result.exit_code == 0, result.output
    assert all("priority" not in b for b in fake_server.bodies[before:]) and "TTFT by priority" not in result.output
