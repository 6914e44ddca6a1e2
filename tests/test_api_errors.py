"""Bad API calls, table-driven: each raises a one-line RequestError or gives its item an output
with a one-line `error`, and the good prompts beside a bad one come out exactly as they do alone
(same request ids, same tokens, same text). Also abort, the step-by-step calls and two threads."""

from __future__ import annotations

import re
import threading

import pytest

from infer import SamplingParams
from infer.api.errors import InferError, RequestError
from infer.llm import LLM

GOOD = [[5, 6, 7, 8, 9], [10, 11]]
GREEDY = dict(max_tokens=6, temperature=0, ignore_eos=True)
OPTIONS = dict(attention="torch", block_size=4, max_model_len=64)

# (case id, bad prompt, a fragment of its error)
BAD_PROMPTS = [
    ("none", None, "NoneType is not a prompt"),
    ("float", 1.5, "float is not a prompt"),
    ("int", 7, "int is not a prompt"),
    ("bytes", b"hello", "prompt is bytes"),
    ("lone-surrogate", "a\ud800b", "lone surrogate"),
    ("empty-text", "", "empty prompt"),
    ("empty-ids", [], "empty prompt"),
    ("nested-list", [[1, 2], [3]], "item 0 is [1, 2]"),
    ("id-out-of-range", [5, 256], "item 1 is 256"),
    ("negative-id", [5, -1], "item 1 is -1"),
    ("bool-id", [True, 5], "item 0 is True"),
    ("float-id", [5, 6.0], "item 1 is 6.0"),
    ("set", {5, 6}, "set is not a prompt"),
    ("too-long", list(range(3, 67)), "shorten the prompt"),
    ("text-without-tokenizer", "Hello", "has no tokenizer"),
    ("dict-no-key", {}, "exactly one of"),
    ("dict-both-keys", {"prompt": "a", "prompt_token_ids": [5]}, "exactly one of"),
    ("dict-unknown-key", {"prompt_token_ids": [5], "multi_modal_data": {}}, "'multi_modal_data'"),
    ("dict-prompt-not-str", {"prompt": [5, 6]}, "'prompt' must be a string"),
    ("dict-ids-not-list", {"prompt_token_ids": "5 6"}, "must be a list of token ids"),
    ("dict-ids-out-of-range", {"prompt_token_ids": [5, 1000]}, "item 1 is 1000"),
]

# (case id, SamplingParams field values on top of GREEDY, a fragment of the error)
BAD_PARAMS = [
    ("seed-str", dict(seed="x"), "invalid seed='x'"),
    ("seed-bool", dict(seed=True), "invalid seed=True"),
    ("max-tokens-float", dict(max_tokens=1.5), "invalid max_tokens=1.5"),
    ("max-tokens-zero", dict(max_tokens=0), "invalid max_tokens=0"),
    ("temperature-str", dict(temperature="hot"), "invalid temperature='hot'"),
    ("temperature-nan", dict(temperature=float("nan")), "invalid temperature=nan"),
    ("temperature-negative", dict(temperature=-0.5), "invalid temperature=-0.5"),
    ("top-p-zero", dict(top_p=0.0), "invalid top_p=0.0"),
    ("top-p-nan", dict(top_p=float("nan")), "invalid top_p=nan"),
    ("top-k-negative", dict(top_k=-2), "invalid top_k=-2"),
    ("top-k-past-int64", dict(top_k=2**63), "invalid top_k=9223372036854775808"),  # crashed a step (schemathesis)
    ("pooling-not-params", dict(max_tokens=1, pooling={"pooler": "mean"}), "invalid pooling="),
    ("min-p-above-one", dict(min_p=1.5), "invalid min_p=1.5"),
    ("n-zero", dict(n=0), "invalid n=0"),
    ("n-bool", dict(n=True), "invalid n=True"),
    ("repetition-penalty-zero", dict(repetition_penalty=0.0), "invalid repetition_penalty=0.0"),
    ("presence-penalty-big", dict(presence_penalty=3.0), "invalid presence_penalty=3.0"),
    ("frequency-penalty-inf", dict(frequency_penalty=float("inf")), "invalid frequency_penalty=inf"),
    ("stop-int-list", dict(stop=[3]), "token ids go in stop_token_ids"),
    ("stop-empty-string", dict(stop=""), "invalid stop=['']"),
    ("stop-token-negative", dict(stop_token_ids=[-1]), "invalid stop_token_ids=-1"),
    ("stop-token-int", dict(stop_token_ids=5), "invalid stop_token_ids=5"),
    ("ignore-eos-str", dict(ignore_eos="yes"), "invalid ignore_eos='yes'"),
    ("logprobs-negative", dict(logprobs=-1), "invalid logprobs=-1"),
    ("best-of-without-beams", dict(best_of=3), "set use_beam_search=True"),
    ("beam-early-stopping-int", dict(use_beam_search=True, best_of=2, early_stopping=1), "invalid early_stopping=1"),
    ("beam-with-stop", dict(use_beam_search=True, best_of=2, stop=["x"]), "takes no penalties or stop strings"),
]


