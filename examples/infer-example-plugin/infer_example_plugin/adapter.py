"""`example-lora`: PEFT LoRA adapters in a few lines of plain torch, one sequence's rows at a time, written
only against `infer.api.adapters` (`--enable-lora --adapter example-lora`). What a third party's adapter
kind needs: read a folder into host tensors checked against the model's `AdapterTarget`s, keep
`max_adapters` of them in numbered slots, and add each row's delta after the projections the model
calls its layers for. The built-in `lora` does the same with stacked slots and Triton kernels.

Kept simple: one rank (`distributed=False`), no CUDA graphs (its `plan` reads the batch on the host).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import torch

import infer
from infer.api import AdapterBatch, AdapterSpec, AdapterTarget, Capabilities
from infer.api.errors import RequestError

INFER_PLUGIN_API = ">=2.3,<3"  # 2.3 added the adapter slot

WEIGHT = re.compile(r"^(?:base_model\.model\.)?(?:model\.)?layers\.(\d+)\.(?:.+\.)?([^.]+)\.lora_([AB])\.weight$")


class ExampleLoRA:
    capabilities = Capabilities(distributed=False)

    def __init__(self, spec: AdapterSpec) -> None:
        self.spec = spec
        self.pieces = {(t.layer, p): (t, i) for t in spec.targets for i, p in enumerate(t.pieces)}
        self.slots: list[dict[str, list] | None] = [None] * spec.max_adapters
        self.rows: list[tuple[int, int, int]] = []  # (slot, first row, end) of this forward

    def read(self, path: str, name: str) -> dict[str, list]:
        folder = Path(path)
        try:
            config = json.loads((folder / "adapter_config.json").read_text())
        except (OSError, ValueError) as exc:
            raise RequestError(f"adapter {name!r}: no readable adapter_config.json in {folder} ({exc})") from None
        if config.get("peft_type") != "LORA" or config.get("use_dora") or config.get("bias", "none") != "none":
            raise RequestError(f"adapter {name!r}: example-lora serves plain LoRA (no DoRA, no biases)")
        from safetensors.torch import load_file

        pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
        for key, tensor in load_file(str(folder / "adapter_model.safetensors")).items():
            found = WEIGHT.match(key)
            if found is None or (int(found[1]), found[2]) not in self.pieces:
                raise RequestError(f"adapter {name!r}: {key} changes a module this model lets no adapter change")
            pairs.setdefault((int(found[1]), found[2]), {})[found[3]] = tensor.float()
        alpha, use_rslora = float(config.get("lora_alpha", config["r"])), bool(config.get("use_rslora"))
        weights: dict[str, list] = {}
        for (layer, piece), ab in pairs.items():
            target, index = self.pieces[(layer, piece)]
            a, b = ab["A"], ab["B"]
            r = a.shape[0]
            if r > self.spec.max_rank:
                raise RequestError(f"adapter {name!r}: rank {r} is over --max-lora-rank {self.spec.max_rank}")
            scale = alpha / (math.sqrt(r) if use_rslora else r)
            entry = weights.setdefault(target.module, [None] * len(target.pieces))
            entry[index] = (a.to(self.spec.dtype), (b * scale).to(self.spec.dtype))
        return weights

    def load(self, slot: int, adapter: dict[str, list]) -> None:
        device = self.spec.device
        self.slots[slot] = {
            module: [p if p is None else (p[0].to(device), p[1].to(device)) for p in pieces]
            for module, pieces in adapter.items()
        }

    def plan(self, batch: AdapterBatch) -> None:
        self.rows, start = [], 0
        for slot, n in zip(batch.seq_slots, batch.query_lens):
            if slot >= 0:
                self.rows.append((slot, start, start + n))
            start += n

    def layers(self) -> dict[str, "Layer"]:
        return {t.module: Layer(self, t) for t in self.spec.targets}


class Layer:
    def __init__(self, kind: ExampleLoRA, target: AdapterTarget) -> None:
        self.kind, self.target = kind, target
        self.offsets = [sum(target.local_out[:i]) for i in range(len(target.pieces))]

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for slot, start, end in self.kind.rows:
            pieces = (self.kind.slots[slot] or {}).get(self.target.module, ())
            for offset, piece in zip(self.offsets, pieces):
                if piece is not None:
                    a, b = piece
                    y[start:end, offset : offset + b.shape[0]] += (x[start:end] @ a.t()) @ b.t()
        return y


@infer.hookimpl
def infer_register_adapters(register) -> None:
    register("example-lora", ExampleLoRA)
