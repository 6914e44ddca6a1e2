"""What the builder's checks settle before any weight loads (`BuildPlan`): what `runners`, `kv_cache` and
`decode_paths` build the engine's parts from."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from infer.api import DeviceWaits, Layers
from infer.api.config import EngineConfig, ModelConfig
from infer.core.compose import Composition
from infer.core.registry import PluginRegistry
from infer.loading.loader import ModelSource


@dataclass(slots=True)
class BuildPlan:
    """What the checks settled, before any weight loads."""

    config: EngineConfig  # validated
    registry: PluginRegistry  # every plugin loaded for this engine
    device: torch.device  # this rank's
    dtype: torch.dtype  # the models' (activations and weights)
    composition: Composition  # the strategies, checked against the device, dtype and model
    source: ModelSource  # the target's
    model_config: ModelConfig  # the target's
    layers: Layers  # the layer kinds the models are built from (quantized linears included)
    max_model_len: int  # the longest context a request may reach
    chat_template: str | None = None  # --chat-template's text
    draft_source: ModelSource | None = None  # --draft's, checked against the target; None: no draft model
    max_rows: int = 0  # decode rows a step may have: max_num_seqs x (1 + lookahead), a verify step's rows
    waits: DeviceWaits = field(default_factory=DeviceWaits)  # the engine's thread's waits on the device
