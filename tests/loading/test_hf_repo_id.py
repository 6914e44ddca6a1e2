"""Models by HF repo id: resolved from an HF cache layout the tests build (refs/, snapshots/, blobs/),
offline; greedy tokens equal HF transformers' on the same weights; revisions; the not-cached error;
a download asks only for the files the engine reads; dummy weights keep the repo's tokenizer."""

from __future__ import annotations

import fnmatch
import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from infer import SamplingParams
from infer.api.errors import ModelLoadError
from infer.cli.main import cli
from infer.core.registry import PluginRegistry
from infer.llm import LLM
from infer.loading.loader import resolve_source

MAIN = "a" * 40  # commit hashes of the two snapshots
V2 = "b" * 40
PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [100, 3, 200, 17, 42]]
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def _add_snapshot(repo: Path, commit: str, folder: Path) -> None:
    """Files as huggingface_hub stores them: blobs named by hash, snapshot entries linking to them."""
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for f in folder.iterdir():
        blob = repo / "blobs" / hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copyfile(f, blob)
        (snapshot / f.name).symlink_to(Path("../..") / "blobs" / blob.name)


def _set_ref(repo: Path, name: str, commit: str) -> None:
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / name).write_text(commit)


@pytest.fixture(scope="module")
def other_llama_dir(tmp_path_factory, tiny_llama_dir) -> Path:
    """The tiny Llama's shape with other random weights: revision v2."""
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("tiny-llama-v2")
    torch.manual_seed(1)
    model = LlamaForCausalLM(LlamaConfig.from_pretrained(tiny_llama_dir))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
    model.save_pretrained(folder)
    return folder


@pytest.fixture
def hf_cache(tmp_path, monkeypatch, tiny_llama_dir, other_llama_dir) -> Path:
    """HF_HUB_CACHE holding org/tiny at main (tiny_llama_dir) and at v2 (other weights); offline."""
    cache = tmp_path / "hf-cache"
    repo = cache / "models--org--tiny"
    _add_snapshot(repo, MAIN, tiny_llama_dir)
    _add_snapshot(repo, V2, other_llama_dir)
    _set_ref(repo, "main", MAIN)
    _set_ref(repo, "v2", V2)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def _hf_greedy(folder: Path) -> list[list[int]]:
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    outs = []
    for ids in PROMPTS:
        x = torch.tensor([ids])
        y = model.generate(
            x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=8,
            min_new_tokens=8,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
        outs.append(y[0, x.shape[1] :].tolist())
    return outs


def _greedy(**options) -> list[list[int]]:
    with LLM(attention="torch", dtype="float32", block_size=4, **options) as llm:
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]


def test_repo_id_loads_from_the_hf_cache_and_matches_hf(hf_cache, tiny_llama_dir):
    source = resolve_source("org/tiny", PluginRegistry.load(), "auto")
    assert source.path == hf_cache / "models--org--tiny" / "snapshots" / MAIN
    assert _greedy(model="org/tiny") == _hf_greedy(tiny_llama_dir)


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
@pytest.mark.parametrize("revision", ["v2", V2])
def test_revision_picks_its_snapshot(hf_cache, tiny_llama_dir, other_llama_dir, revision):
    expected = _hf_greedy(other_llama_dir)
    assert expected != _hf_greedy(tiny_llama_dir)  # the two revisions are different models
    assert _greedy(model="org/tiny", revision=revision) == expected


def test_hf_home_is_read_when_hf_hub_cache_is_unset(hf_cache, monkeypatch, tmp_path):
    home = tmp_path / "hf-home"
    home.mkdir()
    (hf_cache).rename(home / "hub")
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.setenv("HF_HOME", str(home))
    source = resolve_source("org/tiny", PluginRegistry.load(), "auto")
    assert source.path == home / "hub" / "models--org--tiny" / "snapshots" / MAIN


def test_not_cached_offline_names_the_fix(hf_cache):
    with pytest.raises(ModelLoadError) as err:
        LLM(model="org/absent", attention="torch")
    message = str(err.value)
    assert "`hf download org/absent`" in message and "HF_HUB_OFFLINE" in message and "\n" not in message
    with pytest.raises(ModelLoadError, match="`hf download org/tiny --revision nope`"):
        LLM(model="org/tiny", revision="nope", attention="torch")
    result = CliRunner().invoke(cli, ["run", "--model", "org/absent", "--attention", "torch", "--prompt", "hi"])
    assert result.exit_code == 2 and "Traceback" not in result.output
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "hf download org/absent" in errors[0], result.output