def one_line(message: str | None) -> str:
    assert message and "\n" not in message and "Traceback" not in message, message
    return message


def outputs(results):
    return [(o.request_id, o.error, [(c.text, c.token_ids, c.finish_reason) for c in o.outputs]) for o in results]


@pytest.fixture(scope="module")
def alone(tiny_llama_dir):
    """GOOD run alone on a fresh engine."""
    return outputs(LLM(model=str(tiny_llama_dir), **OPTIONS).generate(GOOD, SamplingParams(**GREEDY)))


def check_batch(results, alone, fragment: str) -> None:
    """[good, bad, good]: the bad item's error, and the good ones exactly as alone."""
    assert fragment in one_line(results[1].error)
    assert results[1].outputs == [] and results[1].finished
    assert outputs([results[0], results[2]]) == alone


@pytest.mark.parametrize("prompt, fragment", [c[1:] for c in BAD_PROMPTS], ids=[c[0] for c in BAD_PROMPTS])
def test_bad_prompt_is_its_items_error(tiny_llama_dir, alone, prompt, fragment):
    llm = LLM(model=str(tiny_llama_dir), **OPTIONS)
    check_batch(llm.generate([GOOD[0], prompt, GOOD[1]], SamplingParams(**GREEDY)), alone, fragment)
    with pytest.raises(RequestError) as err:  # the step-by-step call raises it instead
        llm.add_request(prompt, SamplingParams(**GREEDY))
    assert fragment in one_line(str(err.value))


@pytest.mark.parametrize("fields, fragment", [c[1:] for c in BAD_PARAMS], ids=[c[0] for c in BAD_PARAMS])
def test_bad_sampling_params(tiny_llama_dir, alone, fields, fragment):
    with pytest.raises(RequestError) as err:  # at construction
        SamplingParams(**{**GREEDY, **fields})
    assert fragment in one_line(str(err.value))
    bad = SamplingParams(**GREEDY)
    for name, value in fields.items():  # set after construction: caught when the request is added
        setattr(bad, name, [value] if name == "stop" and isinstance(value, str) else value)
    good = SamplingParams(**GREEDY)
    llm = LLM(model=str(tiny_llama_dir), **OPTIONS)
    check_batch(llm.generate([GOOD[0], GOOD[0], GOOD[1]], [good, bad, good]), alone, fragment)


@pytest.mark.parametrize(
    "params, fragment",
    [
        ({"max_tokens": 6}, "not dict"),
        ("greedy", "not str"),
        (6, "not int"),
    ],
    ids=["dict", "str", "int"],
)
def test_params_of_the_wrong_type_are_the_items_error(tiny_llama_dir, alone, params, fragment):
    llm = LLM(model=str(tiny_llama_dir), **OPTIONS)
    good = SamplingParams(**GREEDY)
    results = llm.generate([GOOD[0], GOOD[0], GOOD[1]], [good, params, good])
    check_batch(results, alone, fragment)
    assert "SamplingParams(**d)" in results[1].error


def test_logprobs_beyond_the_vocabulary(tiny_llama_dir, alone):
    llm = LLM(model=str(tiny_llama_dir), **OPTIONS)
    good = SamplingParams(**GREEDY)
    check_batch(
        llm.generate([GOOD[0], GOOD[0], GOOD[1]], [good, SamplingParams(**GREEDY, logprobs=300), good]),
        alone,
        "the vocabulary has 256 tokens",
    )


def test_wrong_number_of_params_raises(tiny_llama_dir):
    llm = LLM(model=str(tiny_llama_dir), **OPTIONS)
    with pytest.raises(RequestError) as err:
        llm.generate(GOOD, [SamplingParams(**GREEDY)] * 3)
    assert "got 2 prompts but 3 SamplingParams" in one_line(str(err.value))
    assert isinstance(err.value, InferError)


def test_vllm_prompt_dicts_run_like_plain_prompts(tiny_llama_dir, alone):
    llm = LLM(model=str(tiny_llama_dir), **OPTIONS)
    assert outputs(llm.generate([{"prompt_token_ids": p} for p in GOOD], SamplingParams(**GREEDY))) == alone
    single = llm.generate({"prompt_token_ids": GOOD[1]}, SamplingParams(**GREEDY))  # one dict, not a list
    assert [c.token_ids for c in single[0].outputs] == [alone[1][2][0][1]]


