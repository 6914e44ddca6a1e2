"""Figures of one online run (vLLM's and the PagedAttention paper's): latency percentiles over the
requests that succeeded, throughput over the run's duration, goodput under an SLO; and their tables."""

from __future__ import annotations

import math
from collections import Counter
from typing import Any, Sequence

import numpy as np

from infer.api.errors import ConfigError
from infer.bench.online import LoadResult, RequestRecord

SLO_METRICS = ("ttft", "tpot", "e2e")  # --goodput NAME:MS, each a bound on the request's own figure
PERCENTILES = (50, 90, 99)


def parse_goodput(items: Sequence[str]) -> dict[str, float]:
    """`ttft:200 tpot:50` (milliseconds; also comma-separated) -> {"ttft": 200.0, "tpot": 50.0}."""
    slo: dict[str, float] = {}
    for item in (part for text in items for part in text.replace(",", " ").split()):
        name, sep, value = item.partition(":")
        try:
            ms = float(value)
        except ValueError:
            ms = math.nan
        if not sep or name not in SLO_METRICS or not ms > 0 or math.isinf(ms):
            raise ConfigError(
                f"--goodput {item!r} is not an SLO: write NAME:MS with NAME one of {', '.join(SLO_METRICS)} "
                f"and MS a positive number of milliseconds, e.g. --goodput ttft:200 tpot:50"
            )
        slo[name] = ms
    return slo


def meets(record: RequestRecord, slo: dict[str, float]) -> bool:
    """A request that succeeded within every given bound (milliseconds)."""
    figures = {"ttft": record.ttft_s, "tpot": record.tpot_s, "e2e": record.e2e_s}
    return record.error is None and all(figures[name] * 1e3 <= ms for name, ms in slo.items())


def stats(values: Sequence[float]) -> dict[str, float | None]:
    """mean and p50/p90/p99 (linear interpolation, numpy's default); None for no values."""
    if not values:
        return {"mean": None, **{f"p{q}": None for q in PERCENTILES}}
    array = np.asarray(values, dtype=np.float64)
    return {"mean": float(array.mean()), **{f"p{q}": float(np.percentile(array, q)) for q in PERCENTILES}}


LAG_WARN_MS = 10.0  # a client late by more than this at p99 is part of what it measures


def lag_warning(summary: dict[str, Any]) -> str | None:
    """A line when the client sent late (its event loop was busy), so its latencies include its own delay."""
    p99 = summary["send_lag_ms"]["p99"]
    if p99 is None or p99 <= LAG_WARN_MS:
        return None
    return (
        f"rate {summary['request_rate']}: the client sent requests late (p99 {p99:.1f} ms, mean "
        f"{summary['send_lag_ms']['mean']:.1f} ms after their arrival times): its event loop was busy, and its "
        f"latencies include that delay; lower the rate, or run the client on a machine of its own"
    )


