"""`lora`: PEFT LoRA adapters (`adapter_config.json` + `adapter_model.safetensors`), many at once.

An adapter's module `m` adds s * B_m A_m x to m's output, s = lora_alpha / r (rsLoRA: / sqrt(r)), with
`rank_pattern` and `alpha_pattern` overriding r and alpha per module as PEFT matches them. A target
that fuses several HF projections (Llama's qkv_proj: q, k, v) holds one LoRA of rank pieces x
max_rank: the pieces' A stacked, their B block-diagonal (a piece the adapter leaves out is zeros), so
one shrink and one expand serve the fused projection. A checkpoint that fuses them itself (Phi-3's
qkv_proj) shares one A between the pieces (`AdapterTarget.aliases`).

Under tensor parallelism each rank reads its part: a column-split target the B rows of its slice of
each piece, a row-split one the A columns of its input slice (its delta then a partial sum, summed
with the projection's). Device slots are stacked tensors per target, A [S, P*R, in] and B [S, out,
P*R], the scaling folded into B; on CUDA the Triton kernels of `infer.kernels.lora` apply them (BGMV
for forwards of a few rows, SGMV with the rows grouped by slot for the others: both CUDA-graph safe),
elsewhere their torch reference.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch

from infer.api.adapters import AdapterBatch, AdapterSpec, AdapterTarget
from infer.api.capabilities import Capabilities
from infer.api.errors import RequestError
from infer.api.hookspecs import hookimpl

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
# a forward of at most this many rows takes the per-token kernels (BGMV: batch 1's decode reads each
# adapter once either way); more rows, grouped by slot (SGMV: an adapter's tiles read once per 16 rows)
BGMV_MAX_TOKENS = 4
# PEFT's names for a module's LoRA weights: the base model's module path (as rank_pattern and alpha_pattern
# match it), then lora_A or lora_B
_WEIGHT = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.default)?\.weight$")
_LAYER = re.compile(r"(?:^|\.)layers\.(?P<layer>\d+)\.(?:.+\.)?(?P<name>[^.]+)$")


def _triton_ready(device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _max_tiles(tokens: int, num_slots: int) -> int:
    """SGMV's most tiles for `tokens` rows (0 where Triton is missing)."""
    try:
        from infer.kernels.lora import max_tiles
    except ImportError:
        return 0
    return max_tiles(tokens, num_slots)


def _shrink_parts(width: int) -> int:
    """The partial sums the kernels' shrink makes of an input `width` wide (0 where Triton is missing)."""
    try:
        from infer.kernels.lora import parts
    except ImportError:
        return 0
    return parts(width)


@dataclass(slots=True)
class HostLoRA:
    """An adapter read for this rank: per target module, per piece, (A [r, in_local], s * B [out_local, r])."""

    name: str
    path: str
    weights: dict[str, list[tuple[torch.Tensor, torch.Tensor] | None]]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for pieces in self.weights.values() for p in pieces if p for a, b in [p])


