"""Priority under overload on a live server: high priority's time to first token alone, then in a mix that
overloads the server, then the same arrivals without priorities (FIFO). A fresh `infer serve` per run, so
that no run inherits another's cache or queue (docs/performance.md, "Priority under overload").

    python -m benchmarks.lab.priority --model llama3-8b --load-format dummy --max-num-seqs 16 --clients 4 --out prio.json

First the server's capacity: --probe requests all at once, completed requests per second. Then: priority 0
alone at --alone-fraction of it (the unloaded TTFT), --requests at --overload x capacity drawn with
--mix (e.g. 0:1,1:9), and the same arrivals with every request at priority 0. Each run is `infer bench
serve --workload W --seed S --json`; the figures come from its JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from infer.bench.online_metrics import stats


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, args: argparse.Namespace, log: Path) -> None:
        self.port = free_port()
        self.log = log
        command = [
            sys.executable, "-m", "infer.cli.main", "--log-json", "--log-level", "debug", "serve", "--model", args.model, "--load-format", args.load_format,
            "--max-num-seqs", str(args.max_num_seqs), "--priority-aging-s", str(args.aging), "--port", str(self.port),
            *(["--tokenizer", args.tokenizer] if args.tokenizer else []), "--disable-log-requests",
            "--api-server-count", str(args.api_server_count),
        ]  # fmt: skip
        with log.open("w") as sink:  # a file, not a pipe: a pipe nobody reads would stall the server
            self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=sink, text=True)
        self.root = f"http://127.0.0.1:{self.port}"
        started = time.monotonic()
        deadline = started + 600
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server ended: {self.log.read_text()[-2000:]}")
            try:
                if httpx.get(f"{self.root}/health", timeout=5).status_code == 200:
                    self.ready_s = time.monotonic() - started
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("the server did not come up in 600 s")
            time.sleep(0.5)

    def stop(self) -> None:
        self.process.send_signal(signal.SIGINT)
        try:
            self.process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.process.kill()


SERVER_FIGURES = ("engine_queue_ms", "engine_ttft_ms", "server_first_output_ms")


def server_side(log: Path) -> dict[str, dict[str, Any]]:
    """Per priority, the server's `request finished` figures of a run: mean, p50, p99 and max of each."""
    import numpy as np

    by_level: dict[str, dict[str, list[float]]] = {}
    for line in log.read_text().splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if not isinstance(event, dict) or event.get("event") != "request finished":
            continue
        figures = by_level.setdefault(str(event["priority"]), {k: [] for k in SERVER_FIGURES})
        for key in SERVER_FIGURES:
            if event.get(key) is not None:
                figures[key].append(float(event[key]))
    summary: dict[str, dict[str, Any]] = {}
    for level, figures in sorted(by_level.items()):
        summary[level] = {
            key: {
                "mean": float(np.mean(v)),
                "p50": float(np.percentile(v, 50)),
                "p99": float(np.percentile(v, 99)),
                "max": float(np.max(v)),
                "count": len(v),
            }  # fmt: skip
            for key, v in figures.items()
            if v
        }
    return summary


def breakdown(result: dict[str, Any], server: dict[str, dict[str, Any]]) -> str:
    """Per priority: the client's TTFT and send lag beside the server's figures, p50 / p99 ms."""
    run = result["runs"][0]
    client = run.get("by_priority") or {"0": {"ttft_ms": run["ttft_ms"], "send_lag_ms": run["send_lag_ms"]}}
    lines = [
        "priority | client TTFT | client send lag | server first output | engine TTFT | engine queue  (p50 / p99 ms)"
    ]
    for level in sorted(set(client) | set(server)):
        c, s = client.get(level, {}), server.get(level, {})

        def pair(d: dict[str, Any] | None) -> str:
            return "-" if not d or d.get("p99") is None else f"{d['p50']:.1f} / {d['p99']:.1f}"

        cells = [pair(c.get("ttft_ms")), pair(c.get("send_lag_ms"))]
        cells += [pair(s.get(k)) for k in ("server_first_output_ms", "engine_ttft_ms", "engine_queue_ms")]
        lines.append(f"{level} | " + " | ".join(cells))
    return "\n".join(lines)


