"""Checkpoints as current tooling writes them: configs read through transformers, every RoPE type
Llama knows equal to HF's greedy tokens (fp32, CPU) or refused by name, and weights that disagree
with their config refused by tensor name before any weight is read."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from infer import SamplingParams
from infer.api.errors import ConfigError, ModelLoadError
from infer.llm import LLM
from infer.testing.decoder import TINY_LLAMA as TINY_CONFIG
from infer.testing.prompts import SMOLLM2_PROMPTS

MAX_TOKENS = 32
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)


def hf_greedy(folder: Path, prompts: list[list[int]]) -> list[list[int]]:
    """HF transformers' own greedy continuation of each prompt (fp32)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    outs = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        y = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=MAX_TOKENS,
            min_new_tokens=MAX_TOKENS,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
        outs.append(y[0, ids.shape[1] :].tolist())
    return outs


def infer_greedy(folder: Path, prompts: list[list[int]], **options) -> list[list[int]]:
    with LLM(model=str(folder), attention="torch", dtype="float32", **options) as llm:
        return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]


# --------------------------------------------------------------------------- SmolLM2 re-saved


@pytest.fixture(scope="module")
def resaved_smollm2(smollm2_dir, tmp_path_factory) -> Path:
    """SmolLM2 saved again by the installed transformers (5.x layout: rope_parameters, no rope_theta)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = tmp_path_factory.mktemp("smollm2-resaved")
    AutoModelForCausalLM.from_pretrained(smollm2_dir).save_pretrained(folder)
    AutoTokenizer.from_pretrained(smollm2_dir).save_pretrained(folder)
    return folder


@pytest.mark.slow
def test_resaved_smollm2_is_greedy_equal_to_hf(resaved_smollm2):
    config = json.loads((resaved_smollm2 / "config.json").read_text())
    assert "rope_theta" not in config and config["rope_parameters"]["rope_theta"] == 100000.0  # not vacuous
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(resaved_smollm2)
    prompts = [tok.encode(text) for text in SMOLLM2_PROMPTS[:3]]
    assert infer_greedy(resaved_smollm2, prompts) == hf_greedy(resaved_smollm2, prompts)


# --------------------------------------------------------------------------- tiny Llama, every RoPE type

HEAD_DIM = TINY_CONFIG["hidden_size"] // TINY_CONFIG["num_attention_heads"]  # 16: 8 frequencies
# rope_parameters. Each but dynamic changes the frequencies (or the scaling) at the prompts' positions;
# dynamic equals default up to max_position_embeddings, the context it is capped at (HF rescales only
# past it), so its case checks that the engine reads the type and keeps the default frequencies there.
ROPES = {
    "llama3": dict(
        rope_type="llama3",
        rope_theta=500000.0,
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=64,
    ),
    "linear": dict(rope_type="linear", rope_theta=10000.0, factor=4.0),
    "yarn": dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=128),
    "dynamic": dict(rope_type="dynamic", rope_theta=10000.0, factor=2.0),
    "longrope": dict(
        rope_type="longrope",
        rope_theta=10000.0,
        original_max_position_embeddings=128,
        short_factor=[1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.0, 4.0],
        long_factor=[1.0, 2.0, 4.0, 8.0, 16.0, 24.0, 32.0, 48.0],
    ),
}
# prompts of random ids, long enough that a low frequency turns a visible angle; prompt + output stay
# within longrope's original_max_position_embeddings (128), the context it is exact for
PROMPT_LENS = (90, 57, 23)


def tiny_llama(folder: Path, rope_parameters: dict | None, **config_json) -> Path:
    """A random tiny Llama saved by transformers, its config.json then given `config_json` entries."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    shape = {k: v for k, v in TINY_CONFIG.items() if k != "rope_theta"}
    model = LlamaForCausalLM(LlamaConfig(**shape, rope_parameters=rope_parameters, dtype="float32"))
    with torch.no_grad():  # larger than the default init, so greedy paths are not near-ties
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
    model.save_pretrained(folder)
    if config_json:
        path = folder / "config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **config_json}))
    return folder


def random_prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, TINY_CONFIG["vocab_size"]) for _ in range(n)] for n in PROMPT_LENS]


@pytest.mark.parametrize("kind", list(ROPES))
def test_every_llama_rope_type_is_greedy_equal_to_hf(tmp_path, kind):
    folder = tiny_llama(tmp_path, ROPES[kind])
    prompts = random_prompts()
    assert infer_greedy(folder, prompts) == hf_greedy(folder, prompts)


def test_rope_scaling_changes_the_tokens(tmp_path):
    """The rope tests can fail: the same weights under default RoPE continue differently."""
    prompts = random_prompts()
    scaled = infer_greedy(tiny_llama(tmp_path / "llama3", ROPES["llama3"]), prompts)
    assert infer_greedy(tiny_llama(tmp_path / "default", None), prompts) != scaled


def test_old_layout_rope_theta_and_rope_scaling(tmp_path):
    """A config.json written by older tooling: top-level rope_theta and rope_scaling with "type"."""
    folder = tiny_llama(tmp_path, None, rope_theta=500000.0, rope_scaling={"type": "linear", "factor": 2.0})
    config = json.loads((folder / "config.json").read_text())
    del config["rope_parameters"]
    (folder / "config.json").write_text(json.dumps(config))
    prompts = random_prompts()
    assert infer_greedy(folder, prompts) == hf_greedy(folder, prompts)


