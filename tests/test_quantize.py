"""`infer models quantize`: GPTQ against round-to-nearest on the objective it minimizes, the folder it writes
loading as saved (an rtn folder is exactly what --quantization fp8 makes at load), and its bad inputs."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from infer import LLM
from infer.cli.main import cli
from infer.plugins.layer.fp8 import quantize_weight
from infer.tools import kv_calibration
from infer.tools import quantize as fp8


def _output_error(w: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, h: torch.Tensor) -> float:
    """tr(D H D^T) for D = dequantized - w: the squared error of the layer's output over the activations."""
    d = (q.double() * scale.double()[:, None]) - w.double()
    return torch.trace(d @ h.double() @ d.T).item()


def _correlated_hessian(k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4 * k, k // 4, generator=g) @ torch.randn(k // 4, k, generator=g)  # columns correlated
    x += 0.05 * torch.randn(4 * k, k, generator=g)
    return (x.T @ x / x.shape[0]).double()


@pytest.mark.parametrize("k,block", [(64, 128), (200, 64)])  # one block; several, the last one short
def test_gptq_keeps_rtns_scales_and_makes_the_layers_output_error_smaller(k, block):
    w = torch.randn(48, k, generator=torch.Generator().manual_seed(k)) * 0.05
    w[5] = 0.0  # a row of zeros: rtn's scale 1
    h = _correlated_hessian(k, seed=k + 1)
    q, scale = fp8.gptq(w, h, block=block)
    rtn_q, rtn_scale = quantize_weight(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape
    assert torch.equal(scale, rtn_scale) and scale[5] == 1.0
    assert _output_error(w, q, scale, h) < 0.5 * _output_error(w, rtn_q, rtn_scale, h)


def test_with_uncorrelated_columns_gptq_is_round_to_nearest():
    """A diagonal H: no column's error reaches another, so every weight rounds as rtn rounds it."""
    w = torch.randn(32, 96, generator=torch.Generator().manual_seed(5))
    h = torch.diag(torch.rand(96, generator=torch.Generator().manual_seed(6)) + 0.5).double()
    q, scale = fp8.gptq(w, h, damp=0.0)
    rtn_q, _ = quantize_weight(w)
    assert torch.equal(q.view(torch.uint8), rtn_q.view(torch.uint8))


def test_a_column_no_token_reaches_is_zeroed():
    w = torch.randn(8, 32, generator=torch.Generator().manual_seed(7))
    h = _correlated_hessian(32, seed=8)
    h[3, :], h[:, 3] = 0.0, 0.0
    w[:, 3] = 10.0  # every row's largest weight sits in the dead column: the scales stay rtn's all the same
    q, scale = fp8.gptq(w, h)
    assert (q[:, 3].float() == 0).all() and (q.float() != 0).sum() > 0.9 * (w.numel() - 8)
    assert torch.equal(scale, quantize_weight(w)[1])


def _one_pass_hessians(model, windows) -> dict[str, torch.Tensor]:
    """The plain way: hooks on every projection through whole forwards, each keeping its own sum."""
    found = fp8.projections(model)
    sums = {name: torch.zeros(m.in_features, m.in_features, dtype=torch.float64) for name, m in found.items()}
    counts = dict.fromkeys(found, 0)

    def collect(name):
        def hook(module, args):
            x = args[0].reshape(-1, args[0].shape[-1]).double()
            sums[name] += x.T @ x
            counts[name] += x.shape[0]

        return hook

    hooks = [m.register_forward_pre_hook(collect(name)) for name, m in found.items()]
    with torch.no_grad():
        for window in windows:
            model(torch.tensor([window]))
    for hook in hooks:
        hook.remove()
    return {name: sums[name] / counts[name] for name in found}


def _tiny_hf_model(family: str, seed: int, **extra) -> torch.nn.Module:
    """A 3-layer HF transformers model of `family` with random weights (head_dim 8, 2 KV heads of 4)."""
    import transformers

    config_class, model_class = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM),
        "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM),
    }[family]
    torch.manual_seed(seed)
    config = config_class(
        **{
            "vocab_size": 96, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 3,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "max_position_embeddings": 64,
            "pad_token_id": 0, **extra,
        }
    )  # fmt: skip
    return model_class(config).eval()


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma2"])
def test_layer_by_layer_hessians_are_a_whole_forwards(family):
    """One layer at a time (the first layer's inputs captured, each layer's outputs fed to the next) gives
    the bits of hooks through whole forwards, q/k/v and gate/up sharing one matrix, one layer's at a time."""
    model = _tiny_hf_model(family, seed=0)
    windows = [[(5 * i + 3 * j) % 96 for j in range(12 + i)] for i in range(3)]
    expected = _one_pass_hessians(model, windows)
    seen = {}
    for i, layer in enumerate(fp8.layer_hessians(model, windows)):
        assert set(layer) == {name for name in expected if name.startswith(f"model.layers.{i}.")}
        seen |= layer
        prefix = f"model.layers.{i}."
        assert layer[prefix + "self_attn.q_proj"] is layer[prefix + "self_attn.v_proj"]
        assert layer[prefix + "mlp.gate_proj"] is layer[prefix + "mlp.up_proj"]
        assert layer[prefix + "self_attn.o_proj"] is not layer[prefix + "self_attn.q_proj"]
    assert seen.keys() == expected.keys()
    for name, h in expected.items():
        assert torch.equal(seen[name], h), name


YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16}
LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0, 1.0], "long_factor": [2.0, 2.0]}


@pytest.mark.parametrize(
    "family,extra",
    [
        ("llama", {}),
        ("llama", {"rope_parameters": YARN}),  # cos and sin scaled by yarn's attention factor
        ("qwen3", {}),
        ("gemma2", {}),
        ("phi3", {}),
        ("phi3", {"partial_rotary_factor": 0.5}),  # half of each head rotated, half passed through
        ("phi3", {"partial_rotary_factor": 0.5, "max_position_embeddings": 256, "original_max_position_embeddings": 64,
                  "rope_parameters": LONGROPE}),
    ],
)  # fmt: skip
def test_each_layers_kv_cache_scales_cover_what_its_cache_holds(family, extra):
    """What each layer's attention puts in its cache (HF's own cache through whole forwards: keys after
    their rotary embedding; Qwen 3's after k_norm, Phi-3's from the fused qkv_proj) against what
    calibration records layer by layer: the largest value, and the largest length of a rotated pair of key
    dimensions (a rotation keeps it; yarn and longrope scale it), or |key| where a dimension is not rotated.
    The pair length bounds every rotated key and exceeds the largest by sqrt(2) at most."""
    model = _tiny_hf_model(family, seed=1, **extra)
    rotary = int(8 * extra.get("partial_rotary_factor", 1.0))
    windows = [[(5 * i + 3 * j) % 96 for j in range(40 + i)] for i in range(3)]
    cached = [[0.0, 0.0, 0.0] for _ in range(3)]  # pair length, |value|, |key|
    with torch.no_grad():
        for window in windows:
            cache = model(torch.tensor([window]), use_cache=True).past_key_values
            for i, layer in enumerate(cache.layers):
                k = layer.keys.reshape(-1, 8).float()
                pairs = torch.sqrt(k[:, : rotary // 2] ** 2 + k[:, rotary // 2 : rotary] ** 2).max()
                key = max(pairs.item(), k[:, rotary:].abs().max().item() if rotary < 8 else 0.0)
                cached[i] = [max(cached[i][0], key), max(cached[i][1], layer.values.abs().max().item()),
                             max(cached[i][2], k.abs().max().item())]  # fmt: skip
    observed: dict[int, list[float]] = {}
    for _ in fp8.layer_hessians(model, windows, kv_amax=observed):
        pass
    assert sorted(observed) == [0, 1, 2]
    for i, (key, value) in observed.items():
        assert value == cached[i][1], (i, value, cached[i][1])
        assert key == pytest.approx(cached[i][0], rel=1e-5), (i, key, cached[i][0])
        assert cached[i][2] <= key * (1 + 1e-6) and key <= 2**0.5 * cached[i][2] * (1 + 1e-6)


def _engine_state(folder, **kwargs) -> dict[str, torch.Tensor]:
    llm = LLM(str(folder), dtype="fp32", device="cpu", num_kv_blocks=32, **kwargs)
    return llm.engine.decoder.runner.model.state_dict()


def test_an_rtn_folder_is_what_quantizing_at_load_makes(tiny_llama_dir, tmp_path):
    out = fp8.quantize_folder(tiny_llama_dir, tmp_path / "rtn", method="rtn", progress=lambda msg: None)
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "compressed-tensors"
    saved, at_load = _engine_state(out), _engine_state(tiny_llama_dir, quantization="fp8")
    assert saved.keys() == at_load.keys()
    for name, tensor in at_load.items():
        assert torch.equal(tensor.view(torch.uint8), saved[name].view(torch.uint8)), name
    assert saved["layers.0.self_attn.qkv_proj.weight"].dtype == torch.float8_e4m3fn


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
def test_a_gptq_folder_loads_as_saved_and_generates(tiny_llama_dir, tmp_path):
    windows = [[(7 * i + j) % 250 for j in range(32)] for i in range(4)]
    out = fp8.quantize_folder(
        tiny_llama_dir, tmp_path / "gptq", method="gptq", windows=windows, progress=lambda m: None
    )
    stored = load_file(str(out / "model.safetensors"))
    state = _engine_state(out)
    qkv = torch.cat([stored[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv"])
    assert torch.equal(state["layers.1.self_attn.qkv_proj.weight"].view(torch.uint8), qkv.view(torch.uint8))
    scales = torch.cat([stored[f"model.layers.1.self_attn.{p}_proj.weight_scale"][:, 0] for p in "qkv"])
    assert torch.equal(state["layers.1.self_attn.qkv_proj.weight_scale"], scales)
    rtn = _engine_state(tiny_llama_dir, quantization="fp8")["layers.1.self_attn.qkv_proj.weight"]
    assert not torch.equal(state["layers.1.self_attn.qkv_proj.weight"].view(torch.uint8), rtn.view(torch.uint8))
    llm = LLM(str(out), dtype="fp32", device="cpu", num_kv_blocks=32)
    assert len(llm.generate([{"prompt_token_ids": [1, 2, 3]}])[0].outputs[0].token_ids) > 0


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
def test_a_gptq_folder_holds_the_kv_cache_scales_of_its_calibration(tiny_llama_dir, tmp_path):
    """gptq writes each layer's k_scale and v_scale (0-dim, float32, beside the layer's weights: the
    largest key and value calibration saw, over 448) and a kv_cache_scheme in the config; an FP8 cache
    reads them, a bf16 one ignores them; rtn writes neither."""
    from transformers import AutoModelForCausalLM

    windows = [[(7 * i + j) % 250 for j in range(32)] for i in range(4)]
    out = fp8.quantize_folder(tiny_llama_dir, tmp_path / "gptq", "gptq", windows, progress=lambda m: None)
    stored = load_file(str(out / "model.safetensors"))
    amax: dict[int, list[float]] = {}
    for _ in fp8.layer_hessians(
        AutoModelForCausalLM.from_pretrained(tiny_llama_dir).float().eval(), windows, kv_amax=amax
    ):
        pass
    scales = []
    for i, (key, value) in sorted(amax.items()):
        k, v = (stored[f"model.layers.{i}.self_attn.{which}_scale"] for which in "kv")
        assert k.shape == v.shape == () and k.dtype == v.dtype == torch.float32
        assert k.item() == pytest.approx(key / 448, rel=1e-6) and v.item() == pytest.approx(value / 448, rel=1e-6)
        scales.append((k.item(), v.item()))
    assert len(scales) == 3
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config["kv_cache_scheme"] == kv_calibration.KV_CACHE_SCHEME
    fp8_cache = LLM(str(out), dtype="fp32", device="cpu", num_kv_blocks=32, kv_cache_dtype="fp8")
    assert fp8_cache.engine.decoder.runner.kv_scales == scales
    assert len(fp8_cache.generate([{"prompt_token_ids": [1, 2, 3]}])[0].outputs[0].token_ids) > 0
    assert LLM(str(out), dtype="fp32", device="cpu", num_kv_blocks=32).engine.decoder.runner.kv_scales is None
    rtn = fp8.quantize_folder(tiny_llama_dir, tmp_path / "rtn", "rtn", progress=lambda m: None)
    assert not any(name.endswith(("k_scale", "v_scale")) for name in load_file(str(rtn / "model.safetensors")))
    assert "kv_cache_scheme" not in json.loads((rtn / "config.json").read_text())["quantization_config"]


def test_a_model_whose_attention_calibration_does_not_know_gets_no_kv_cache_scales(
    tiny_llama_dir, tmp_path, monkeypatch
):
    """Scales are written only for the model types whose attention the hooks were checked against; another
    folder gets its FP8 weights, no scales and no kv_cache_scheme, and the progress says why."""
    monkeypatch.setattr(kv_calibration, "MODEL_TYPES", frozenset({"qwen3"}))
    said: list[str] = []
    windows = [[(7 * i + j) % 250 for j in range(32)] for i in range(2)]
    out = fp8.quantize_folder(tiny_llama_dir, tmp_path / "gptq", "gptq", windows, progress=said.append)
    stored = load_file(str(out / "model.safetensors"))
    assert any(t.dtype == torch.float8_e4m3fn for t in stored.values())
    assert not any(name.endswith(("k_scale", "v_scale")) for name in stored)
    assert "kv_cache_scheme" not in json.loads((out / "config.json").read_text())["quantization_config"]
    assert any("no KV-cache scales: llama's attention" in line for line in said), said


def test_a_bf16_checkpoint_calibrates_as_its_float32_copy(tiny_llama_dir, tmp_path):
    """gptq keeps a bf16 checkpoint's layers in bf16 and widens each in its turn (and what calibration reads
    besides): the folder is the one made from the same weights stored in float32."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.bfloat16)
    model.save_pretrained(tmp_path / "bf16")
    model.float().save_pretrained(tmp_path / "fp32")
    windows = [[(5 * i + j) % 250 for j in range(32)] for i in range(4)]
    made = {}
    for dtype in ("bf16", "fp32"):
        out = fp8.quantize_folder(tmp_path / dtype, tmp_path / f"out-{dtype}", "gptq", windows, lambda m: None)
        made[dtype] = load_file(str(out / "model.safetensors"))
    projections = [name for name, t in made["fp32"].items() if t.dtype == torch.float8_e4m3fn]
    assert len(projections) == 3 * 7
    for name in projections:
        assert torch.equal(made["bf16"][name].view(torch.uint8), made["fp32"][name].view(torch.uint8)), name
        assert torch.equal(made["bf16"][f"{name}_scale"], made["fp32"][f"{name}_scale"]), name
    assert made["bf16"]["model.layers.0.input_layernorm.weight"].dtype == torch.bfloat16  # the rest as stored


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
def test_a_sharded_checkpoint_is_written_shard_by_shard(tiny_llama_dir, tmp_path):
    """The output keeps the source's shards and indexes each tensor (scales beside their weights), and
    holds what a one-file source gives, for rtn (which loads no model) and gptq."""
    from safetensors import safe_open
    from transformers import LlamaForCausalLM

    sharded = tmp_path / "sharded"
    LlamaForCausalLM.from_pretrained(tiny_llama_dir).save_pretrained(sharded, max_shard_size="200KB")
    shards = sorted(p.name for p in sharded.glob("*.safetensors"))
    assert len(shards) > 1
    windows = [[(7 * i + j) % 250 for j in range(32)] for i in range(4)]
    for method in ("rtn", "gptq"):
        calibration = windows if method == "gptq" else None
        out = fp8.quantize_folder(sharded, tmp_path / method, method, calibration, progress=lambda m: None)
        one = fp8.quantize_folder(tiny_llama_dir, tmp_path / f"{method}-one", method, calibration, lambda m: None)
        assert sorted(p.name for p in out.glob("*.safetensors")) == shards
        weight_map = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
        for shard in shards:
            with safe_open(str(out / shard), "pt") as f:
                assert {n for n, file in weight_map.items() if file == shard} == set(f.keys())
        assert (
            weight_map["model.layers.2.mlp.down_proj.weight_scale"] == weight_map["model.layers.2.mlp.down_proj.weight"]
        )
        mine, theirs = _engine_state(out), _engine_state(one)
        for name, tensor in theirs.items():
            assert torch.equal(tensor.view(torch.uint8), mine[name].view(torch.uint8)), (method, name)


def _quantize(*args: str):
    return CliRunner().invoke(cli, ["models", "quantize", *args])


def test_the_command_writes_a_folder_from_a_text_file(tiny_llama_dir, tmp_path):
    text = tmp_path / "calibration.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 20)
    out = tmp_path / "out"
    result = _quantize(str(tiny_llama_dir), str(out), "--calibration", str(text), "--window-tokens", "64")
    assert result.exit_code == 0, result.output
    assert result.stdout.strip().endswith(str(out)) and (out / "model.safetensors").exists()
    assert "projections quantized (gptq)" in result.stderr


@pytest.mark.parametrize(
    "case,message",
    [
        ("no model", "no model folder for"),
        ("out not empty", "is not an empty folder"),
        ("no such file", "is neither chat nor a text file"),
        ("short file", "fewer than one window"),
        ("not utf-8", "is not UTF-8 text"),
        ("unknown architecture", "could not quantize"),
        ("no safetensors", "has no .safetensors weights"),
        ("not a device", "unknown --device 'gpu0': use cpu, cuda or cuda:N"),
        ("not a gptq device", "unknown --device 'meta': use cpu, cuda or cuda:N"),
        (
            "a missing cuda device",
            "CUDA device(s): use --device cpu or auto"
            if torch.cuda.is_available()
            else "--device cuda was asked for but no CUDA device is visible: use --device cpu",
        ),
        ("too little chat", "fewer than --calibration-windows 1000000 x --window-tokens 512: ask for fewer"),
    ],
)
@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
def test_bad_input_is_one_line_and_exit_2(case, message, tiny_llama_dir, tmp_path):
    text = tmp_path / "calibration.txt"
    text.write_text("a few words")
    model, out, calibration = str(tiny_llama_dir), tmp_path / "out", str(text)
    if case == "no model":
        model = str(tmp_path / "missing")
    elif case == "out not empty":
        out.mkdir()
        (out / "file").write_text("x")
    elif case == "no such file":
        calibration = str(tmp_path / "nope.txt")
    elif case == "not utf-8":
        text.write_bytes(b"\xff\xfe" * 400)
    elif case == "unknown architecture":
        folder = tmp_path / "strange"
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({"model_type": "no-such-model", "vocab_size": 16}))
        model = str(folder)
    elif case == "no safetensors":  # weights only in another format
        folder = tmp_path / "bin-only"
        folder.mkdir()
        for f in tiny_llama_dir.iterdir():
            if f.suffix != ".safetensors":
                (folder / f.name).write_bytes(f.read_bytes())
        (folder / "pytorch_model.bin").write_bytes(b"x")
        text.write_text("The quick brown fox jumps over the lazy dog. " * 200)
        model = str(folder)
    device = {"not a device": "gpu0", "not a gptq device": "meta", "a missing cuda device": "cuda:64"}.get(case, "cpu")
    options = ["--calibration", calibration, "--device", device]
    if case == "too little chat":
        options = ["--calibration", "chat", "--calibration-windows", "1000000"]
    result = _quantize(model, str(out), *options)
    assert result.exit_code == 2, result.output
    assert message in result.stderr and "Traceback" not in result.output
    assert len(result.stderr.strip().splitlines()) == 1


# ---------------------------------------------------------------------------------------------- 4 bits


def _int4_output_error(w, q, scale, zero, group, h) -> float:
    g = w.shape[1] if group == -1 else group
    d = (q.double() - zero.double().repeat_interleave(g, 1)) * scale.double().repeat_interleave(g, 1) - w.double()
    return torch.trace(d @ h.double() @ d.T).item()


@pytest.mark.parametrize("group,symmetric", [(32, True), (64, False), (-1, True)])
def test_4bit_gptq_makes_the_layers_output_error_smaller_than_rtn(group, symmetric):
    from infer.kernels.int4_reference import quantize_rtn

    w = torch.randn(48, 192, generator=torch.Generator().manual_seed(3)) * 0.05
    h = _correlated_hessian(192, seed=4)
    q, scale, zero = fp8.gptq_int4(w, h, group, symmetric)
    rtn = quantize_rtn(w, group, symmetric)
    assert q.dtype == torch.uint8 and int(q.max()) <= 15 and scale.shape == zero.shape == rtn[1].shape
    if symmetric:
        assert (zero == 8).all()
    assert _int4_output_error(w, q, scale, zero, group, h) < 0.5 * _int4_output_error(w, *rtn, group, h)


def test_with_uncorrelated_columns_4bit_gptq_is_round_to_nearest():
    from infer.kernels.int4_reference import quantize_rtn

    w = torch.randn(32, 128, generator=torch.Generator().manual_seed(5))
    h = torch.diag(torch.rand(128, generator=torch.Generator().manual_seed(6)) + 0.5).double()
    for found, expected in zip(fp8.gptq_int4(w, h, 32, False, damp=0.0), quantize_rtn(w, 32, False)):
        assert torch.equal(found, expected)


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
@pytest.mark.parametrize("method,symmetric", [("gptq", True), ("rtn", False), ("gptq", False), ("awq", False)])
def test_a_4bit_folder_generates_as_transformers_reads_it(tmp_path, method, symmetric):
    """The folder is compressed-tensors' own layout: transformers reads it through that package (symmetric:
    this transformers and compressed-tensors pair refuses its own asymmetric zero points) and, for every
    folder, the values it stands for, (q - z) * s, unpacked here into a float checkpoint; infer's greedy
    tokens and logprobs agree with both (the model kit's check)."""
    from safetensors.torch import save_file

    from infer.kernels.int4_reference import unpack_int32
    from infer.testing.model import Checkpoint, Setting, first_mismatch, generate, hf_class, write_checkpoint

    source = write_checkpoint("LlamaForCausalLM", tmp_path / "model").folder
    windows = [[(7 * i + j) % 500 for j in range(32)] for i in range(4)]
    out = fp8.quantize_folder(
        source, tmp_path / method, method, windows if method != "rtn" else None, lambda m: None,
        bits=4, symmetric=symmetric,
    )  # fmt: skip
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    weights = config["config_groups"]["group_0"]["weights"]
    assert config["format"] == "pack-quantized" and weights["num_bits"] == 4 and weights["symmetric"] is symmetric
    group = weights["group_size"]
    stored = load_file(str(out / "model.safetensors"))
    values = {}
    for name, tensor in stored.items():
        if name.endswith("weight_packed"):
            prefix = name.removesuffix("_packed")
            q = unpack_int32(tensor, 1).float()
            zero = unpack_int32(stored[f"{prefix}_zero_point"], 0).float() if not symmetric else torch.full_like(q, 8)
            g = q.shape[1] // stored[f"{prefix}_scale"].shape[1]
            scale = stored[f"{prefix}_scale"].float().repeat_interleave(g, 1)
            values[prefix] = (q - (zero if symmetric else zero.repeat_interleave(g, 1))) * scale
        elif not name.endswith(("weight_scale", "weight_zero_point", "weight_shape", "k_scale", "v_scale")):
            values[name] = tensor
    assert group == 64 and len([n for n in values if "proj" in n]) == 7 * 4  # 64 divides every input here
    norm = "model.layers.0.input_layernorm.weight"
    folded = not torch.equal(stored[norm], load_file(str(source / "model.safetensors"))[norm])
    assert folded == (method == "awq")  # awq's scales divide the norms before the projections they scale
    reference = tmp_path / "reference"
    reference.mkdir()
    (reference / "config.json").write_text((source / "config.json").read_text())
    save_file(values, str(reference / "model.safetensors"), metadata={"format": "pt"})
    results, _ = generate(out, "llama", Setting("tp1", "tp 1"))
    readers = [reference] + ([out] if symmetric and method == "gptq" else [])
    for folder in readers:
        hf = hf_class("LlamaForCausalLM").from_pretrained(folder, dtype=torch.float32).eval()
        mismatch = first_mismatch(Checkpoint("LlamaForCausalLM", folder, hf), results)
        assert mismatch is None, f"{folder.name}: {mismatch.message}"


def test_a_group_size_that_does_not_divide_is_refused(tiny_llama_dir, tmp_path):
    result = _quantize(
        str(tiny_llama_dir), str(tmp_path / "out"), "--method", "rtn", "--bits", "4", "--group-size", "48"
    )
    assert result.exit_code == 2, result.output
    assert (
        "--group-size 48 does not divide the projections' inputs" in result.stderr and "Traceback" not in result.output
    )


def test_awqs_scales_never_make_the_output_error_larger_than_round_to_nearest():
    """With a few salient input channels (large activations), scaling them up before rounding cuts the
    layer's output error; r = 0 (no scaling) is among the candidates, so it is never worse."""
    from infer.kernels.int4_reference import quantize_rtn

    gen = torch.Generator().manual_seed(9)
    x = torch.randn(512, 128, generator=gen)
    x[:, :4] *= 20.0  # salient channels
    h = (x.T @ x / x.shape[0]).double()
    w = torch.randn(64, 128, generator=gen) * 0.05
    s = fp8.awq_scales([w], h, 32)
    assert s.shape == (128,) and s[:4].min() > s[4:].max()

    def error(scales):
        q, scale, zero = quantize_rtn(w.double() * scales, 32, symmetric=False)
        d = (q.double() - zero.double().repeat_interleave(32, 1)) * scale.double().repeat_interleave(32, 1) / scales - w
        return torch.trace(d @ h @ d.T).item()

    assert error(s) < 0.8 * error(torch.ones(128, dtype=torch.float64))


def test_awq_refuses_a_model_whose_norms_it_cannot_fold_into(tmp_path):
    from infer.testing.model import write_checkpoint

    source = write_checkpoint("Gemma2ForCausalLM", tmp_path / "gemma2").folder
    with pytest.raises(ValueError, match="awq folds its scales into the norms.*use --method gptq"):
        fp8.quantize_folder(source, tmp_path / "out", "awq", [[3, 4, 5, 6]], lambda m: None, bits=4)
