"""PNG charts for `infer bench --chart`, `infer bench serve --png` and `infer run --profile-chart`, drawn with matplotlib
when it is installed (`pip install 'infer[bench]'`); each function returns None when it wrote the
file, else one line saying why not."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

MISSING = "matplotlib is not installed (pip install 'infer[bench]'): no chart written"
PALETTE = {"infer": "#3b6fb6", "baseline": "#9a9a9a", "reference": "#1f3d73"}
COMPONENT_COLOURS = {
    "embedding": "#8c6bb1",
    "attention": "#3b6fb6",
    "layer rest": "#7fb3e0",
    "final norm + LM head": "#41ab5d",
    "sampler": "#f0a830",
    "detokenizer": "#e6550d",
    "scheduler": "#b8452a",
    "other host work": "#bdbdbd",
}


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def bench_chart(rows: list[dict[str, Any]], path: Path, title: str, reference: str) -> str | None:
    """Horizontal bars of output tokens/s per run, annotated with the speedup against `reference`."""
    plt = _pyplot()
    if plt is None:
        return MISSING
    rows = list(reversed(rows))  # first run on top
    height = max(2.5, 0.55 * len(rows) + 1.6)
    fig, ax = plt.subplots(figsize=(11, height), dpi=120)
    values = [r["output_tokens_per_s"] for r in rows]
    colours = [PALETTE["reference"] if r["label"] == reference else PALETTE[r["kind"]] for r in rows]
    bars = ax.barh([r["label"] for r in rows], values, color=colours)
    top = max(values, default=1.0) or 1.0
    for bar, r in zip(bars, rows):
        text = f"{r['output_tokens_per_s']:.1f} tok/s"
        if r.get("speedup") is not None:
            text += f"  ({r['speedup']:.2f}x)"
        ax.text(bar.get_width() + top * 0.01, bar.get_y() + bar.get_height() / 2, text, va="center", fontsize=9)
    ax.set_xlim(0, top * 1.32)
    ax.set_xlabel(f"output tokens/s (higher is better); in brackets: speedup against {reference}")
    ax.set_title(title, fontsize=10)
    ax.grid(axis="x", alpha=0.3)
    ax.set_axisbelow(True)
    names = {"infer": "infer", "baseline": "HF baseline", "reference": "speedup reference"}
    shown = [k for k in names if k == "reference" or any(r["kind"] == k and r["label"] != reference for r in rows)]
    handles = [plt.Rectangle((0, 0), 1, 1, color=PALETTE[k]) for k in shown]
    ax.legend(
        handles, [names[k] for k in shown], loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False
    )
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return None


def profile_chart(summary: dict[str, Any], path: Path, title: str) -> str | None:
    """Top: one mean decode step as a stacked bar of components. Bottom: every layer, attention vs rest."""
    plt = _pyplot()
    if plt is None:
        return MISSING
    rows = dict(summary["rows"])
    parts = [
        ("embedding", rows.get("embedding", 0.0)),
        ("attention", summary["attention_s"]),
        ("layer rest", summary["layer_rest_s"]),
        *(
            (k, rows.get(k, 0.0))
            for k in ("final norm + LM head", "sampler", "detokenizer", "scheduler", "other host work")
        ),
    ]
    step_ms = summary["step_s"] * 1e3
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 6.5), dpi=120, gridspec_kw={"height_ratios": [1, 2]})
    left = 0.0
    for name, seconds in parts:
        ms = seconds * 1e3
        top.barh([0], [ms], left=left, color=COMPONENT_COLOURS[name], label=f"{name} {ms:.2f} ms ({ms / step_ms:.0%})")
        if ms / step_ms > 0.06:
            top.text(left + ms / 2, 0, f"{ms / step_ms:.0%}", ha="center", va="center", fontsize=8, color="white")
        left += ms
    top.set_yticks([])
    top.set_xlim(0, max(step_ms, left) * 1.02)
    top.set_xlabel(
        f"ms per decode step (mean of {summary['decode_steps']}; step {step_ms:.2f} ms; "
        f"device idle {summary['device_idle_share']:.0%})"
    )
    top.legend(loc="upper center", bbox_to_anchor=(0.5, -0.55), ncol=4, fontsize=8, frameon=False)
    layers = [name.split(" ")[1] for name in rows if name.endswith(" attention") and name.startswith("layer ")]
    attention = [rows[f"layer {i} attention"] * 1e3 for i in layers]
    rest = [rows[f"layer {i} rest"] * 1e3 for i in layers]
    positions = range(len(layers))
    bottom.bar(positions, attention, color=COMPONENT_COLOURS["attention"], label="attention")
    bottom.bar(positions, rest, bottom=attention, color=COMPONENT_COLOURS["layer rest"], label="rest of the layer")
    bottom.set_xticks(list(positions))
    bottom.set_xticklabels(layers, fontsize=7)
    bottom.set_xlabel("decoder layer")
    bottom.set_ylabel("ms per decode step")
    bottom.legend(fontsize=8)
    bottom.grid(axis="y", alpha=0.3)
    bottom.set_axisbelow(True)
    fig.suptitle(f"{title}\ntimed with {summary['timer']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return None


def serve_sweep_chart(summaries: list[dict[str, Any]], path: Path, title: str) -> str | None:
    """The PagedAttention paper's figure: latency against request rate, one point per finite rate of a
    sweep; normalized latency (mean and p99), TTFT and TPOT (p50 and p99) side by side."""
    plt = _pyplot()
    if plt is None:
        return MISSING
    points = sorted((float(s["request_rate"]), s) for s in summaries if s["request_rate"] != "inf")
    if not points:
        return "no finite --request-rate in the sweep: no chart written (latency is drawn against the rate)"
    rates = [rate for rate, _ in points]
    panels = [
        ("normalized_latency_ms", "normalized latency (ms/token)", ("mean", "p99")),
        ("ttft_ms", "time to first token (ms)", ("p50", "p99")),
        ("tpot_ms", "time per output token (ms)", ("p50", "p99")),
    ]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4), dpi=120)
    for ax, (key, label, quantiles) in zip(axes, panels):
        for q, style in zip(quantiles, ("-o", "--s")):
            values = [s[key][q] for _, s in points]
            ax.plot(rates, [math.nan if v is None else v for v in values], style, color=PALETTE["infer"], label=q)
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(label)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    unbounded = len(points) < len(summaries)
    fig.suptitle(title + (" (rate inf has no place on the axis: see the table)" if unbounded else ""), fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return None
