"""The online load generator against a fake server with known delays: per-request timings, token
counts, failures kept and counted, Poisson arrivals, the concurrency bound, and the run's figures."""

from __future__ import annotations

import asyncio
import gc
import math
import time

import numpy as np
import pytest

from infer.api.errors import ConfigError
from infer.bench.online import (
    LoadResult,
    LoadSettings,
    OnlineRequest,
    RequestRecord,
    arrival_offsets,
    normalize_base_url,
    run_load,
)
from infer.bench.online_metrics import lag_warning, meets, parse_goodput, summarize

# No upper bound on a wall-clock time here: a busy machine wakes a sleeper late by any amount. What the
# server's sleeps guarantee are lower bounds; the rest are identities between the figures of one clock.


def load(fake, requests, **settings):
    return asyncio.run(run_load(requests, LoadSettings(fake.url, "fake-model", **settings)))


def token_requests(n: int, max_tokens: int) -> list[OnlineRequest]:
    return [OnlineRequest([11 + i, 12, 13], max_tokens, 3) for i in range(n)]


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_timings_match_the_servers_delays(fake_server, endpoint):
    fake_server.first_s, fake_server.gap_s = 0.06, 0.02
    requests = token_requests(4, 6) if endpoint == "completions" else [OnlineRequest("hi", 6) for _ in range(4)]
    gc.collect()  # a full collection of the test process's objects (torch's, ...) takes ~0.1 s: not in the timed run
    gc.disable()
    try:
        result = load(fake_server, requests, endpoint=endpoint)
    finally:
        gc.enable()
    for r in result.records:
        assert r.error is None and r.output_tokens == 6 and len(r.itl_s) == 5
        assert r.ttft_s >= 0.06 and r.e2e_s >= 0.06 + 5 * 0.02  # the server's sleeps: never shorter
        assert r.e2e_s >= r.ttft_s + sum(r.itl_s) - 1e-9  # the gaps run from the first token to the last
        assert r.tpot_s == pytest.approx((r.e2e_s - r.ttft_s) / 5) and min(r.itl_s) >= 0
        assert r.start_s + r.e2e_s <= result.duration_s + 1e-6  # every request within the run
    assert result.duration_s >= 0.16
    body = fake_server.bodies[0]
    assert body["stream"] and body["stream_options"] == {"include_usage": True}
    assert body["temperature"] == 0 and body["ignore_eos"] is True and body["model"] == "fake-model"
    if endpoint == "chat":
        assert body["messages"] == [{"role": "user", "content": "hi"}] and body["max_completion_tokens"] == 6
    else:
        assert body["prompt"] in ([11, 12, 13], [12, 12, 13], [13, 12, 13], [14, 12, 13]) and body["max_tokens"] == 6


def test_output_tokens_come_from_usage_else_from_the_chunks(fake_server):
    fake_server.tokens_per_chunk = 3  # 7 tokens in chunks of 3, 3, 1
    with_usage = load(fake_server, token_requests(2, 7)).records
    assert [(r.output_tokens, r.prompt_tokens, len(r.itl_s)) for r in with_usage] == [(7, 3, 2)] * 2
    fake_server.usage = False
    without = load(fake_server, token_requests(2, 7)).records
    assert [r.output_tokens for r in without] == [3, 3]  # no usage: chunks with text are all there is


def test_completions_chunks_without_text_still_count(fake_server):
    # a model served without a tokenizer streams one chunk a step whose text is empty
    fake_server.first_s, fake_server.gap_s, fake_server.text = 0.05, 0.02, ""
    fake_server.usage = False
    result = load(fake_server, token_requests(2, 6))
    for r in result.records:
        assert r.error is None and r.output_tokens == 6 and len(r.itl_s) == 5
        assert r.ttft_s >= 0.05 and r.e2e_s >= r.ttft_s + sum(r.itl_s) - 1e-9


def test_failed_requests_are_kept_and_counted(fake_server):
    fake_server.fail_every, fake_server.cut_every = 3, 4  # of 12: 4 answer 500; 4, 8 (not 12) are cut off
    fake_server.junk_every = 5  # 5 and 10 send an event that is not JSON
    result = load(fake_server, token_requests(12, 5), max_concurrency=1)
    failed = [r for r in result.records if r.error is not None]
    assert len(result.records) == 12 and len(failed) == 8
    assert sum(r.error == "HTTP 500: the engine failed" for r in failed) == 4
    assert sum(r.error.startswith("RemoteProtocolError") for r in failed) == 2
    assert sum(r.error.startswith("JSONDecodeError") for r in failed) == 2
    assert all(r.output_tokens == 5 for r in result.records if r.error is None)
    summary = summarize(result, {})
    assert (summary["completed"], summary["failed"], summary["output_tokens"]) == (4, 8, 20)
    assert summary["errors"]["HTTP 500: the engine failed"] == 4