def test_download_asks_only_for_the_files_the_engine_reads(hf_cache, monkeypatch, tiny_llama_dir):
    import huggingface_hub
    from huggingface_hub import constants
    from huggingface_hub.utils import LocalEntryNotFoundError

    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    calls = []

    def fake_snapshot_download(repo_id, **kwargs):
        calls.append((repo_id, kwargs))
        if kwargs.get("local_files_only"):
            raise LocalEntryNotFoundError("not cached")
        return str(tiny_llama_dir)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    source = resolve_source("org/new", PluginRegistry.load(), "auto")
    assert source.path == tiny_llama_dir
    (_, local), (repo_id, remote) = calls
    assert local["local_files_only"] and not remote.get("local_files_only") and repo_id == "org/new"
    assert remote["cache_dir"] == hf_cache and remote["revision"] == "main"
    wanted = [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "model-00001-of-00002.safetensors",
        "model.safetensors.index.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "tokenizer.model",
        "special_tokens_map.json",
        "chat_template.jinja",
    ]
    unwanted = [
        "pytorch_model.bin",
        "model.gguf",
        "onnx/model.onnx",
        "README.md",
        "original/consolidated.00.pth",
        "flax_model.msgpack",
    ]
    match = lambda name: any(fnmatch.fnmatch(name, p) for p in remote["allow_patterns"])  # noqa: E731
    assert all(map(match, wanted)) and not any(map(match, unwanted))
    calls.clear()
    resolve_source("org/new", PluginRegistry.load(), "dummy")  # random weights: no weight files
    assert not any(fnmatch.fnmatch("model.safetensors", p) for p in calls[-1][1]["allow_patterns"])

    def cached_without_weights(repo_id, **kwargs):  # a folder with no *.safetensors, then the full download
        calls.append((repo_id, kwargs))
        return str(hf_cache if kwargs.get("local_files_only") else tiny_llama_dir)

    calls.clear()
    monkeypatch.setattr(huggingface_hub, "snapshot_download", cached_without_weights)
    assert resolve_source("org/new", PluginRegistry.load(), "auto").path == tiny_llama_dir and len(calls) == 2
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    calls.clear()
    with pytest.raises(ModelLoadError, match="hf download org/new"):
        resolve_source("org/new", PluginRegistry.load(), "auto", pull=False)  # `infer doctor`: never downloads
    assert len(calls) == 1


def test_an_existing_folder_wins_over_a_repo_id(hf_cache, monkeypatch, tmp_path, other_llama_dir):
    monkeypatch.chdir(tmp_path)
    shutil.copytree(other_llama_dir, tmp_path / "org" / "tiny")
    source = resolve_source("org/tiny", PluginRegistry.load(), "auto")
    assert source.path == Path("org/tiny")


@pytest.mark.parametrize("model", ["./org/tiny", "/no/such/org-tiny", "a/b/c", "~/no-such-model-folder"])
def test_paths_that_do_not_exist_say_so(hf_cache, model):
    with pytest.raises(ModelLoadError, match="does not exist"):
        resolve_source(model, PluginRegistry.load(), "auto")


def test_revision_needs_a_repo_id(tiny_llama_dir):
    with pytest.raises(ModelLoadError, match="--revision v2 applies to HF repo ids"):
        resolve_source(str(tiny_llama_dir), PluginRegistry.load(), "auto", revision="v2")


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
def test_dummy_repo_id_keeps_its_tokenizer(hf_cache, smollm2_dir):
    repo = hf_cache / "models--org--smol"
    _add_snapshot(repo, MAIN, smollm2_dir)
    _set_ref(repo, "main", MAIN)
    source = resolve_source("org/smol", PluginRegistry.load(), "dummy")
    assert source.path is None and source.tokenizer_path == repo / "snapshots" / MAIN
    assert json.loads((source.tokenizer_path / "config.json").read_text())["hidden_size"] == 576