def _pattern_value(patterns: Mapping[str, Any], module: str, default: Any) -> Any:
    """PEFT's rank_pattern / alpha_pattern: the first key that matches the end of the base model's module
    path ("model.layers.0.self_attn.q_proj"), as PEFT matches them."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


class LoRAKind:
    """The `lora` adapter kind (`infer.api.AdapterKind`)."""

    capabilities = Capabilities(cuda_graph_safe=True, pipeline_safe=True)

    def __init__(self, spec: AdapterSpec) -> None:
        self.spec = spec
        self.targets = {t.module: t for t in spec.targets}
        self.by_piece: dict[tuple[int, str], tuple[AdapterTarget, tuple[int, ...]]] = {}
        for t in spec.targets:
            for i, piece in enumerate(t.pieces):
                self.by_piece[(t.layer, piece)] = (t, (i,))
            for alias, covered in t.aliases:
                self.by_piece[(t.layer, alias)] = (t, tuple(t.pieces.index(p) for p in covered))
        S, R = spec.max_adapters, spec.max_rank
        dev, dt = spec.device, spec.dtype
        self.a = {t.module: torch.zeros(S, len(t.pieces) * R, t.local_in, dtype=dt, device=dev) for t in spec.targets}
        self.b = {
            t.module: torch.zeros(S, sum(t.local_out), len(t.pieces) * R, dtype=dt, device=dev) for t in spec.targets
        }
        self.kernels = _triton_ready(spec.device)
        most = max((len(t.pieces) for t in spec.targets), default=1) * R
        widest = max((t.local_in for t in spec.targets), default=1)
        # the kernels' shrink's partial sums, [parts, rows, rank] (none without Triton: the torch path needs none)
        num_parts = _shrink_parts(widest)
        self.scratch = torch.zeros(num_parts, spec.max_tokens if num_parts else 0, max(most, 1), device=dev)
        # static buffers the kernels read (CUDA graphs replay them): each row's slot (BGMV), and the rows
        # grouped by slot with the tiles of that order, (slot, start, end) each (SGMV)
        self.token_slots = torch.full((spec.max_tokens,), -1, dtype=torch.int32, device=dev)
        self.order = torch.zeros(spec.max_tokens, dtype=torch.int32, device=dev)
        self.tiles = torch.zeros(3 * _max_tiles(spec.max_tokens, S), dtype=torch.int32, device=dev)
        self.segments: list[tuple[int, int, int]] = []  # (slot, start, end): consecutive tokens of one slot
        self.per_token = True  # this forward's kernels: BGMV (per token) or SGMV (grouped by slot)
        self.capture = False  # a CUDA graph's capture or warm-up: the kernels launch whatever the rows
        # `begin`'s shrink runs on a stream of its own beside the target's projection (a CUDA graph keeps
        # the fork and the join as edges); `begun`: the target whose shrink is under way there
        # (none off CUDA, where the kernels run under Triton's interpreter in order: `begin` shrinks at once)
        self.side = torch.cuda.Stream(spec.device) if self.kernels and spec.device.type == "cuda" else None
        self.begun: str | None = None
        self.begun_x: torch.Tensor | None = None  # what the side stream reads, held until the join

    # ------------------------------------------------------------------ reading

    def read(self, path: str, name: str) -> HostLoRA:
        folder = Path(path).expanduser()
        config_path = folder / CONFIG
        if not config_path.is_file():
            raise RequestError(
                f"LoRA adapter {name!r}: {folder} has no {CONFIG}: give the folder PEFT's save_pretrained wrote"
            )
        try:
            config = json.loads(config_path.read_text())
        except (OSError, ValueError) as exc:
            raise RequestError(f"LoRA adapter {name!r}: {config_path} is not JSON ({exc}): rewrite it") from None
        self._check_config(name, config)
        weights = self._tensors(name, folder)
        r_default, alpha_default = int(config["r"]), float(config.get("lora_alpha", config["r"]))
        # a module's rank is its A's rows (what rank_pattern made it); alpha_pattern picks its alpha
        rank_pattern, alpha_pattern = config.get("rank_pattern") or {}, config.get("alpha_pattern") or {}
        pairs: dict[str, dict[str, torch.Tensor]] = {}
        for key, tensor in weights.items():
            m = _WEIGHT.match(key)
            if m is None:
                raise RequestError(
                    f"LoRA adapter {name!r}: tensor {key} is no LoRA A or B weight of a projection: serve an adapter "
                    f"of LoRA layers only (no embedding, head or modules_to_save)"
                )
            pairs.setdefault(m["module"], {})[m["ab"]] = tensor
        host = HostLoRA(name, str(folder), {})
        for module, ab in sorted(pairs.items()):
            if set(ab) != {"A", "B"}:
                raise RequestError(f"LoRA adapter {name!r}: {module} has lora_{set(ab).pop()} alone: re-save it")
            found = _LAYER.search(module)
            target = self.by_piece.get((int(found["layer"]), found["name"])) if found else None
            if target is None:
                targets = sorted({p for _, p in self.by_piece})
                raise RequestError(
                    f"LoRA adapter {name!r} changes {module}, which this model lets no adapter change: target "
                    f"only {', '.join(targets)} of its decoder layers"
                )
            a, b = ab["A"], ab["B"]
            r = int(a.shape[0]) if a.dim() == 2 else int(_pattern_value(rank_pattern, module, r_default))
            alpha = float(_pattern_value(alpha_pattern, module, alpha_default))
            t, pieces = target
            full_out = sum(t.out_features[p] for p in pieces)
            if a.shape != (r, t.in_features) or b.shape != (full_out, r):
                raise RequestError(
                    f"LoRA adapter {name!r}: {module} has A {tuple(a.shape)} and B {tuple(b.shape)}, where this model "
                    f"takes A ({r}, {t.in_features}) and B ({full_out}, {r}): an adapter of another base model?"
                )
            if r > self.spec.max_rank:
                raise RequestError(
                    f"LoRA adapter {name!r} has rank {r} at {module}, over --max-lora-rank {self.spec.max_rank}: "
                    f"restart with --max-lora-rank {r} or more"
                )
            scale = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
            self._place(host, t, pieces, a.float(), b.float() * scale)
        if not host.weights:
            raise RequestError(f"LoRA adapter {name!r}: {folder / WEIGHTS} holds no LoRA weights: re-save it")
        return host

    def _check_config(self, name: str, config: dict[str, Any]) -> None:
        kind = config.get("peft_type")
        if kind != "LORA":
            raise RequestError(
                f"LoRA adapter {name!r} is a PEFT {kind} adapter, not LORA: serve it with an adapter plugin of its "
                f"kind (--adapter)"
            )
        problems = []
        if config.get("use_dora"):
            problems.append("use_dora (DoRA: an adapter plugin of its kind, --adapter)")
        if config.get("bias", "none") != "none":
            problems.append(f"bias {config['bias']!r} (LoRA biases: re-train with bias='none')")
        if config.get("fan_in_fan_out"):
            problems.append("fan_in_fan_out (Conv1D layers: a GPT-2-style base)")
        if config.get("modules_to_save"):
            problems.append(f"modules_to_save {config['modules_to_save']} (whole modules beside the LoRA)")
        if not isinstance(config.get("r"), int) or config["r"] < 1:
            problems.append(f"r {config.get('r')!r} (a positive integer)")
        if problems:
            raise RequestError(f"LoRA adapter {name!r}: this server does not serve {'; '.join(problems)}")

    def _tensors(self, name: str, folder: Path) -> dict[str, torch.Tensor]:
        from safetensors.torch import load_file

        path = folder / WEIGHTS
        if not path.is_file():
            bins = " (it has adapter_model.bin: re-save it with safe_serialization=True)"
            raise RequestError(
                f"LoRA adapter {name!r}: {folder} has no {WEIGHTS}{bins if (folder / 'adapter_model.bin').exists() else ''}"
            )
        try:
            return load_file(str(path))
        except Exception as exc:  # safetensors' own errors (a bad header, a truncated file), and OSError
            raise RequestError(f"LoRA adapter {name!r}: {path} cannot be read ({exc}): re-save it") from None

    def _place(
        self, host: HostLoRA, t: AdapterTarget, pieces: tuple[int, ...], a: torch.Tensor, b: torch.Tensor
    ) -> None:
        """This rank's part of one adapter module, as (A, B) per piece of target `t`."""
        entry = host.weights.setdefault(t.module, [None] * len(t.pieces))
        rows = 0
        for p in pieces:  # an alias's B stacks its pieces' rows; a piece alone is all of B
            n = t.out_features[p]
            b_piece = b[rows : rows + n]
            rows += n
            a_piece = a
            if t.split == "column":
                start, length = t.out_slices[p]
                b_piece = b_piece[start : start + length]
            elif t.split == "row":
                assert t.in_slice is not None
                start, length = t.in_slice
                a_piece = a[:, start : start + length]
            entry[p] = (a_piece.to(self.spec.dtype).contiguous(), b_piece.to(self.spec.dtype).contiguous())

    # ------------------------------------------------------------------ device slots

    def load(self, slot: int, adapter: HostLoRA) -> None:
        self.clear(slot)
        R = self.spec.max_rank
        for module, pieces in adapter.weights.items():
            t = self.targets[module]
            a, b = self.a[module][slot], self.b[module][slot]
            offsets = [sum(t.local_out[:i]) for i in range(len(t.pieces))]
            for i, piece in enumerate(pieces):
                if piece is None:
                    continue
                a_p, b_p = piece
                r = a_p.shape[0]
                a[i * R : i * R + r].copy_(a_p, non_blocking=True)
                b[offsets[i] : offsets[i] + b_p.shape[0], i * R : i * R + r].copy_(b_p, non_blocking=True)

    def clear(self, slot: int) -> None:
        for module in self.targets:
            self.a[module][slot].zero_()
            self.b[module][slot].zero_()

    # ------------------------------------------------------------------ a step

    def plan(self, batch: AdapterBatch) -> None:
        from infer.kernels.lora_reference import segments_of

        self._join()  # a forward that raised between a begin and its layer: nothing left on the side stream
        slots = batch.token_slots()
        self.segments = segments_of(slots)
        self.capture = batch.capture
        if len(slots) > self.spec.max_tokens:
            raise RuntimeError(f"a forward of {len(slots)} rows, over the {self.spec.max_tokens} AdapterSpec sized")
        self.per_token = len(slots) <= BGMV_MAX_TOKENS  # the row count alone decides: a graph replays its choice
        if not self.kernels:
            return
        if self.per_token:
            self.token_slots[: len(slots)].copy_(torch.tensor(slots, dtype=torch.int32), non_blocking=True)
        else:
            from infer.kernels.lora import group_by_slot

            order, tiles = group_by_slot(slots, self.spec.max_adapters)
            host = torch.tensor(order + tiles, dtype=torch.int32)
            self.order[: len(order)].copy_(host[: len(order)], non_blocking=True)
            self.tiles[: len(tiles)].copy_(host[len(order) :], non_blocking=True)

    def layers(self) -> dict[str, LoRALayer]:
        return {t.module: LoRALayer(self, t) for t in self.spec.targets}

    def _running(self) -> bool:
        """Whether this forward launches the kernels (or the torch path runs): some row runs an adapter,
        or a CUDA graph is captured (its replays may run adapters)."""
        return bool(self.segments) or (self.kernels and self.capture)

    def _shrink(self, t: AdapterTarget, x: torch.Tensor) -> None:
        if self.per_token:
            from infer.kernels.lora import bgmv_shrink

            bgmv_shrink(x, self.a[t.module], self.token_slots, self.scratch)
        else:
            from infer.kernels.lora import sgmv_shrink

            sgmv_shrink(x, self.a[t.module], self.order, self.tiles, self.scratch)

    def _join(self) -> None:
        if self.begun is not None and self.side is not None:
            torch.cuda.current_stream(self.spec.device).wait_stream(self.side)
        self.begun, self.begun_x = None, None  # x may go back to the allocator only after the join

    def begin(self, t: AdapterTarget, x: torch.Tensor) -> None:
        """The shrink of target `t`, v = x A^T, on the side stream, while the stream it left computes the
        projection; `apply` joins it and expands. Decode's critical path loses a kernel a target."""
        self._join()
        if not (self.kernels and self._running()):
            return
        x = x.contiguous()  # made on the model's stream (a copy, if x was not): held until the join
        if self.side is None:
            self._shrink(t, x)
        else:
            self.side.wait_stream(torch.cuda.current_stream(self.spec.device))
            with torch.cuda.stream(self.side):
                self._shrink(t, x)
        self.begun, self.begun_x = t.module, x

    def apply(self, t: AdapterTarget, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y + each token's delta for target `t` (y in place, unless the delta must be summed first)."""
        begun = self.begun == t.module  # its shrink is under way on the side stream: join it
        self._join()
        if not self._running():
            return y  # no row runs an adapter
        a, b = self.a[t.module], self.b[t.module]
        reduce = t.split == "row" and t.summed and self.spec.all_reduce is not None
        out = torch.zeros_like(y) if reduce else y
        if not self.kernels:
            from infer.kernels.lora_reference import lora_reference

            lora_reference(x.contiguous(), out, a, b, self.segments)
        else:
            if not begun:
                self._shrink(t, x.contiguous())
            if self.per_token:
                from infer.kernels.lora import bgmv_expand

                bgmv_expand(self.scratch, b, self.token_slots, out, x.shape[1])
            else:
                from infer.kernels.lora import sgmv_expand

                sgmv_expand(self.scratch, b, self.order, self.tiles, out, x.shape[1])
        if reduce:
            assert self.spec.all_reduce is not None
            return y + self.spec.all_reduce(out)
        return out


class LoRALayer:
    """`AdapterLayer` of one target: y = layer(x, y)."""

    __slots__ = ("kind", "target")

    def __init__(self, kind: LoRAKind, target: AdapterTarget) -> None:
        self.kind, self.target = kind, target

    def begin(self, x: torch.Tensor) -> None:
        self.kind.begin(self.target, x)

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.kind.apply(self.target, x, y)


@hookimpl
def infer_register_adapters(register) -> None:
    register("lora", LoRAKind)
