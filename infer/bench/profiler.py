"""`--profile`: where a decode step's time goes, per component, installed on a built engine.

Installed only when asked for (nothing is wrapped otherwise): forward hooks on the embedding,
every decoder layer and the final norm, a timed proxy around each layer's attention backend, the
LM head, the sampler, the scheduler and the output processor (detokenizer), and `Engine.step_outputs` (every step).
On CUDA the model and sampler are timed with device events (CUDA graphs and decode pipelining are
turned off: hooks cannot see inside a graph, and a pipelined forward runs in the step before its
own); on the CPU with perf_counter. Only decode steps (every scheduled request computes one token)
are recorded.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from infer.api import RotaryFusingAttention
from infer.api.errors import ConfigError
from infer.runtime.runner import ModelRunner

DEVICE_KEYS = ("embedding", "attention", "rest", "final norm + LM head", "sampler")


class _Proxy:
    """Delegates everything to `inner`, timing the methods named in `timed` (method -> key)."""

    def __init__(self, inner: Any, timed: dict[str, str], profiler: "StepProfiler") -> None:
        self._inner = inner
        for method, key in timed.items():
            setattr(self, method, profiler.timed(getattr(inner, method), key))  # the methods named in `timed`

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)  # a proxy: every other attribute is the wrapped object's


@dataclass(slots=True)
class StepProfiler:
    device: torch.device
    num_layers: int
    notes: list[str] = field(default_factory=list)
    steps: list[dict[str, float]] = field(default_factory=list)  # decode step -> component -> seconds
    num_other_steps: int = 0  # prefill or mixed steps, not recorded (nor are steps that schedule nothing)
    _host: dict[str, float] = field(default_factory=dict)
    _events: list[tuple[str, Any, Any]] = field(default_factory=list)  # (key, start, end) this step
    _open: dict[str, Any] = field(default_factory=dict)
    _kind: str = "empty"  # this step: "decode", "other" (prefill or mixed) or "empty"

    @property
    def uses_events(self) -> bool:
        return self.device.type == "cuda"

    @property
    def timer(self) -> str:
        return "CUDA events (device time)" if self.uses_events else "perf_counter on the CPU"

    # ------------------------------------------------------------------ timing primitives

    def _on_device(self, key: str) -> bool:
        return self.uses_events and key.split("|")[0] in DEVICE_KEYS

    def _start(self, key: str) -> None:
        if self._on_device(key):
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._open[key] = event
        else:
            self._open[key] = time.perf_counter()

    def _stop(self, key: str) -> None:
        start = self._open.pop(key)
        if self._on_device(key):
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._events.append((key, start, end))
        else:
            self._host[key] = self._host.get(key, 0.0) + time.perf_counter() - start

    def timed(self, fn: Callable[..., Any], key: str) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            self._start(key)
            try:
                return fn(*args, **kwargs)
            finally:
                self._stop(key)

        return wrapper

    def _hook(self, module: torch.nn.Module, key: str) -> None:
        module.register_forward_pre_hook(lambda *_: self._start(key))
        module.register_forward_hook(lambda *_: self._stop(key))

    # ------------------------------------------------------------------ installation

    @classmethod
    def install(cls, engine: Any) -> "StepProfiler":
        # the target's runner: the one every decoder is given (DecoderContext.runner)
        runner = engine.parts.runners[0] if engine.parts.runners else None
        if not isinstance(runner, ModelRunner):
            raise ConfigError(
                f"--profile needs the target model's ModelRunner; this engine's decoder "
                f"{type(engine.decoder).__name__} has none: profile with --decoding autoregressive"
            )
        model: Any = runner.model  # a CausalLM that is a torch module: hooked, and its compute_logits wrapped
        layers = list(getattr(model, "layers", []))[: runner.num_layers or None]  # a model's optional layer list
        profiler = cls(runner.device, len(layers))
        graphs, pipeline = runner.graphs, runner.pipeline
        runner.set_decode_paths(None, None)
        if graphs is not None:
            profiler.notes.append("CUDA graphs off while profiling (hooks cannot see inside a graph)")
        if pipeline is not None:  # a step's forward would be timed inside the step before it
            profiler.notes.append(
                "decode pipelining off while profiling (each step's forward is timed in its own step)"
            )
        embedding = getattr(model, "embed_tokens", None) or next(  # a model's optional submodule, else its first
            m for m in model.modules() if isinstance(m, torch.nn.Embedding)
        )
        profiler._hook(embedding, "embedding")
        for i, layer in enumerate(layers):
            profiler._hook(layer, f"rest|{i}")
            for module in layer.modules():
                backend = module.__dict__.get("attention")
                # any object a module keeps as `attention`: an attention backend is the one with a forward
                if backend is not None and callable(getattr(backend, "forward", None)):
                    timed = {"forward": f"attention|{i}"}
                    if isinstance(backend, RotaryFusingAttention):
                        timed["forward_with_rotary"] = f"attention|{i}"
                    module.attention = _Proxy(backend, timed, profiler)
        if isinstance(getattr(model, "norm", None), torch.nn.Module):  # a model's optional final norm
            profiler._hook(model.norm, "final norm + LM head")
        model.compute_logits = profiler.timed(model.compute_logits, "final norm + LM head")
        runner.sampler = _Proxy(runner.sampler, {"sample": "sampler"}, profiler)
        engine.scheduler = _Proxy(engine.scheduler, {"update": "scheduler"}, profiler)
        engine.scheduler.schedule = profiler._schedule(engine.scheduler._inner.schedule)
        engine.output = _Proxy(engine.output, {"submit": "detokenizer", "collect": "detokenizer"}, profiler)
        engine.step_outputs = profiler._step(engine.step_outputs)  # every step passes through it
        return profiler

    def _schedule(self, schedule: Callable[[], Any]) -> Callable[[], Any]:
        timed = self.timed(schedule, "scheduler")

        def wrapper() -> Any:
            out = timed()
            decode = all(s.num_new_tokens == 1 for s in out.scheduled)
            self._kind = "empty" if not out.scheduled else "decode" if decode else "other"
            return out

        return wrapper

    def _step(self, step: Callable[[], Any]) -> Callable[[], Any]:
        def wrapper() -> Any:
            self._host.clear()
            self._events.clear()
            if self.uses_events:
                torch.cuda.synchronize(self.device)
            started = time.perf_counter()
            outputs = step()
            if self.uses_events:
                torch.cuda.synchronize(self.device)
            wall = time.perf_counter() - started
            if self._kind == "decode":
                self.steps.append(self._collect(wall))
            elif self._kind == "other":
                self.num_other_steps += 1
            return outputs

        return wrapper

    def _collect(self, wall: float) -> dict[str, float]:
        times = dict(self._host)
        for key, start, end in self._events:
            times[key] = times.get(key, 0.0) + start.elapsed_time(end) / 1e3
        record = {"step": wall}
        for key, value in times.items():
            record[key] = record.get(key, 0.0) + value
        for i in range(self.num_layers):  # a layer's hook spans its attention too
            record[f"rest|{i}"] = record.get(f"rest|{i}", 0.0) - record.get(f"attention|{i}", 0.0)
        return record

    # ------------------------------------------------------------------ report

    def summary(self) -> dict[str, Any]:
        """Mean seconds per decode step by component (`rows`), the step, and the device's idle share."""
        n = max(len(self.steps), 1)

        def mean(key: str) -> float:
            return sum(s.get(key, 0.0) for s in self.steps) / n

        rows = [("embedding", mean("embedding"))]
        for i in range(self.num_layers):
            rows += [(f"layer {i} attention", mean(f"attention|{i}")), (f"layer {i} rest", mean(f"rest|{i}"))]
        rows += [(k, mean(k)) for k in ("final norm + LM head", "sampler", "detokenizer", "scheduler")]
        step = mean("step")
        rows.append(("other host work", max(0.0, step - sum(t for _, t in rows))))
        busy = sum(t for name, t in rows if name.split(" ")[0] in ("embedding", "layer", "final", "sampler"))
        return {
            "timer": self.timer,
            "decode_steps": len(self.steps),
            "other_steps": self.num_other_steps,
            "notes": list(self.notes),
            "step_s": step,
            "rows": rows,
            "attention_s": sum(t for name, t in rows if name.endswith(" attention")),
            "layer_rest_s": sum(t for name, t in rows if name.endswith(" rest")),
            "device_busy_s": busy,
            "device_idle_share": max(0.0, 1.0 - busy / step) if step else 0.0,
        }


def format_profile(summary: dict[str, Any]) -> str:
    step = summary["step_s"] or 1.0
    idle_meaning = (
        "time between device work: host only"
        if "CUDA" in summary["timer"]
        else "the CPU is the device: time outside the model forward and the sampler"
    )
    lines = [
        f"profile: {summary['decode_steps']} decode steps (prefill and mixed steps left out: {summary['other_steps']}), "
        f"timed with {summary['timer']}" + "".join(f"; {n}" for n in summary["notes"]),
        f"{'component':<28}{'ms/step':>10}{'share':>9}",
    ]
    rows = list(summary["rows"])
    rows[1:1] = [("layers: attention (all)", summary["attention_s"]), ("layers: rest (all)", summary["layer_rest_s"])]
    for name, seconds in rows:
        lines.append(f"{name:<28}{seconds * 1e3:>10.3f}{seconds / step:>9.1%}")
    lines.append(f"{'decode step (wall)':<28}{summary['step_s'] * 1e3:>10.3f}{1:>9.1%}")
    lines.append(f"{'device idle':<28}{'':>10}{summary['device_idle_share']:>9.1%}  ({idle_meaning})")
    return "\n".join(lines)