def test_longrope_context_is_capped_at_its_original_length(tmp_path):
    folder = tiny_llama(tmp_path, ROPES["longrope"])
    with LLM(model=str(folder), attention="torch", dtype="float32") as llm:
        assert llm.engine.parts.max_model_len == 128
    with pytest.raises(ConfigError, match=r"longrope switches to its long factors .* use at most 128"):
        LLM(model=str(folder), attention="torch", dtype="float32", max_model_len=256)


@pytest.mark.parametrize(
    "rope_parameters, named",
    [
        (dict(rope_type="proportional", rope_theta=10000.0, factor=2.0), "rope_type 'proportional'"),
        (dict(rope_type="bogus", rope_theta=10000.0), "rope_type 'bogus'"),
        (dict(rope_type="llama3", rope_theta=10000.0, factor=8.0), "llama3"),  # its other keys missing
        (
            dict(rope_type="linear", rope_theta=10000.0, factor=2.0, partial_rotary_factor=0.5),
            "rotates 8 of 16 head dims",
        ),
    ],
)
def test_a_rope_llama_cannot_use_is_refused_by_name(tmp_path, rope_parameters, named):
    folder = tiny_llama(tmp_path, None)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "rope_parameters": rope_parameters}))
    with pytest.raises(ModelLoadError, match=named) as err:
        LLM(model=str(folder), attention="torch", dtype="float32")
    assert "\n" not in str(err.value)


# --------------------------------------------------------------------------- weights against their config


@pytest.fixture
def no_weight_reads(monkeypatch):
    """Fail the test if any tensor's bytes are read (headers are fine)."""
    from infer.loading import loader

    def refuse(*args, **kwargs):
        raise AssertionError("a weight was read before the shapes were checked")

    monkeypatch.setattr(loader, "iter_safetensors", refuse)


def smollm2_with(folder: Path, smollm2_dir: Path, **changes) -> Path:
    folder.mkdir()
    for f in smollm2_dir.iterdir():
        (folder / f.name).symlink_to(f)
    (folder / "config.json").unlink()
    (folder / "config.json").write_text(
        json.dumps({**json.loads((smollm2_dir / "config.json").read_text()), **changes})
    )
    return folder


WIDER = dict(hidden_size=640, num_attention_heads=10, num_key_value_heads=5)  # head_dim stays 64


def test_config_wider_than_its_weights_is_refused_before_weights_load(tmp_path, smollm2_dir, no_weight_reads):
    folder = smollm2_with(tmp_path / "wider", smollm2_dir, **WIDER)
    with pytest.raises(
        ModelLoadError,
        match=r"tensor model\.\S+ in \S+ has shape \[.*576.*\] but config.json implies "
        r"\[.*640.*\]",
    ) as err:
        LLM(model=str(folder), attention="torch", dtype="float32")
    assert "\n" not in str(err.value)


def test_fused_pieces_are_checked_by_their_own_rows(tmp_path, no_weight_reads):
    """gate_proj and up_proj fill one fused parameter: each is checked against its own piece."""
    folder = tiny_llama(tmp_path, None, intermediate_size=192)
    with pytest.raises(
        ModelLoadError,
        match=r"mlp\.(gate|up|down)_proj\.weight .* has shape \[(160, 64|64, 160)\] "
        r"but config.json implies \[(192, 64|64, 192)\]",
    ):
        LLM(model=str(folder), attention="torch", dtype="float32")


def test_tensors_handed_to_the_model_are_checked_too(tiny_llama_dir):
    """Without the header check (tensors from elsewhere), load_weights refuses by name, not in copy_."""
    from infer.loading.config import model_config_from_hf
    from infer.loading.loader import _read_config
    from infer.plugins.layer.torch_layers import default_layers
    from infer.plugins.model.llama import Llama

    model = Llama(model_config_from_hf(_read_config(tiny_llama_dir)), default_layers(), None)
    with pytest.raises(
        ModelLoadError, match=r"model\.layers\.0\.self_attn\.k_proj\.weight .* \[64, 64\] .* \[32, 64\]"
    ):
        model.load_weights([("model.layers.0.self_attn.k_proj.weight", torch.zeros(64, 64))])
    assert model.load_weights(
        [
            ("model.layers.0.self_attn.k_proj.weight", torch.zeros(32, 64)),
            ("model.layers.0.unexpected.weight", torch.zeros(3)),
        ]
    ) == {"layers.0.self_attn.qkv_proj.weight"}


def test_doctor_reads_the_headers_and_names_the_tensor(tmp_path, smollm2_dir, no_weight_reads):
    from click.testing import CliRunner

    from infer.cli.main import cli

    folder = smollm2_with(tmp_path / "wider", smollm2_dir, **WIDER)
    result = CliRunner().invoke(cli, ["doctor", "--model", str(folder), "--device", "cpu"])
    assert result.exit_code == 2, result.output
    refused = next(line for line in result.output.splitlines() if "REFUSED" in line)
    assert refused.split()[0] == "model" and "tensor model.embed_tokens.weight" in refused and "[49152, 640]" in refused
    ok = CliRunner().invoke(cli, ["doctor", "--model", str(smollm2_dir), "--device", "cpu"])
    assert ok.exit_code == 0, ok.output
