"""`infer serve`: registered by its plugin without importing a server library, one line naming the extra
when it is missing, per-model options, and two models served by one process (a real subprocess)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import httpx
import pytest
from launchers import free_port  # tests/, on sys.path

from infer.api.errors import ConfigError, PluginNotFoundError
from infer.cli.serve import model_configs, parse_model


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
def test_the_command_is_a_plugins_and_imports_no_server_library():
    done = _python(
        "import sys\n"
        "from infer.core.registry import PluginRegistry\n"
        "from infer.cli.main import cli\n"
        "registry = PluginRegistry.load()\n"
        "for impl in registry.manager.hook.infer_register_commands.get_hookimpls():\n"
        "    impl.function(cli)\n"
        "print('serve' in cli.commands, [m for m in ('fastapi', 'uvicorn', 'prometheus_client') if m in sys.modules])\n"
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[0] == "True []"


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
def test_without_the_extra_it_stops_with_one_line_naming_it():
    done = _python(
        "import sys\n"
        "sys.modules['fastapi'] = None  # as if not installed\n"
        "sys.argv = ['infer', 'serve', '--model', 'smollm2-135m']\n"
        "from infer.cli.main import main\n"
        "main()\n"
    )
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "pip install 'infer[serve]'" in lines[0] and lines[0].startswith("error: ")


def test_model_options_syntax():
    spec = parse_model("llama3-8b:load_format=dummy,attention=torch,name=llama,num-kv-blocks=64")
    assert spec.name == "llama"
    assert spec.changes == {"model": "llama3-8b", "load_format": "dummy", "attention": "torch", "num_kv_blocks": 64}
    assert parse_model("/models/a:b").changes == {"model": "/models/a:b"}  # a colon with no options is a path's
    configs = model_configs(("smollm2-135m", "smollm2-135m:name=second,block_size=32"), {"attention": "torch"})
    assert list(configs) == ["smollm2-135m", "second"]
    assert configs["second"].block_size == 32 and configs["second"].attention == "torch"
    assert configs["smollm2-135m"].block_size != 32  # the other model's option stays its own
    for bad, words in [
        (("a:attention=torch,prefix",), "FIELD=VALUE"),
        (("a:no_such_field=1",), "no_such_field"),
        (("a:block_size=big",), "block_size"),
        (("a", "a"), "name=OTHER"),
        (("a:model=b",), "before the colon"),
        ((":attention=torch",), "names no model"),
    ]:
        with pytest.raises((ConfigError, PluginNotFoundError), match=words):
            model_configs(bad, {})


def _wait_until_up(server: subprocess.Popen, port: int) -> str:
    """The root URL once `server`'s /health answers 200 (its stderr if it ends first)."""
    root = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        assert server.poll() is None, server.communicate()[1]
        try:
            if httpx.get(f"{root}/health").status_code == 200:
                return root
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "the server did not come up"
        time.sleep(0.2)