def test_poisson_arrivals_are_seeded_with_the_rates_mean_gap():
    offsets = arrival_offsets(20_000, 8.0, seed=3)
    gaps = np.diff(offsets)
    assert offsets[0] == 0.0 and gaps.min() > 0
    assert gaps.mean() == pytest.approx(1 / 8.0, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)  # exponential: the std is the mean
    assert arrival_offsets(500, 8.0, seed=3) == offsets[:500]
    assert arrival_offsets(500, 8.0, seed=4) != offsets[:500]
    assert arrival_offsets(5, math.inf, seed=3) == [0.0] * 5


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
def test_requests_are_sent_on_their_arrival_schedule(fake_server):
    result = load(fake_server, token_requests(10, 2), request_rate=25.0, seed=5)
    offsets = arrival_offsets(10, 25.0, seed=5)
    starts = [record.start_s for record in result.records]
    assert all(start >= offset for start, offset in zip(starts, offsets))  # none before its arrival
    assert starts == sorted(starts) and result.duration_s >= offsets[-1]  # in the schedule's order


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
def test_a_busy_client_reports_how_late_it_sent(fake_server):
    # the first answer's callback holds the event loop for 0.3 s: the requests due meanwhile go out late
    # by at least the rest of that hold, and the run says its figures carry the client's own delay
    fake_server.first_s, fake_server.gap_s = 0.0, 0.0
    held: list[float] = []

    def hold(record):
        if not held:
            held.append(record.start_s + record.e2e_s)  # when the hold began, seconds after t0
            time.sleep(0.3)

    offsets = arrival_offsets(30, 100.0, seed=2)
    result = asyncio.run(
        run_load(token_requests(30, 1), LoadSettings(fake_server.url, "fake-model", request_rate=100.0, seed=2), hold)
    )
    assert all(r.error is None and r.lag_s >= 0 for r in result.records)
    start, end = held[0], held[0] + 0.3
    due_in_hold = [r for r, due in zip(result.records, offsets) if start < due < end - 0.05]
    assert due_in_hold and all(r.lag_s >= end - offsets[r.index] - 0.01 for r in due_in_hold)
    summary = summarize(result, {})
    assert summary["send_lag_ms"]["p99"] >= 50.0
    assert "the client sent requests late" in lag_warning(summary)
    synthetic_run = summarize(LoadResult(LoadSettings("u", "m"), [synthetic(0.1, 0.2, 2)], 1.0), {})
    assert synthetic_run["send_lag_ms"]["p99"] == 0.0 and lag_warning(synthetic_run) is None


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
@pytest.mark.parametrize("bound, peak", [(3, 3), (None, 12)])
def test_max_concurrency_bounds_the_streams_in_flight(fake_server, bound, peak):
    fake_server.first_s, fake_server.gap_s = 0.02, 0.01
    result = load(fake_server, token_requests(12, 4), max_concurrency=bound)
    assert fake_server.peak == peak and all(r.error is None for r in result.records)


def synthetic(ttft_s: float, e2e_s: float, output_tokens: int, error: str | None = None) -> RequestRecord:
    return RequestRecord(0, 0.0, 4, output_tokens, ttft_s, e2e_s, [], error)


def test_goodput_counts_requests_within_every_slo_per_second():
    records = [
        synthetic(0.1, 1.0, 11),  # tpot 90 ms
        synthetic(0.3, 1.0, 11),  # ttft over 200 ms
        synthetic(0.1, 2.1, 11),  # tpot 200 ms
        synthetic(0.15, 0.65, 11),  # tpot 50 ms
        synthetic(0.1, 0.5, 11, error="HTTP 500"),  # failed: never good
    ]
    slo = parse_goodput(["ttft:200", "tpot:100"])
    assert slo == {"ttft": 200.0, "tpot": 100.0}
    assert [meets(r, slo) for r in records] == [True, False, False, True, False]
    summary = summarize(LoadResult(LoadSettings("u", "m", request_rate=2.0), records, 4.0), slo)
    assert summary["goodput"] == pytest.approx(2 / 4.0) and summary["request_throughput"] == pytest.approx(4 / 4.0)
    assert summary["output_throughput"] == pytest.approx(44 / 4.0) and summary["request_rate"] == "2"
    assert parse_goodput(["e2e:1500,ttft:200"]) == {"e2e": 1500.0, "ttft": 200.0}
    assert summarize(LoadResult(LoadSettings("u", "m"), records, 4.0), {})["goodput"] is None


def test_percentiles_and_normalized_latency():
    records = [synthetic(0.01 * i, 0.1 * i, i) for i in range(1, 101)]
    summary = summarize(LoadResult(LoadSettings("u", "m"), records, 10.0), {})
    ttft = [10.0 * i for i in range(1, 101)]
    assert summary["ttft_ms"] == pytest.approx(
        {"mean": np.mean(ttft), "p50": np.percentile(ttft, 50), "p90": np.percentile(ttft, 90), "p99": 990.1}
    )
    assert summary["normalized_latency_ms"]["mean"] == pytest.approx(100.0)  # each: 0.1 s * i / i tokens
    tpot = [(0.1 * i - 0.01 * i) * 1e3 / (i - 1) for i in range(2, 101)]  # one-token answers have no TPOT
    assert summary["tpot_ms"]["p50"] == pytest.approx(np.percentile(tpot, 50))
    assert summary["itl_ms"] == {"mean": None, "p50": None, "p90": None, "p99": None}


@pytest.mark.parametrize("bad", ["ttft", "ttft:", "ttft:-1", "ttft:abc", "latency:100", "ttft:inf"])
def test_a_bad_slo_names_the_fix(bad):
    with pytest.raises(ConfigError, match="write NAME:MS with NAME one of ttft, tpot, e2e"):
        parse_goodput([bad])


def test_base_url_is_the_servers_root():
    assert normalize_base_url("http://h:8000/v1/") == "http://h:8000"
    assert normalize_base_url(" http://h:8000/ ") == "http://h:8000"
