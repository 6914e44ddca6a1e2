"""Every user error is one line, before the model loads.

A table of bad `infer` invocations (click's CliRunner on `infer.cli.main.cli`) and bad `LLM(...)` options:
each exits 2 (or raises its documented InferError) with exactly one `error: ...` line, no traceback,
and, where the input allows, before any weights are read or initialised. Beside them, the inputs
these checks must not refuse (typed --baseline values, bench axes of numbers) still run.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import click
import pytest
import torch
from click.testing import CliRunner

from infer.api.config import EngineConfig
from infer.api.errors import ConfigError, IncompatiblePluginsError, InferError, ModelLoadError, PluginNotFoundError
from infer.api.request import CompletionOutput, RequestOutput
from infer.bench.progress import ProgressLines
from infer.cli.main import cli
from infer.core.registry import PluginRegistry

NO_DIR = "/no/such/folder"

# name -> (argv after `infer`, a piece of the error line). {tiny}, {tmp} and {files}/... are filled in.
# A case whose argv starts with "run" or "bench" gets --model {tiny} unless it names a model.
CASES: dict[str, tuple[list[str], str]] = {
    # counts and ranges of the run command's own options
    "num-prompts 0": (["run", "--num-prompts", "0"], "'--num-prompts': 0 is not in the range x>=1"),
    "num-prompts -3": (["run", "--num-prompts", "-3"], "'--num-prompts'"),
    "num-prompts abc": (["run", "--num-prompts", "abc"], "'--num-prompts'"),
    "max-tokens 0": (["run", "--max-tokens", "0"], "'--max-tokens'"),
    "max-tokens -1": (["run", "--max-tokens", "-1"], "'--max-tokens'"),
    "n 0": (["run", "--n", "0"], "'--n'"),
    "show -1": (["run", "--show", "-1"], "'--show'"),
    "empty prompt": (["run", "--prompt", "hi", "--prompt", ""], "--prompt 2: empty prompt"),
    "baseline without a name": (["run", "--baseline", "=3"], "no option name"),
    "empty revision": (["run", "--revision", ""], "invalid revision"),
    "unknown model-impl": (["run", "--model-impl", "lama"], "unknown --model-impl 'lama': did you mean 'llama'?"),
    "blank chat template": (["run", "--chat-template", " "], "invalid chat_template"),
    "lone surrogate prompt": (["run", "--prompt", "a\ud800b"], "lone surrogate"),
    "top-p 2": (["run", "--top-p", "2"], "'--top-p'"),
    "top-p 0": (["run", "--top-p", "0"], "'--top-p'"),
    "temperature -1": (["run", "--temperature", "-1"], "'--temperature'"),
    "temperature nan": (["run", "--temperature", "nan"], "temperature"),
    "top-k -2": (["run", "--top-k", "-2"], "'--top-k'"),
    "beam-width 0": (["run", "--beam-width", "0"], "'--beam-width'"),
    "beam-width below n": (["run", "--beam-width", "1", "--n", "2"], "--beam-width 1 is less than --n 2"),
    "length-penalty without beams": (["run", "--length-penalty", "2"], "does nothing without --beam-width"),
    # engine options: EngineConfig.validate, one message per field
    "tp 0": (["run", "--tp", "0"], "tensor_parallel_size=0 (--tp)"),
    "swap-space -1": (["run", "--swap-space", "-1"], "(--swap-space): use a number of GiB >= 0"),
    "block-size 12": (["run", "--block-size", "12"], "power of two"),
    "block-size 0": (["run", "--block-size", "0"], "power of two"),
    "block-size abc": (["run", "--block-size", "abc"], "'--block-size'"),
    "num-kv-blocks 0": (["run", "--num-kv-blocks", "0"], "(--num-kv-blocks): use an integer >= 1"),
    "num-kv-blocks 1": (
        ["run", "--num-kv-blocks", "1"],
        "needs 32: raise --num-kv-blocks to 32, or lower --max-model-len to 16",
    ),
    "num-kv-blocks too few for max-model-len": (["run", "--num-kv-blocks", "4", "--max-model-len", "128"], "needs 8"),
    "max-model-len 0": (["run", "--max-model-len", "0"], "max_model_len=0 (--max-model-len)"),
    "max-model-len -5": (["run", "--max-model-len", "-5"], "max_model_len=-5"),
    "max-model-len past the context": (["run", "--max-model-len", "100000"], "exceeds"),
    "max-num-seqs 0": (["run", "--max-num-seqs", "0"], "(--max-num-seqs)"),
    "max-num-batched-tokens 0": (["run", "--max-num-batched-tokens", "0"], "(--max-num-batched-tokens)"),
    "kv-cache-memory 0": (["run", "--kv-cache-memory", "0"], "(--kv-cache-memory): use a number of GiB > 0"),
    "kv-cache-memory -1": (["run", "--kv-cache-memory", "-1"], "(--kv-cache-memory)"),
    "gpu-memory-utilization 0": (
        ["run", "--gpu-memory-utilization", "0"],
        "(--gpu-memory-utilization): use a fraction in (0, 1]",
    ),
    "gpu-memory-utilization 1.5": (["run", "--gpu-memory-utilization", "1.5"], "(--gpu-memory-utilization)"),
    "num-speculative-tokens 0": (["run", "--num-speculative-tokens", "0"], "(--num-speculative-tokens)"),
    "seed -1": (["run", "--seed", "-1"], "(--seed): use an integer >= 0"),
    "dtype fp8": (["run", "--dtype", "fp8"], "'--dtype'"),
    "load-format gguf": (["run", "--load-format", "gguf"], "'--load-format'"),
    "preemption-mode lazy": (["run", "--preemption-mode", "lazy"], "'--preemption-mode'"),
    "all-reduce magic": (["run", "--all-reduce", "magic"], "'--all-reduce'"),
    "device tpu": (["run", "--device", "tpu"], "unknown --device 'tpu'"),
    "log-level loud": (["--log-level", "loud", "run"], "'--log-level'"),
    "unknown flag": (["run", "--bogus"], "no such option '--bogus'"),
    "unknown command": (["nope"], "no such command 'nope'"),
    # decoders and the options only some of them read
    "exit-layer 0": (["run", "--exit-layer", "0"], "(--exit-layer)"),
    "exit-layer alone": (["run", "--exit-layer", "2"], "--exit-layer 2 does nothing with --decoding autoregressive"),
    "exit-layer with an ngram draft": (
        ["run", "--decoding", "speculative", "--draft", "ngram", "--exit-layer", "2"],
        "does nothing",
    ),
    "early-exit without exit-layer": (
        ["run", "--decoding", "early-exit"],
        "--decoding early-exit needs --exit-layer N",
    ),
    "early-exit past the last layer": (["run", "--decoding", "early-exit", "--exit-layer", "9"], "[1, 3]"),
    "draft without speculative": (
        ["run", "--draft", "ngram"],
        "--draft ngram does nothing with --decoding autoregressive",
    ),
    "speculative without draft": (["run", "--decoding", "speculative"], "needs a draft model"),
    "draft self without exit-layer": (
        ["run", "--decoding", "speculative", "--draft", "self"],
        "--draft self needs --exit-layer N",
    ),
    "draft folder missing": (["run", "--decoding", "speculative", "--draft", NO_DIR], "does not exist"),
    "draft of another vocabulary": (
        ["run", "--decoding", "speculative", "--draft", "{files}/vocab512"],
        "vocabulary of 512",
    ),
    # plugin names: the registry's error, with the closest name
    "sampler misspelled": (["run", "--sampler", "vectorised"], "did you mean 'vectorized'?"),
    "scheduler unknown": (["run", "--scheduler", "lifo"], "valid names are"),
    "attention misspelled": (["run", "--attention", "torhc"], "did you mean 'torch'?"),
    "kv-allocator misspelled": (["run", "--kv-allocator", "pagd"], "did you mean 'paged'?"),
    "detokenizer misspelled": (["run", "--detokenizer", "paralel"], "did you mean 'parallel'?"),
    "decoding misspelled": (["run", "--decoding", "speculativ"], "did you mean 'speculative'?"),
    "prefill-attention unknown": (["run", "--prefill-attention", "nope"], "valid names are"),
    "CUDA-only backend on the CPU": (["run", "--device", "cpu", "--attention", "paged-cuda"], "runs only on cuda"),
    # --baseline: typed values, checked before the first engine
    "baseline value not an integer": (["run", "--baseline", "num_kv_blocks=abc"], "num_kv_blocks takes an integer"),
    "baseline block_size abc": (["run", "--baseline", "block_size=abc"], "block_size takes an integer"),
    "baseline unknown field": (
        ["run", "--baseline", "colour=red"],
        "unknown engine option(s) colour: valid options are",
    ),
    "baseline without =": (["run", "--baseline", "scheduler"], "FIELD=VALUE pairs"),
    "baseline out of range": (["run", "--baseline", "block_size=12"], "power of two"),
    "baseline bool": (["run", "--baseline", "cuda_graphs=maybe"], "cuda_graphs takes true or false"),
    "baseline misspelled plugin": (["run", "--baseline", "sampler=vectorised"], "did you mean 'vectorized'?"),
    "baseline literal": (["run", "--baseline", "preemption_mode=lazy"], "preemption_mode takes one of recompute, swap"),
    # output paths, checked before running
    "json-out into a missing folder": (
        ["run", "--json-out", NO_DIR + "/r.json"],
        "folder /no/such/folder does not exist",
    ),
    "json-out is a folder": (["run", "--json-out", "{tmp}"], "is a directory"),
    "profile-chart into a missing folder": (["run", "--profile-chart", NO_DIR + "/p.png"], "'--profile-chart'"),
    # datasets: read and parsed before the engine is built; JSONL errors name the file's line
    "dataset missing file": (["run", "--dataset", "nope.jsonl"], "cannot read"),
    "dataset unknown name": (["run", "--dataset", "random-256"], "did you mean 'random-256x256'?"),
    "dataset bad JSON": (["run", "--dataset", "{files}/bad.json"], "not valid JSON (line 1"),
    "dataset bad JSONL line": (["run", "--dataset", "{files}/bad.jsonl"], "not valid JSONL (line 4"),
    "dataset bad JSONL item": (["run", "--dataset", "{files}/item.jsonl"], "line 3: expected a string"),
    "dataset max_tokens 0": (["run", "--dataset", "{files}/zero.json"], "item 1: max_tokens must be an integer >= 1"),
    "dataset empty list": (["run", "--dataset", "{files}/empty.json"], "non-empty list"),
    # models
    "model folder missing": (["run", "--model", NO_DIR], "does not exist"),
    "model unknown": (["run", "--model", "llama9-1b"], "unknown model"),
    "shape without weights": (["run", "--model", "llama2-7b"], "--load-format dummy"),
    # bench
    "bench repeat 0": (["bench", "--repeat", "0", "--matrix", "sampler=naive"], "'--repeat'"),
    "bench num-prompts 0": (["bench", "--num-prompts", "0", "--matrix", "sampler=naive"], "'--num-prompts'"),
    "bench unknown axis": (["bench", "--matrix", "colour=red"], "unknown engine option(s) colour"),
    "bench misspelled value": (["bench", "--matrix", "sampler=naive,vectorised"], "did you mean 'vectorized'?"),
    "bench value not an integer": (["bench", "--matrix", "num_kv_blocks=8,abc"], "num_kv_blocks takes an integer"),
    "bench value out of range": (["bench", "--matrix", "block_size=12,16"], "power of two"),
    "bench axis without values": (["bench", "--matrix", "sampler="], "write FIELD=A,B"),
    "bench unknown baseline": (
        ["bench", "--matrix", "sampler=naive", "--baseline", "hf-dynamic"],
        "unknown --baseline hf-dynamic",
    ),
    "bench chart into a missing folder": (
        ["bench", "--matrix", "sampler=naive", "--chart", NO_DIR + "/c.png"],
        "'--chart'",
    ),
    "bench dataset missing": (["bench", "--matrix", "sampler=naive", "--dataset", "nope.jsonl"], "cannot read"),
    "plugins matrix on no device": (["plugins", "--matrix", "--device", "tpu"], "unknown --device 'tpu'"),
}

# inputs that can only be judged once the model is built (the tokenizer counts a prompt's tokens)
AFTER_LOAD: dict[str, tuple[list[str], str]] = {
    "prompt longer than the context": (["run", "--max-model-len", "8", "--dataset", "{files}/long.json"], "shorten"),
}


@pytest.fixture()
def files(tmp_path: Path) -> Path:
    (tmp_path / "bad.json").write_text('[{"prompt": "hi",]')
    (tmp_path / "bad.jsonl").write_text('{"prompt": "a"}\n\n{"prompt": "b"}\n{"prompt": \n')
    (tmp_path / "item.jsonl").write_text('{"prompt": "a"}\n\n{"prompt": 5}\n')
    (tmp_path / "zero.json").write_text(json.dumps(["a", {"prompt": "b", "max_tokens": 0}]))
    (tmp_path / "empty.json").write_text("[]")
    (tmp_path / "long.json").write_text(json.dumps([list(range(3, 40))]))
    (tmp_path / "vocab512").mkdir()  # a draft is checked from its config.json alone
    (tmp_path / "vocab512" / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "vocab_size": 512,
                "hidden_size": 64,
                "intermediate_size": 160,
                "num_hidden_layers": 1,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "max_position_embeddings": 512,
            }
        )
    )
    return tmp_path


@pytest.fixture()
def weight_loads(monkeypatch) -> list[str]:
    """Every weight load or dummy initialisation the builder starts, by kind."""
    import infer.loading.build as build
    import infer.loading.loader as loader

    calls: list[str] = []
    for module in (build, loader):
        load, init = module.load_weights, module.init_dummy_weights
        monkeypatch.setattr(module, "load_weights", lambda *a, _f=load, **k: (calls.append("load"), _f(*a, **k))[1])
        monkeypatch.setattr(
            module, "init_dummy_weights", lambda *a, _f=init, **k: (calls.append("init"), _f(*a, **k))[1]
        )
    return calls


def _argv(args: list[str], tiny: Path, files: Path) -> list[str]:
    subs = {"{tiny}": str(tiny), "{tmp}": str(files)}
    argv = [subs.get(a, a.replace("{files}", str(files))) for a in args]
    command = next((a for a in argv if a in ("run", "bench")), None)
    if command is not None and "--model" not in argv:
        i = argv.index(command) + 1
        argv[i:i] = ["--model", str(tiny)] + (["--no-progress"] if command == "run" else [])
    return argv


def _assert_one_error_line(result: click.testing.Result, expected: str) -> None:
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    lines = result.output.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    assert expected in lines[0], lines[0]


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_bad_invocation_is_one_line_before_any_weights(case, tiny_llama_dir, files, weight_loads):
    args, expected = CASES[case]
    result = CliRunner().invoke(cli, _argv(args, tiny_llama_dir, files))
    _assert_one_error_line(result, expected)
    assert weight_loads == [], f"weights were read before the error: {weight_loads}"


@pytest.mark.parametrize("case", list(AFTER_LOAD), ids=list(AFTER_LOAD))
def test_bad_prompt_is_one_line(case, tiny_llama_dir, files):
    args, expected = AFTER_LOAD[case]
    result = CliRunner().invoke(cli, ["--log-level", "warning", *_argv(args, tiny_llama_dir, files)])
    _assert_one_error_line(result, expected)


def test_the_table_is_large_enough():
    assert len(CASES) + len(AFTER_LOAD) >= 60


# --------------------------------------------------------------------------- the API: LLM(...) options

API_CASES: dict[str, tuple[dict, type[InferError], str]] = {
    "num_kv_blocks as text": (dict(num_kv_blocks="8"), ConfigError, "invalid num_kv_blocks='8' (--num-kv-blocks)"),
    "max_model_len -1": (dict(max_model_len=-1), ConfigError, "invalid max_model_len=-1"),
    "max_model_len 0": (dict(max_model_len=0), ConfigError, "invalid max_model_len=0"),
    "block_size True": (dict(block_size=True), ConfigError, "invalid block_size=True"),
    "block_size 12": (dict(block_size=12), ConfigError, "power of two"),
    "block_size 16.0": (dict(block_size=16.0), ConfigError, "use an integer"),
    "max_num_seqs 0": (dict(max_num_seqs=0), ConfigError, "max_num_seqs=0"),
    "max_num_batched_tokens None": (dict(max_num_batched_tokens=None), ConfigError, "max_num_batched_tokens=None"),
    "gpu_memory_utilization 0": (dict(gpu_memory_utilization=0.0), ConfigError, "gpu_memory_utilization=0.0"),
    "gpu_memory_utilization nan": (
        dict(gpu_memory_utilization=float("nan")),
        ConfigError,
        "gpu_memory_utilization=nan",
    ),
    "kv_cache_memory_gib 0": (dict(kv_cache_memory_gib=0), ConfigError, "kv_cache_memory_gib=0"),
    "swap_space_gib -1": (dict(swap_space_gib=-1.0), ConfigError, "swap_space_gib=-1.0"),
    "swap_space_gib inf": (dict(swap_space_gib=float("inf")), ConfigError, "swap_space_gib=inf"),
    "preemption_mode lazy": (dict(preemption_mode="lazy"), ConfigError, "one of recompute, swap"),
    "load_format gguf": (dict(load_format="gguf"), ConfigError, "one of auto, safetensors, dummy"),
    "cuda_graphs as text": (dict(cuda_graphs="yes"), ConfigError, "cuda_graphs='yes'"),
    "enable_prefix_caching 1": (dict(enable_prefix_caching=1), ConfigError, "(--prefix-caching)"),
    "tensor_parallel_size 0": (dict(tensor_parallel_size=0), ConfigError, "(--tp)"),
    "seed as text": (dict(seed="x"), ConfigError, "seed='x'"),
    "num_speculative_tokens 0": (dict(num_speculative_tokens=0), ConfigError, "num_speculative_tokens=0"),
    "exit_layer 0": (dict(exit_layer=0), ConfigError, "exit_layer=0"),
    "sampler as a number": (dict(sampler=3), ConfigError, "sampler=3"),
    "dtype fp8": (dict(dtype="fp8"), ConfigError, "unknown --dtype 'fp8'"),
    "all_reduce magic": (dict(all_reduce="magic"), ConfigError, "unknown --all-reduce"),
    "unknown option": (dict(colour="red"), ConfigError, "unknown engine option(s) colour"),
    "num_kv_blocks too few": (dict(num_kv_blocks=1), ConfigError, "needs 32"),
    "max_model_len past the context": (dict(max_model_len=100000), ConfigError, "exceeds"),
    "draft without speculative": (dict(draft="ngram"), IncompatiblePluginsError, "does nothing"),
    "exit_layer alone": (dict(exit_layer=2), IncompatiblePluginsError, "does nothing"),
    "draft self without exit_layer": (dict(decoding="speculative", draft="self"), ConfigError, "--exit-layer N"),
    "early-exit without exit_layer": (dict(decoding="early-exit"), ConfigError, "--exit-layer N"),
    "sampler misspelled": (dict(sampler="vectorised"), PluginNotFoundError, "did you mean 'vectorized'?"),
    "model_impl unknown": (dict(model_impl="lama"), PluginNotFoundError, "unknown --model-impl 'lama'"),
    "draft folder missing": (dict(decoding="speculative", draft=NO_DIR), ModelLoadError, "does not exist"),
}


@pytest.mark.parametrize("case", list(API_CASES), ids=list(API_CASES))
def test_bad_llm_option_raises_before_any_weights(case, tiny_llama_dir, weight_loads):
    from infer.llm import LLM

    options, error, expected = API_CASES[case]
    with pytest.raises(error) as caught:
        LLM(model=str(tiny_llama_dir), **options)
    assert expected in str(caught.value) and "\n" not in str(caught.value)
    assert weight_loads == []


@pytest.mark.parametrize(
    "name,text,value",
    [
        ("num_kv_blocks", "64", 64),
        ("num_kv_blocks", "none", None),
        ("max_model_len", " 512 ", 512),
        ("kv_cache_memory_gib", "1.5", 1.5),
        ("cuda_graphs", "no", False),
        ("enable-prefix-caching", "true", True),
        ("pipeline_decode", "None", None),
        ("load_format", "dummy", "dummy"),
        ("sampler", "naive", "naive"),
    ],
)
def test_option_text_converts_by_the_field_type(name, text, value):
    assert EngineConfig.parse_option(name, text, "test") == value


def test_registry_suggests_the_closest_name():
    with pytest.raises(PluginNotFoundError, match="did you mean 'static'"):
        PluginRegistry.load().get("scheduler", "statik")


# --------------------------------------------------------------------------- what must still work


def test_baseline_with_typed_values_runs_and_reports_speedup(tiny_llama_dir, tmp_path):
    data = tmp_path / "prompts.json"
    data.write_text(json.dumps([[5, 6, 7], [9, 10, 11, 12]]))
    out = tmp_path / "run.json"
    result = CliRunner().invoke(
        cli,
        [
            "--log-level",
            "warning",
            "run",
            "--model",
            str(tiny_llama_dir),
            "--no-progress",
            "--dataset",
            str(data),
            "--max-tokens",
            "3",
            "--baseline",
            "num_kv_blocks=64,max_model_len=256,exit_layer=none,cuda_graphs=false",
            "--json-out",
            str(out),
        ],
        catch_exceptions=False,
    )
    assert result.exit_code == 0, result.output
    records = json.loads(out.read_text())["records"]
    assert records[0]["label"].startswith("baseline: ") and "num_kv_blocks=64" in records[0]["label"]
    assert records[0]["config"]["kv_blocks"] == 64 and records[1]["speedup"] > 0


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
def test_bench_matrix_of_numbers_runs(tiny_llama_dir, tmp_path):
    out, data = tmp_path / "bench.json", tmp_path / "prompts.json"
    data.write_text(json.dumps([[5, 6, 7], [9, 10, 11, 12]]))
    result = CliRunner().invoke(
        cli,
        [
            "--log-level",
            "warning",
            "bench",
            "--model",
            str(tiny_llama_dir),
            "--max-model-len",
            "128",
            "--matrix",
            "num_kv_blocks=8,64",
            "--dataset",
            str(data),
            "--max-tokens",
            "2",
            "--json-out",
            str(out),
        ],
        catch_exceptions=False,
    )
    assert result.exit_code == 0, result.output
    runs = json.loads(out.read_text())["runs"]
    assert [r["label"] for r in runs] == ["num_kv_blocks=8", "num_kv_blocks=64"]
    assert [r["config"]["kv_blocks"] for r in runs] == [8, 64]


def test_plugins_matrix_for_cuda_needs_no_gpu():
    result = CliRunner().invoke(cli, ["plugins", "--matrix", "--device", "cuda"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert "combinations of attention x sampler x scheduler x decoding run" in lines[0] and "cuda" in lines[0]
    rows = [line.split() for line in lines[2:] if not line.startswith(("refused", "not checked", "    "))]
    assert ["paged-cuda", "vectorized", "fcfs", "autoregressive"] in rows  # needs a GPU, not this machine's
    if not torch.cuda.is_available():
        assert "(none here)" in lines[0]


def _options(command: click.Command, path: str):
    for param in command.params:
        if isinstance(param, click.Option):
            yield f"{path} {param.opts[0]}", param
    for name, sub in getattr(command, "commands", {}).items():
        yield from _options(sub, f"{path} {name}")


def test_every_option_of_every_command_has_help():
    missing = [where for where, param in _options(cli, "infer") if not (param.help or "").strip()]
    assert missing == []


@pytest.mark.parametrize(
    "flag,names",
    [
        ("--attention", ["torch", "paged-cuda"]),
        ("--kv-allocator", ["paged", "contiguous"]),
        ("--scheduler", ["fcfs", "static"]),
        ("--sampler", ["vectorized", "naive"]),
        ("--decoding", ["autoregressive", "speculative", "early-exit"]),
        ("--detokenizer", ["parallel", "sequential"]),
        ("--prefill-attention", ["torch"]),
    ],
)
def test_slot_flags_list_their_names(flag, names):
    param = next(p for where, p in _options(cli.commands["run"], "run") if where == f"run {flag}")
    assert all(name in param.help for name in names), param.help


# --------------------------------------------------------------------------- progress without a terminal


def _output(tokens: int) -> RequestOutput:
    return RequestOutput("r", None, [1], [CompletionOutput(0, "", list(range(tokens)), "length")], True)


def test_progress_lines_come_every_interval_and_at_the_end():
    now, lines = [0.0], []
    p = ProgressLines("infer", total=4, echo=lines.append, interval_s=5.0, clock=lambda: now[0])
    for t in (1.0, 2.0, 6.0, 7.0):
        now[0] = t
        p(_output(10))
    assert lines == [
        "infer: 3/4 requests, 5.0 out tok/s, 6s elapsed, ETA 2s",
        "infer: 4/4 requests, 5.7 out tok/s, 7s elapsed",
    ]


def test_progress_lines_come_while_no_request_finishes():
    now, lines = [0.0], []
    p = ProgressLines("infer", total=2, echo=lambda text: lines.append(text), interval_s=5.0, clock=lambda: now[0])
    engine = SimpleNamespace(
        requests={"0": SimpleNamespace(output_token_ids=[1] * 30), "1": SimpleNamespace(output_token_ids=[1] * 20)}
    )
    for t in (1.0, 4.0, 5.0, 9.0, 10.0):  # steps; nothing finishes
        now[0] = t
        p.tick(engine)
    assert lines == [
        "infer: 0/2 requests, 10.0 out tok/s, 5s elapsed",
        "infer: 0/2 requests, 5.0 out tok/s, 10s elapsed",
    ]


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
def test_run_without_a_terminal_prints_progress_lines(tiny_llama_dir):
    result = CliRunner().invoke(
        cli,
        [
            "--log-level",
            "warning",
            "run",
            "--model",
            str(tiny_llama_dir),
            "--dataset",
            "random-256x256",
            "--num-prompts",
            "64",
            "--max-tokens",
            "1",
            "--show",
            "0",
            "--max-model-len",
            "512",
        ],
        catch_exceptions=False,
    )
    assert result.exit_code == 0, result.output
    assert "preparing random-256x256: 64 prompts" in result.stderr
    assert "infer: 64/64 requests" in result.stderr