@pytest.mark.slow  # a fresh process loads two engines
def test_two_models_served_by_one_process(tiny_chat_dir):
    port, key = free_port(), "k-123"
    tiny = str(tiny_chat_dir)
    command = [
        sys.executable, "-m", "infer.cli.main", "serve", "--attention", "torch", "--max-model-len", "128",
        "--model", f"{tiny}:name=fcfs,num_kv_blocks=16",
        "--model", f"{tiny}:name=static,scheduler=static,num_kv_blocks=24",
        "--port", str(port), "--api-key", key,
    ]  # fmt: skip
    server = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        root = _wait_until_up(server, port)
        auth = {"Authorization": f"Bearer {key}"}
        assert httpx.get(f"{root}/v1/models").status_code == 401
        assert [m["id"] for m in httpx.get(f"{root}/v1/models", headers=auth).json()["data"]] == ["fcfs", "static"]
        body = {"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0, "ignore_eos": True}
        texts = [
            httpx.post(f"{root}/v1/completions", json={**body, "model": m}, headers=auth, timeout=60).json()
            for m in ("fcfs", "static")
        ]
        assert texts[0]["choices"][0]["text"] == texts[1]["choices"][0]["text"]  # one checkpoint, two schedulers
        assert httpx.get(f"{root}/metrics").status_code == 401  # --api-key guards it (no --metrics-public)
        metrics = httpx.get(f"{root}/metrics", headers=auth).text
        assert 'infer_kv_cache_blocks{model="fcfs"} 16.0' in metrics
        assert 'infer_kv_cache_blocks{model="static"} 24.0' in metrics
    finally:
        server.send_signal(signal.SIGINT)
        out, err = server.communicate(timeout=60)
    assert server.returncode == 0, err


@pytest.mark.slow  # a fresh process loads two replicas
def test_data_parallel_replicas_behind_one_server(tiny_chat_dir):
    port = free_port()
    command = [
        sys.executable, "-m", "infer.cli.main", "serve", str(tiny_chat_dir), "--served-model-name", "tiny",
        "--attention", "torch", "--max-model-len", "128", "--num-kv-blocks", "16", "-dp", "2", "--port", str(port),
    ]  # fmt: skip
    server = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        root = _wait_until_up(server, port)
        body = {"model": "tiny", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
        answers = [
            httpx.post(f"{root}/v1/completions", json={**body, "prompt": [5, 6, 7 + i]}, timeout=60).json()
            for i in range(4)
        ]
        assert all(len(a["choices"][0]["text"]) > 0 for a in answers)
        metrics = httpx.get(f"{root}/metrics").text
        assert 'infer_kv_cache_blocks{model="tiny"} 32.0' in metrics  # the replicas' 16 blocks each, summed
        for replica in ("0", "1"):
            assert f'infer_replica_up{{model="tiny",replica="{replica}"}} 1.0' in metrics
        assert 'infer_router_decisions_total{by="load",model="tiny"} 4.0' in metrics
    finally:
        server.send_signal(signal.SIGINT)
        out, err = server.communicate(timeout=60)
    assert server.returncode == 0, err


def test_a_ray_address_without_ray_is_refused():
    from click.testing import CliRunner

    from infer.cli.main import cli
    from infer.cli.serve import serve

    if "serve" not in cli.commands:  # `infer serve` is a plugin's command, added when `infer` starts
        cli.add_command(serve)
    result = CliRunner().invoke(cli, ["serve", "smollm2-135m", "--ray-address", "head:6379"])
    assert result.exit_code == 2
    assert "--ray-address places engines with Ray: add --distributed-executor-backend ray" in result.output


def test_lora_modules_syntax_and_a_bad_adapter_stops_the_start(tiny_chat_dir, tmp_path):
    from infer import EngineConfig, LoRARequest
    from infer.cli.serve import _build_engine, lora_modules

    assert lora_modules(("sql=/a", "chef = /b"), ["tiny"]) == {
        "tiny": [LoRARequest("sql", 1, "/a"), LoRARequest("chef", 2, "/b")]
    }
    two = ["llama", "qwen"]
    assert lora_modules(('{"name": "sql", "path": "/a", "base_model_name": "qwen"}',), two) == {
        "qwen": [LoRARequest("sql", 1, "/a")]
    }
    for specs, served, words in [
        (("sql",), ["tiny"], "NAME=PATH"),
        (("sql=",), ["tiny"], "both the name and the folder"),
        (("sql=/a",), two, "base_model_name"),
        (('{"name": "sql", "path": "/a", "base_model_name": "gpt"}',), two, "'gpt' is not served"),
        (("sql=/a", "sql=/b"), ["tiny"], "taken already"),
        (("tiny=/a",), ["tiny"], "taken already"),
        (('{"name": "sql"}',), ["tiny"], "JSON with name, path"),
    ]:
        with pytest.raises(ConfigError, match=words):
            lora_modules(specs, served)
    config = EngineConfig(
        model=str(tiny_chat_dir), attention="torch", enable_lora=True, max_model_len=64, num_kv_blocks=16
    )
    with pytest.raises(ConfigError, match=r"--lora-modules ghost=.*adapter_config\.json"):
        _build_engine(config, (LoRARequest("ghost", 1, str(tmp_path)),))
