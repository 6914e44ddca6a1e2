"""Every environment variable infer reads: its name, type, default and meaning. Nothing else in
`infer/` reads or writes `os.environ` (`tests/test_env.py` checks); `export` sets one for this process
and the ones it starts.

Each function reads the environment when it is called, so a variable set after `import infer` (a
test's monkeypatch, a notebook's `os.environ[...] = ...`) counts from the next call. None is meant
for a hot path: a caller that needs a value at every kernel launch reads it once and keeps it.

- `TRITON_INTERPRET` is Triton's own: Triton fixes it for a kernel when the kernel is decorated (at
  the import of its module), so the modules whose launches depend on it read it once, at import.
- `INFER_PDL` is read at the first launch on each GPU and kept until `infer.kernels.pdl.reset()`.
- torchrun's `MASTER_ADDR` / `MASTER_PORT` are read by torch's `env://` rendezvous, not here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "Torchrun",
    "cache_dir",
    "cpu_threads",
    "cuda_visible_devices",
    "export",
    "extra_plugins",
    "gemv_push",
    "hf_hub_cache",
    "hf_offline",
    "pdl",
    "ray_address",
    "torchrun",
    "triton_interpret",
]


def pdl() -> bool:
    """INFER_PDL (bool, default on): launch kernels as programmatic dependents on GPUs that can
    (compute capability 9.0+); `0` turns it off, any other value leaves it on."""
    return os.environ.get("INFER_PDL", "1") != "0"


def gemv_push() -> bool:
    """INFER_GEMV_PUSH (bool, default on): at tensor parallelism with FlashInfer's all-reduce, one-token
    steps' row-parallel GEMVs push their partial sums into the ranks' Lamport exchange; `0` on any
    rank keeps the all-reduce."""
    return os.environ.get("INFER_GEMV_PUSH", "1") != "0"


def triton_interpret() -> bool:
    """TRITON_INTERPRET (bool, default off; Triton's): `1` runs Triton kernels in Triton's interpreter
    on the CPU (how CI tests them); any other value compiles them for the GPU."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def cpu_threads() -> int | None:
    """INFER_CPU_THREADS (int >= 1, default unset): torch's threads for a CPU engine, as --cpu-threads sets
    them (the option wins); unset: the cores this process may use, one when the machine is busy. A value
    that is no positive integer is ignored."""
    value = os.environ.get("INFER_CPU_THREADS", "").strip()
    return int(value) if value.isdigit() and int(value) >= 1 else None


def cache_dir() -> Path:
    """INFER_CACHE_DIR (path, default `$XDG_CACHE_HOME/infer`, else `~/.cache/infer`): where infer keeps
    the models it converts (`models/`). Empty values count as unset."""
    if value := os.environ.get("INFER_CACHE_DIR"):
        return Path(value).expanduser()
    if xdg := os.environ.get("XDG_CACHE_HOME"):
        return Path(xdg).expanduser() / "infer"
    return Path.home() / ".cache" / "infer"


def extra_plugins() -> list[str]:
    """INFER_EXTRA_PLUGINS (comma-separated `module:attr` or `module`, default none): unpublished plugins
    the CLI loads (tests, plugin development); embedding apps pass `LLM(plugins=[...])` instead."""
    return [item for item in (s.strip() for s in os.environ.get("INFER_EXTRA_PLUGINS", "").split(",")) if item]


def hf_hub_cache() -> Path | None:
    """HF_HUB_CACHE, else HUGGINGFACE_HUB_CACHE, else `$HF_HOME/hub` (path; huggingface_hub's): the HF
    cache that model ids resolve in. None: none is set, huggingface_hub's default applies."""
    if value := os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE"):
        return Path(value).expanduser()
    if home := os.environ.get("HF_HOME"):
        return Path(home).expanduser() / "hub"
    return None


def hf_offline() -> bool:
    """HF_HUB_OFFLINE, else TRANSFORMERS_OFFLINE (bool, default off; huggingface_hub's): true as
    huggingface_hub reads it (`1`, `ON`, `YES`, `TRUE`, any case): nothing is downloaded."""
    from huggingface_hub.constants import ENV_VARS_TRUE_VALUES

    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.upper() in ENV_VARS_TRUE_VALUES


@dataclass(frozen=True, slots=True)
class Torchrun:
    """Where torchrun placed this process (its variables, all ints)."""

    rank: int  # RANK: among all ranks
    world_size: int  # WORLD_SIZE: ranks torchrun started, on every host
    local_rank: int  # LOCAL_RANK (default RANK): index among this host's ranks
    local_world_size: int  # LOCAL_WORLD_SIZE (default WORLD_SIZE): ranks on this host


def torchrun() -> Torchrun | None:
    """torchrun's placement when it started this process (RANK and WORLD_SIZE are set), else None (the
    engine spawns its ranks itself). A value that is no int raises ValueError."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    rank, world_size = os.environ["RANK"], os.environ["WORLD_SIZE"]
    return Torchrun(
        rank=int(rank),
        world_size=int(world_size),
        local_rank=int(os.environ.get("LOCAL_RANK", rank)),
        local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", world_size)),
    )


def cuda_visible_devices() -> list[str] | None:
    """CUDA_VISIBLE_DEVICES (CUDA's own, read here for data-parallel replicas): the devices this process
    sees, by the names in it; None when it is unset or empty (every device is visible)."""
    names = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    return names or None


def ray_address() -> str | None:
    """RAY_ADDRESS (Ray's own, read here to name the cluster in errors): the Ray cluster to join; None: unset."""
    return os.environ.get("RAY_ADDRESS") or None


def export(name: str, value: str) -> None:
    """Set `name` for this process (read again by the functions above at their next call) and for the
    processes it starts from now on (spawned ranks, a benchmark's child runs)."""
    os.environ[name] = value
