"""LoRA adapters over the live server, as the official `openai` client meets them: listed in /v1/models
under their base, chosen by `model`, loaded and unloaded at runtime while 64 streams run across 4 of
them (only requests made for the unloaded one after it went fail, with a 404), behind --api-key and
off unless allowed."""

from __future__ import annotations

import asyncio
import threading

import httpx
import openai
import pytest
import torch
from conftest import Served

from infer import LLM, LoRARequest, SamplingParams
from infer.serve.app import create_app

NAMES = ("sql", "poet", "chef", "judge", "pirate")
KEY = "sk-lora"


def _write_adapter(base_dir, folder, seed: int, targets: list[str], rank: int) -> None:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, init_lora_weights=False)
    peft_model = get_peft_model(model, config)
    peft_model.save_pretrained(folder)


@pytest.fixture(scope="module")
def adapters(tiny_chat_dir, tmp_path_factory) -> dict[str, str]:
    pytest.importorskip("peft")
    root = tmp_path_factory.mktemp("adapters")
    targets = [["q_proj", "v_proj"], ["o_proj", "down_proj"], ["gate_proj", "up_proj"], ["k_proj", "v_proj", "o_proj"]]
    found = {}
    for i, name in enumerate(NAMES):
        _write_adapter(tiny_chat_dir, root / name, 10 + i, targets[i % len(targets)], 8 if i % 2 else 16)
        found[name] = str(root / name)
    return found


@pytest.fixture(scope="module")
def served(tiny_chat_dir, adapters):
    llm = LLM(
        model=str(tiny_chat_dir), attention="torch", num_kv_blocks=512, max_model_len=256, enable_lora=True,
        max_loras=4, max_num_seqs=64,
    )  # fmt: skip
    loras = [LoRARequest(name, i + 1, adapters[name]) for i, name in enumerate(NAMES[:4])]
    for lora in loras:
        llm.add_lora(lora)
    served = Served(llm)
    yield served, loras
    served.close()


@pytest.fixture(scope="module")
def server(served, live):
    s, loras = served
    app = create_app({"tiny": s.engine}, api_key=KEY, adapters={"tiny": loras}, allow_adapter_updates=True)
    return live(app)