def rate_text(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def summarize(result: LoadResult, slo: dict[str, float]) -> dict[str, Any]:
    """Every figure of one run, JSON-ready: times in milliseconds, throughputs per second of the run."""
    ok = [r for r in result.records if r.error is None]
    duration = max(result.duration_s, 1e-9)
    output_tokens = sum(r.output_tokens for r in ok)
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    errors = Counter(r.error for r in result.records if r.error is not None)
    return {
        "request_rate": rate_text(result.settings.request_rate),
        "max_concurrency": result.settings.max_concurrency,
        "num_requests": len(result.records),
        "completed": len(ok),
        "failed": len(result.records) - len(ok),
        "errors": dict(errors.most_common()),  # message -> count
        "duration_s": result.duration_s,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "request_throughput": len(ok) / duration,  # requests/s
        "output_throughput": output_tokens / duration,  # output tokens/s
        "total_token_throughput": (prompt_tokens + output_tokens) / duration,
        "slo_ms": dict(slo),
        "goodput": sum(meets(r, slo) for r in ok) / duration if slo else None,  # requests within the SLO per s
        "ttft_ms": stats([r.ttft_s * 1e3 for r in ok]),
        "tpot_ms": stats([r.tpot_s * 1e3 for r in ok if r.output_tokens > 1]),
        "itl_ms": stats([gap * 1e3 for r in ok for gap in r.itl_s]),
        "e2e_ms": stats([r.e2e_s * 1e3 for r in ok]),
        # the paper's normalized latency: a request's end-to-end latency / its output tokens
        "normalized_latency_ms": stats([r.e2e_s * 1e3 / r.output_tokens for r in ok if r.output_tokens]),
        # how late the client sent requests after their arrival times: its own delay (a busy event loop),
        # which its timings of the server's answers carry too
        "send_lag_ms": stats([r.lag_s * 1e3 for r in result.records]),
        "by_priority": by_priority(ok),
    }


def by_priority(ok: Sequence[RequestRecord]) -> dict[str, Any] | None:
    """Per priority sent (--priority-mix): how many, TTFT percentiles and the longest TTFT (the longest a
    request of it waited for its first token); None when no request carried one."""
    levels = sorted({r.priority for r in ok if r.priority is not None})
    if not levels:
        return None
    figures = {}
    for level in levels:
        ttft = [r.ttft_s * 1e3 for r in ok if r.priority == level]
        lag = [r.lag_s * 1e3 for r in ok if r.priority == level]
        figures[str(level)] = {
            "completed": len(ttft),
            "ttft_ms": stats(ttft),
            "max_ttft_ms": max(ttft),
            "send_lag_ms": stats(lag),
        }
    return figures


def priority_table(summary: dict[str, Any]) -> str | None:
    """TTFT by priority, lower first; None without priorities."""
    levels = summary.get("by_priority")
    if not levels:
        return None
    keys = ["mean", *(f"p{q}" for q in PERCENTILES)]
    rows = [
        [level, str(f["completed"]), *(_ms(f["ttft_ms"][k]) for k in keys), _ms(f["max_ttft_ms"])]
        for level, f in levels.items()
    ]
    return _columns(["priority", "requests", *(f"TTFT {k} ms" for k in keys), "TTFT max ms"], rows)


def request_figures(record: RequestRecord) -> dict[str, Any]:
    """One request's figures for the JSON record."""
    return {
        "index": record.index,
        "start_s": record.start_s,
        "prompt_tokens": record.prompt_tokens,
        "output_tokens": record.output_tokens,
        "ttft_ms": record.ttft_s * 1e3,
        "tpot_ms": record.tpot_s * 1e3,
        "e2e_ms": record.e2e_s * 1e3,
        "itl_ms": [gap * 1e3 for gap in record.itl_s],
        "send_lag_ms": record.lag_s * 1e3,
        "priority": record.priority,
        "error": record.error,
    }


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _columns(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(headers)]

    def line(cells: list[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    return "\n".join([line(headers), line(["-" * w for w in widths]), *(line(r) for r in rows)])


def sweep_table(summaries: list[dict[str, Any]]) -> str:
    """One row per request rate."""
    headers = [
        "rate req/s",
        "done/failed",
        "served req/s",
        "out tok/s",
        "TTFT p50/p99 ms",
        "TPOT p50/p99 ms",
        "ITL p50/p99 ms",
        "E2E p50/p99 ms",
        "norm lat ms/tok",
        "goodput req/s",
    ]
    rows = [
        [
            s["request_rate"],
            f"{s['completed']}/{s['failed']}",
            f"{s['request_throughput']:.2f}",
            f"{s['output_throughput']:.1f}",
            *(f"{_ms(s[k]['p50'])}/{_ms(s[k]['p99'])}" for k in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")),
            _ms(s["normalized_latency_ms"]["mean"]),
            "-" if s["goodput"] is None else f"{s['goodput']:.2f}",
        ]
        for s in summaries
    ]
    return _columns(headers, rows)


def detail_table(summary: dict[str, Any]) -> str:
    """One run's latencies: mean and percentiles of each."""
    names = {
        "ttft_ms": "TTFT ms",
        "tpot_ms": "TPOT ms",
        "itl_ms": "ITL ms",
        "e2e_ms": "E2E ms",
        "normalized_latency_ms": "normalized ms/tok",
    }
    keys = ["mean", *(f"p{q}" for q in PERCENTILES)]
    return _columns(["latency", *keys], [[label, *(_ms(summary[k][q]) for q in keys)] for k, label in names.items()])