@pytest.mark.slow
def test_text_prompts_beside_bad_ones_on_smollm2(smollm2_dir):
    llm = LLM(model=str(smollm2_dir), attention="torch")
    params = SamplingParams(max_tokens=6, temperature=0)
    good = ["The capital of France is", {"prompt": "Once upon a time"}]
    first = llm.generate(good, params)
    batch = llm.generate([good[0], "bad \ud800", b"bytes", good[1], {"prompt": None}], params)
    assert [o.error is None for o in batch] == [True, False, False, True, False]
    assert all(one_line(o.error) for o in batch if o.error)
    assert [(o.prompt, o.outputs) for o in first] == [(o.prompt, o.outputs) for o in (batch[0], batch[3])]
    assert first[0].outputs[0].text.strip()  # real text, not an empty string on both sides
    # refusals take no id: the good ones are numbered as a batch of two would be
    assert [int(o.request_id) for o in (batch[0], batch[3])] == [
        int(first[1].request_id) + 1,
        int(first[1].request_id) + 2,
    ]


# ------------------------------------------------------------------ abort and step-by-step


def test_abort_unknown_and_finished_ids_are_reported(tiny_llama_dir):
    llm = LLM(model=str(tiny_llama_dir), **OPTIONS)
    for rid in ["nope", "0", 0, ["0"]]:
        with pytest.raises(RequestError, match=re.escape(f"no unfinished request has id {rid!r}")) as err:
            llm.abort(rid)
        one_line(str(err.value))
    (done,) = llm.generate([GOOD[0]], SamplingParams(**GREEDY))
    with pytest.raises(RequestError, match="already finished"):
        llm.abort(done.request_id)


def test_add_request_step_and_abort(tiny_llama_dir, alone):
    llm = LLM(model=str(tiny_llama_dir), **OPTIONS)
    free = llm.engine.scheduler.allocator.num_free_blocks()
    long = llm.add_request(GOOD[0], SamplingParams(max_tokens=50, temperature=0, ignore_eos=True), request_id="long")
    short = llm.add_request(GOOD[1], SamplingParams(**GREEDY))
    with pytest.raises(RequestError, match="already in use"):
        llm.add_request(GOOD[1], SamplingParams(**GREEDY), request_id="long")
    with pytest.raises(RequestError, match="unfinished: step"):  # generate would swallow their outputs
        llm.generate(GOOD, SamplingParams(**GREEDY))
    done = {}
    for _ in range(3):
        done.update((o.request_id, o) for o in llm.step())
    llm.abort(long)
    with pytest.raises(RequestError, match="already finished"):
        llm.abort(long)  # aborted: finished, though its output comes with the next step
    while llm.has_unfinished():
        done.update((o.request_id, o) for o in llm.step())
    assert done[long].outputs[0].finish_reason == "abort" and 0 < len(done[long].outputs[0].token_ids) < 50
    assert [(c.text, c.token_ids, c.finish_reason) for c in done[short].outputs] == alone[1][2]
    assert llm.engine.scheduler.allocator.num_free_blocks() == free


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
def test_abort_from_another_thread_during_generate(tiny_llama_dir):
    llm = LLM(model=str(tiny_llama_dir), **{**OPTIONS, "max_model_len": 512})
    params = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
    results: list = []
    worker = threading.Thread(target=lambda: results.extend(llm.generate([GOOD[0], GOOD[1]], params)))
    worker.start()
    while not (llm.engine.requests.get("0") and llm.engine.requests["0"].output_token_ids):
        assert worker.is_alive(), "generate ended before anything could be aborted"
    llm.abort("0")  # the lock is held by generate: it takes effect at the next step
    worker.join(60)
    first, second = results
    assert first.outputs[0].finish_reason == "abort" and len(first.outputs[0].token_ids) < 400
    assert second.outputs[0].finish_reason == "length" and len(second.outputs[0].token_ids) == 400


def test_two_threads_get_their_single_thread_outputs(tiny_llama_dir):
    llm = LLM(model=str(tiny_llama_dir), **OPTIONS)
    work = {"a": [[5, 6, 7, 8, 9], [3] * 17], "b": [[10, 11], [100, 7, 200, 13, 99, 42], [42]]}
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    single = {k: [o.outputs[0].token_ids for o in llm.generate(p, params)] for k, p in work.items()}
    start, got, errors = threading.Barrier(2), {}, []

    def run(key: str) -> None:
        start.wait()
        try:
            got[key] = [o.outputs[0].token_ids for o in llm.generate(work[key], params)]
        except BaseException as exc:  # reported below, not lost in the thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(k,)) for k in work]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert errors == [] and got == single