def merged(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The clients' runs as one (`infer bench serve --json`'s figures that this lab reads): their requests
    pooled, the served rate over the longest client's duration."""
    records = [r for result in results for r in result["runs"][0]["requests"]]
    ok = [r for r in records if r["error"] is None]
    duration = max(result["runs"][0]["duration_s"] for result in results)
    levels = sorted({r["priority"] for r in ok if r["priority"] is not None})
    by_priority = {
        str(level): {
            "completed": len(mine := [r for r in ok if r["priority"] == level]),
            "ttft_ms": stats([r["ttft_ms"] for r in mine]),
            "max_ttft_ms": max(r["ttft_ms"] for r in mine),
            "send_lag_ms": stats([r["send_lag_ms"] for r in mine]),
        }
        for level in levels
    }
    summary = {
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "ttft_ms": stats([r["ttft_ms"] for r in ok]),
        "send_lag_ms": stats([r["send_lag_ms"] for r in records]),
        "by_priority": by_priority or None,
    }
    return {"runs": [summary], "clients": [result["runs"][0] | {"requests": None} for result in results]}


def bench(args: argparse.Namespace, label: str, rate: float, num: int, mix: str | None) -> dict[str, Any]:
    """One fresh server; `--clients` `infer bench serve` processes at rate / clients each (independent
    Poisson arrivals sum to one at `rate`), so that no client's own event loop sets the latencies."""
    clients = max(1, min(args.clients, num))
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "server.log"
        server = Server(args, log)
        try:
            runs = []
            for i in range(clients):
                out = Path(tmp) / f"run{i}.json"
                share = num // clients + (i < num % clients)
                command = [
                    sys.executable, "-m", "infer.cli.main", "bench", "serve", "--base-url", server.root,
                    "--workload", args.workload, "--seed", str(args.seed + i), "--num-prompts", str(share),
                    "--request-rate", str(rate / clients), "--json", str(out),
                    *(["--priority-mix", mix] if mix else []),
                    *(["--tokenizer", args.tokenizer] if args.tokenizer else []),
                ]  # fmt: skip
                process = subprocess.Popen(
                    command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=os.environ.copy()
                )
                runs.append((process, out))
            outputs = [(process.communicate(), process.returncode, out) for process, out in runs]
            for (_, err), code, _ in outputs:
                if code != 0:
                    raise RuntimeError(f"{label}: infer bench serve failed: {err[-2000:]}")
            results = [json.loads(out.read_text()) for _, _, out in outputs]
        finally:
            server.stop()
        server_figures = server_side(log)
    result = merged(results)
    run = result["runs"][0]
    print(
        f"{label}: server ready in {server.ready_s:.1f} s; rate {rate:.2f}/s x {num} from {clients} clients: "
        f"{run['completed']} done, {run['failed']} failed, {run['request_throughput']:.1f} served/s",
        flush=True,
    )
    print(breakdown(result, server_figures), flush=True)
    return {
        "label": label, "rate": rate, "requests": num, "mix": mix, "ready_s": server.ready_s, "result": result,
        "server": server_figures,
    }  # fmt: skip


def capacity(result: dict[str, Any]) -> float:
    """Completed requests per second of a run (`infer bench serve --json`)."""
    return float(result["runs"][0]["request_throughput"])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--load-format", default="dummy")
    ap.add_argument("--tokenizer", default=None)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--aging", type=float, default=60.0, help="--priority-aging-s")
    ap.add_argument("--workload", default="random-32x8")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--probe", type=int, default=400, help="requests all at once for the capacity")
    ap.add_argument("--requests", type=int, default=2000, help="requests of the overloaded runs")
    ap.add_argument("--overload", type=float, default=1.6, help="the mix's rate over the capacity")
    ap.add_argument("--alone-fraction", type=float, default=0.05, help="priority 0 alone: this x the capacity")
    ap.add_argument("--mix", default="0:1,1:9")
    ap.add_argument("--capacity", type=float, default=None, help="requests/s the server sustains: skips the probe")
    ap.add_argument("--clients", type=int, default=4, help="load-generating processes, the rate split among them")
    ap.add_argument("--api-server-count", type=int, default=1, help="the server's API server processes")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    probe = None if args.capacity else bench(args, "capacity", float("inf"), args.probe, None)
    cap = args.capacity or capacity(probe["result"])
    runs = [
        *([probe] if probe else []),
        bench(args, "priority 0 alone", cap * args.alone_fraction, max(20, args.requests // 50), "0:1"),
        bench(args, "mix", cap * args.overload, args.requests, args.mix),
        bench(args, "fifo", cap * args.overload, args.requests, None),
    ]
    if args.out is not None:
        args.out.write_text(
            json.dumps({"capacity_rps": cap, "args": vars(args) | {"out": str(args.out)}, "runs": runs})
        )


if __name__ == "__main__":
    main()
