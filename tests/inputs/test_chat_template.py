"""The chat path: prompt ids are exactly HF's `apply_chat_template(tokenize=True)`'s, with one BOS when
the template writes it and the tokenizer also adds one; template kwargs, tools, custom templates;
a conversation the template cannot render is that conversation's error only."""

from __future__ import annotations

import shutil

import pytest
import torch
from click.testing import CliRunner

from infer import SamplingParams
from infer.api.errors import ConfigError, RequestError
from infer.bench.report import prepare_prompts
from infer.bench.workloads import load_workload
from infer.cli.main import cli
from infer.llm import LLM

BOS = 1
# BOS written by the template (as Llama 3's does); a user turn after a user turn raises; `+` on a
# missing "content" is an undefined-variable error.
TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}<|system|>{% for t in tools %}{{ t['function']['name'] }};{% endfor %}</s>{% endif %}"
    "{% for m in messages %}"
    "{% if loop.index0 > 0 and m['role'] == messages[loop.index0 - 1]['role'] %}"
    "{{ raise_exception('roles must alternate between user and assistant') }}{% endif %}"
    "{{ '<|' + m['role'] + '|>' + m['content'] + '</s>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% if enable_thinking %}<think>{% endif %}{% endif %}"
)
CUSTOM = "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}answer:"
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
HELLO = [{"role": "user", "content": "Hello there!"}]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather of a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


