"""GPU test harness only: what this project's GPU machine needs that the plugins must not carry."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]

# FlashInfer JIT-compiles its kernels on first use (about a minute): into the repo's ignored .cache/
# (REPO/.cache/flashinfer), so the built kernels can travel back to the next fresh machine.
os.environ.setdefault("FLASHINFER_WORKSPACE_BASE", str(REPO))


def _xformers_flash_workaround() -> None:
    """xformers 0.0.35's extension is built for torch 2.10 and does not load under the machine's 2.11,
    so every op reports "not built with CUDA support"; its FlashAttention path runs on PyTorch's own
    flash kernels and needs no extension. The plugin itself reports xformers unavailable instead."""
    if not torch.cuda.is_available() or importlib.util.find_spec("xformers") is None:
        return
    try:
        from xformers.ops.fmha import common
    except ImportError:  # a broken install: the plugin reports it, the tests skip with its reason
        return
    if getattr(common, "_built_with_cuda", True) is False:
        common._built_with_cuda = True


_xformers_flash_workaround()