def _offline(s: Served, prompt: str, lora: LoRARequest | None, max_tokens: int = 8) -> str:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return s.offline(lambda llm: llm.generate([prompt], params, lora_request=lora)[0].outputs[0].text)


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
def test_adapters_are_listed_and_chosen_by_model(served, server, adapters):
    s, loras = served
    client = openai.OpenAI(base_url=server.url, api_key=KEY)
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) == {"tiny", *NAMES[:4]}
    assert cards["sql"].parent == "tiny" and cards["sql"].root == adapters["sql"]
    texts = {}
    for model, lora in [("tiny", None), *((lora.lora_name, lora) for lora in loras)]:
        got = client.completions.create(model=model, prompt="The weather today", max_tokens=8, temperature=0)
        assert got.choices[0].text == _offline(s, "The weather today", lora), model
        texts[model] = got.choices[0].text
    assert len(set(texts.values())) == len(texts), texts  # every adapter changes the answer
    chat = client.chat.completions.create(
        model="poet", messages=[{"role": "user", "content": "Hi"}], max_tokens=6, temperature=0
    )
    assert chat.model == "poet" and chat.choices[0].message.content


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
def test_64_streams_across_4_adapters_while_one_is_unloaded_and_another_loaded(served, server, adapters):
    s, loras = served
    names = [lora.lora_name for lora in loras]
    expected = {name: _offline(s, f"Story {name}", lora, 24) for name, lora in zip(names, loras)}
    expected["pirate"] = _offline(s, "Story pirate", LoRARequest("pirate", 99, adapters["pirate"]), 24)
    s.offline(lambda llm: llm.remove_lora("pirate"))  # the offline check served it: the server loads it afresh

    async def stream(client, model: str, started: threading.Event | None = None) -> str:
        out = await client.completions.create(
            model=model, prompt=f"Story {model}", max_tokens=24, temperature=0, stream=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        text = ""
        async for chunk in out:
            if started is not None:
                started.set()
            text += chunk.choices[0].text if chunk.choices else ""
        return text

    async def run():
        client = openai.AsyncOpenAI(base_url=server.url, api_key=KEY, max_retries=0, timeout=120)
        admin = httpx.AsyncClient(base_url=server.root, headers={"Authorization": f"Bearer {KEY}"}, timeout=120)
        started = threading.Event()
        first = [asyncio.create_task(stream(client, names[i % 4], started)) for i in range(64)]
        while not started.is_set():
            await asyncio.sleep(0.01)
        unload = await admin.post("/v1/unload_lora_adapter", json={"lora_name": "chef"})
        load = await admin.post("/v1/load_lora_adapter", json={"lora_name": "pirate", "lora_path": adapters["pirate"]})
        after = [asyncio.create_task(stream(client, m)) for m in ("pirate", "chef", "sql", "pirate")]
        results = await asyncio.gather(*first, *after, return_exceptions=True)
        models = (await client.models.list()).data
        await admin.aclose()
        await client.close()
        return unload, load, results, {m.id for m in models}

    unload, load, results, listed = asyncio.run(run())
    assert unload.status_code == 200 and "removed" in unload.text
    assert load.status_code == 200 and "added" in load.text, load.text
    first, after = results[:64], results[64:]
    failed = [r for r in first if isinstance(r, BaseException)]
    assert not failed, failed[:3]  # every stream started before the unload finished, the unloaded adapter's too
    for i, text in enumerate(first):
        assert text == expected[names[i % 4]], (i, names[i % 4])
    assert after[0] == expected["pirate"] and after[3] == expected["pirate"] and after[2] == expected["sql"]
    assert isinstance(after[1], openai.NotFoundError), after[1]
    assert "'chef' is not served" in str(after[1])
    assert listed == {"tiny", "sql", "poet", "judge", "pirate"}
    s.offline(lambda llm: None)  # commands apply in order: every request's end was applied
    assert s.idle() == (0, False)


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
def test_runtime_updates_answer_only_when_allowed_and_with_the_key(served, live, adapters):
    s, loras = served
    closed = live(create_app({"tiny": s.engine}, api_key=KEY))
    body = {"lora_name": "new", "lora_path": adapters["sql"]}
    assert httpx.post(f"{closed.root}/v1/load_lora_adapter", json=body).status_code == 401
    off = httpx.post(f"{closed.root}/v1/load_lora_adapter", json=body, headers={"Authorization": f"Bearer {KEY}"})
    assert off.status_code == 404 and "--allow-runtime-lora-updating" in off.json()["error"]["message"]


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
def test_bad_loads_and_unloads_are_clear_errors(served, server, tmp_path, adapters):
    headers = {"Authorization": f"Bearer {KEY}"}
    post = lambda path, body: httpx.post(f"{server.root}{path}", json=body, headers=headers, timeout=60)  # noqa: E731
    missing = post("/v1/load_lora_adapter", {"lora_name": "ghost", "lora_path": str(tmp_path)})
    assert missing.status_code == 400 and "adapter_config.json" in missing.json()["error"]["message"]
    taken = post("/v1/load_lora_adapter", {"lora_name": "tiny", "lora_path": adapters["sql"]})
    assert taken.status_code == 400 and "served already" in taken.json()["error"]["message"]
    dora = tmp_path / "dora"
    dora.mkdir()
    (dora / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 8, "use_dora": true}')
    refused = post("/v1/load_lora_adapter", {"lora_name": "dora", "lora_path": str(dora)})
    assert refused.status_code == 400 and "use_dora" in refused.json()["error"]["message"]
    gone = post("/v1/unload_lora_adapter", {"lora_name": "never"})
    assert gone.status_code == 404 and "never" in gone.json()["error"]["message"]
    extra = post("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/x", "surprise": 1})
    assert extra.status_code == 400
    unknown = openai.OpenAI(base_url=server.url, api_key=KEY, max_retries=0)
    with pytest.raises(openai.NotFoundError, match="ghost"):
        unknown.completions.create(model="ghost", prompt="hi", max_tokens=2)


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
def test_a_restarted_engine_serves_the_adapters_loaded_at_runtime_again(tiny_chat_dir, adapters, tmp_path):
    """What --restart-engine replays into the engine built again (`adapters.replay`): every adapter the server
    lists for it; one whose folder went stops being listed."""
    from infer.serve.adapters import replay

    llm = LLM(model=str(tiny_chat_dir), attention="torch", num_kv_blocks=64, max_model_len=128, enable_lora=True)
    s = Served(llm)  # a fresh engine: what a restart builds, without the adapters loaded at runtime
    try:
        models = create_app({"tiny": s.engine}).state.models
        for lora in (LoRARequest("late", 7, adapters["sql"]), LoRARequest("gone", 8, str(tmp_path / "gone"))):
            models.adapters.served[lora.lora_name] = models["tiny"].adapter(lora)
        assert asyncio.run(replay(models, s.engine)) == ["gone"]
        assert list(models.adapters.served) == ["late"]
        assert [x.lora_name for x in s.offline(lambda llm: llm.list_loras())] == ["late"]
    finally:
        s.close()