def _char_tokenizer(template: str | None):
    """One token per character; adds BOS to every encode (a BOS-adding tokenizer)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>"]
    chars = list(" abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,!?:;'\"(){}[]_-\n|<>/=")
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(specials + chars)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", BOS)]
    )
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    hf.add_special_tokens({"additional_special_tokens": specials[3:]})
    hf.chat_template = template
    return hf


def _model_dir(tiny_llama_dir, folder, template):
    shutil.copytree(tiny_llama_dir, folder)
    _char_tokenizer(template).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def chat_dir(tiny_llama_dir, tmp_path_factory):
    return _model_dir(tiny_llama_dir, tmp_path_factory.mktemp("chat") / "model", TEMPLATE)


@pytest.fixture(scope="module")
def hf_tok(chat_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(chat_dir)


@pytest.fixture(scope="module")
def llm(chat_dir):
    with LLM(model=str(chat_dir), attention="torch", dtype="float32", block_size=4) as llm:
        yield llm


def _hf_ids(tok, messages, **kwargs):
    out = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=True, **kwargs)
    return list(out["input_ids"])


def test_the_tokenizer_adds_bos_and_the_old_path_doubled_it(hf_tok):
    assert hf_tok.encode("hi")[0] == BOS
    text = hf_tok.apply_chat_template(HELLO, tokenize=False, add_generation_prompt=True)
    assert hf_tok.encode(text)[:2] == [BOS, BOS]  # encoding the rendered text again: two BOS


def test_chat_ids_are_apply_chat_templates_with_one_bos(llm, hf_tok, chat_dir):
    out = llm.chat(HELLO, GREEDY)[0]
    assert out.error is None
    assert out.prompt_token_ids == _hf_ids(hf_tok, HELLO)
    assert out.prompt_token_ids.count(BOS) == 1 and out.prompt_token_ids[0] == BOS
    # and the continuation is HF transformers' own greedy one on those ids
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(chat_dir, torch_dtype=torch.float32).eval()
    ids = torch.tensor([out.prompt_token_ids])
    ref = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=6,
        min_new_tokens=6,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    assert out.outputs[0].token_ids == ref[0, ids.shape[1] :].tolist()


def test_template_kwargs_and_tools_reach_the_template(llm, hf_tok):
    plain, thinking, tools = (
        llm.chat(HELLO, GREEDY)[0],
        llm.chat(HELLO, GREEDY, chat_template_kwargs={"enable_thinking": True})[0],
        llm.chat(HELLO, GREEDY, tools=TOOLS)[0],
    )
    assert thinking.prompt_token_ids == _hf_ids(hf_tok, HELLO, enable_thinking=True)
    assert hf_tok.decode(thinking.prompt_token_ids).endswith("<|assistant|><think>")
    assert tools.prompt_token_ids == _hf_ids(hf_tok, HELLO, tools=TOOLS)
    assert "get_weather;" in hf_tok.decode(tools.prompt_token_ids)
    assert len({tuple(o.prompt_token_ids) for o in (plain, thinking, tools)}) == 3


def test_a_template_kwarg_may_not_change_the_call(llm):
    with pytest.raises(RequestError, match="may not set tokenize"):
        llm.chat(HELLO, GREEDY, chat_template_kwargs={"tokenize": False})


def test_custom_template_per_call_as_text_or_file(llm, hf_tok, tmp_path):
    expected = _hf_ids(hf_tok, HELLO, chat_template=CUSTOM)
    path = tmp_path / "custom.jinja"
    path.write_text(CUSTOM)
    assert llm.chat(HELLO, GREEDY, chat_template=CUSTOM)[0].prompt_token_ids == expected
    assert llm.chat(HELLO, GREEDY, chat_template=str(path))[0].prompt_token_ids == expected
    assert expected.count(BOS) == 1 and expected != _hf_ids(hf_tok, HELLO)


def test_unrenderable_conversations_get_an_error_and_the_others_run(llm):
    good = [HELLO, [{"role": "user", "content": "Name a color."}]]
    alone = [llm.chat(c, GREEDY)[0].outputs[0].token_ids for c in good]
    two_users = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    no_content = [{"role": "user"}]
    surrogate = [{"role": "user", "content": "a\ud800b"}]
    outs = llm.chat([good[0], two_users, good[1], no_content, "not a conversation", surrogate], GREEDY)
    assert [o.error is None for o in outs] == [True, False, True, False, False, False]
    assert "roles must alternate" in outs[1].error and "\n" not in outs[1].error
    assert "content" in outs[3].error
    assert "lone surrogate" in outs[5].error and len({o.request_id for o in outs}) == len(outs)
    assert [outs[0].outputs[0].token_ids, outs[2].outputs[0].token_ids] == alone
    assert llm.chat(good[1], GREEDY)[0].outputs[0].token_ids == alone[1]  # the engine is still usable


def test_a_model_without_a_chat_template_says_to_pass_one(tiny_llama_dir, tmp_path):
    folder = _model_dir(tiny_llama_dir, tmp_path / "m", None)
    with LLM(model=str(folder), attention="torch", dtype="float32") as plain:
        with pytest.raises(RequestError, match="--chat-template"):
            plain.chat(HELLO, GREEDY)
    with LLM(model=str(folder), attention="torch", dtype="float32", chat_template=CUSTOM) as custom:
        from transformers import AutoTokenizer

        expected = _hf_ids(AutoTokenizer.from_pretrained(folder), HELLO, chat_template=CUSTOM)
        assert custom.chat(HELLO, GREEDY)[0].prompt_token_ids == expected


def test_engine_chat_template_file(chat_dir, hf_tok, tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text(CUSTOM)
    with LLM(model=str(chat_dir), attention="torch", dtype="float32", chat_template=str(path)) as llm:
        assert llm.chat(HELLO, GREEDY)[0].prompt_token_ids == _hf_ids(hf_tok, HELLO, chat_template=CUSTOM)


def test_missing_template_file_fails_before_the_model_loads(chat_dir, monkeypatch):
    import infer.runtime.runners as runners

    monkeypatch.setattr(runners, "build_model", lambda *a, **k: pytest.fail("the model was built"))
    with pytest.raises(ConfigError, match="does not exist"):
        LLM(model=str(chat_dir), attention="torch", chat_template="/no/such/template.jinja")
    result = CliRunner().invoke(
        cli,
        [
            "run",
            "--model",
            str(chat_dir),
            "--attention",
            "torch",
            "--chat-template",
            "/no/such/template.jinja",
            "--prompt",
            "hi",
        ],
    )
    assert result.exit_code == 2, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "/no/such/template.jinja does not exist" in errors[0], result.output
    assert "Traceback" not in result.output


def test_run_chat_workload_has_one_bos(llm, hf_tok):
    workload = load_workload("builtin", 256, 3, 4, 0)
    assert workload.chat
    ids = prepare_prompts(llm.engine, workload)
    assert ids == [_hf_ids(hf_tok, [{"role": "user", "content": p}]) for p in workload.prompts]
    assert all(p.count(BOS) == 1 for p in ids)


def test_a_long_one_line_template_is_text_not_a_path(llm, hf_tok):
    long = CUSTOM.replace("answer:", "answer:" + " " * 400)  # longer than a file name may be
    assert llm.chat(HELLO, GREEDY, chat_template=long)[0].prompt_token_ids == _hf_ids(hf_tok, HELLO, chat_template=long)
