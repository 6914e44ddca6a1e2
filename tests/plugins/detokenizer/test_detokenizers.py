import random
import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from infer.api import DetokenizedDelta, DeviceWaits
from infer.api.request import Request, SamplingParams
from infer.plugins.detokenizer import parallel, sequential
from infer.plugins.detokenizer.parallel import ParallelDetokenizer
from infer.plugins.detokenizer.sequential import SequentialDetokenizer

DETOKENIZERS = {"sequential": SequentialDetokenizer, "parallel": ParallelDetokenizer}
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
WORDS = (
    "the cat sat on mat and then ran away from dog who was very happy today "
    "hello world café naïve über straße 猫 犬 日本語 中文 字 한국어 😀 🎉 👍🏽 🇫🇷 ∑ → ½"
).split()
MULTIBYTE = "é猫日本語😀🎉👍🏽🇫🇷∑→½한"
TEXT = st.text(
    alphabet=st.one_of(
        st.characters(blacklist_categories=("Cs",), blacklist_characters="\ufffd"),
        st.sampled_from(MULTIBYTE),
    ),
    max_size=40,
)


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map, which ByteLevel BPE tokens are spelled in."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    """A tiny SmolLM2-like byte-level BPE: no normalizer, no prefix space, ByteLevel decoder."""
    rng = random.Random(0)
    lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 14))) for _ in range(400)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=700,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(lines, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=SPECIALS[0], clean_up_tokenization_spaces=False)


@pytest.fixture(params=sorted(DETOKENIZERS))
def make(request, tokenizer):
    built = []

    def build():
        built.append(DETOKENIZERS[request.param](tokenizer))
        return built[-1]

    yield build
    for d in built:
        d.close()


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def decode(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True)


def new_request(rid: str = "r", prompt: list[int] | None = None, stop: list[str] | None = None) -> Request:
    return Request(request_id=rid, prompt_token_ids=prompt or [], params=SamplingParams(stop=stop), arrival=0)


def stream(detok, request: Request, ids: list[int], sizes: list[int]):
    """Submit `ids` in chunks of `sizes` (cycled) until done or stopped: (texts seen, ends, last delta)."""
    texts, ends, end, k, delta = [], [], 0, 0, None
    while end < len(ids):
        end = min(len(ids), end + sizes[k % len(sizes)])
        k += 1
        detok.submit([(request, ids[:end])])
        delta = detok.collect()[request.request_id]
        texts.append(delta.text)
        ends.append(end)
        if delta.stop_index is not None:
            break
    return texts, ends, delta


def reference(tokenizer, ids: list[int], stops: list[str]) -> tuple[str, int | None]:
    """The first token whose text holds a stop string; cut before the earliest one in that text."""
    for i in range(len(ids)):
        text = decode(tokenizer, ids[: i + 1])
        found = [text.find(s) for s in stops if s in text]
        if found:
            return text[: min(found)], i
    return decode(tokenizer, ids), None


def check_stream(tokenizer, texts, ends, ids) -> None:
    for text, end in zip(texts, ends):
        assert not text.endswith("\ufffd")
        assert decode(tokenizer, ids[:end]).startswith(text)


# --------------------------------------------------------------------------- text


def test_registers_both():
    names = {}
    for module in (sequential, parallel):
        module.infer_register_detokenizers(lambda name, factory: names.setdefault(name, factory))
    assert names == DETOKENIZERS


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompt=TEXT, text=TEXT, sizes=st.lists(st.integers(1, 4), min_size=1, max_size=5))
def test_streaming_equals_decode(make, tokenizer, prompt, text, sizes):
    detok = make()
    ids = encode(tokenizer, text)
    texts, ends, delta = stream(detok, new_request(prompt=encode(tokenizer, prompt)), ids, sizes)
    check_stream(tokenizer, texts, ends, ids)
    if ids:
        assert delta.text == decode(tokenizer, ids) == text
        assert delta.stop_index is None


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_arbitrary_token_ids_equal_decode(make, tokenizer, data):
    """Raw bytes in any order (invalid UTF-8 included) and special tokens in between."""
    vocab = len(tokenizer)
    ids = data.draw(st.lists(st.integers(0, vocab - 1), max_size=30)) + encode(tokenizer, ".")
    prompt = data.draw(st.lists(st.integers(0, vocab - 1), max_size=8))
    sizes = data.draw(st.lists(st.integers(1, 3), min_size=1, max_size=4))
    texts, ends, delta = stream(make(), new_request(prompt=prompt), ids, sizes)
    check_stream(tokenizer, texts, ends, ids)
    assert delta.text == decode(tokenizer, ids)


def test_multibyte_characters_are_held_until_complete(make, tokenizer):
    byte_ids = {b: tokenizer.convert_tokens_to_ids(c) for b, c in bytes_to_unicode().items()}
    ids = [byte_ids[b] for b in "a😀b".encode()]
    texts, _, delta = stream(make(), new_request(), ids, [1])
    assert texts == ["a", "a", "a", "a", "a😀", "a😀b"]
    assert delta.text == "a😀b"


def test_prompt_seeds_the_first_token(make, tokenizer):
    prompt = encode(tokenizer, "Hello")
    ids = encode(tokenizer, " world 猫")
    assert tokenizer.convert_ids_to_tokens(ids[:1]) == ["Ġworld"]
    texts, _, delta = stream(make(), new_request(prompt=prompt), ids, [1])
    assert texts[0] == " world"
    assert delta.text == " world 猫"


def test_prompt_ending_inside_a_character(make, tokenizer):
    byte_ids = {b: tokenizer.convert_tokens_to_ids(c) for b, c in bytes_to_unicode().items()}
    char = "猫".encode()
    prompt = encode(tokenizer, "a cat ") + [byte_ids[char[0]]]
    ids = [byte_ids[b] for b in char[1:]] + encode(tokenizer, " sat")
    for sizes in ([1], [len(ids)]):
        texts, ends, delta = stream(make(), new_request(prompt=prompt), ids, sizes)
        check_stream(tokenizer, texts, ends, ids)
        assert delta.text == decode(tokenizer, ids) == "\ufffd\ufffd sat"


def test_decodes_only_a_window(make, tokenizer):
    detok = make()
    seen: list[int] = []
    inner = detok._decode
    detok._decode = lambda windows: (seen.extend(map(len, windows)), inner(windows))[1]
    ids = encode(tokenizer, " ".join(random.Random(1).choice(WORDS) for _ in range(500)))
    _, _, delta = stream(detok, new_request(prompt=encode(tokenizer, "the cat")), ids, [1, 3, 2])
    assert delta.text == decode(tokenizer, ids)
    assert len(ids) >= 500 and max(seen) <= 12  # prefix (<= 5 seed or last chunk) + unread multibyte run


# --------------------------------------------------------------------------- stop strings


def test_stop_cuts_at_first_occurrence(make, tokenizer):
    ids = encode(tokenizer, "the cat sat on the mat, the cat ran")
    for sizes in ([1], [3], [len(ids)]):
        _, _, delta = stream(make(), new_request(stop=["cat"]), ids, sizes)
        assert delta.text == "the "
        assert delta.stop_index == reference(tokenizer, ids, ["cat"])[1]
        assert "cat" in decode(tokenizer, ids[: delta.stop_index + 1])
        assert "cat" not in decode(tokenizer, ids[: delta.stop_index])


def test_stop_spanning_two_tokens(make, tokenizer):
    ids = encode(tokenizer, "hello world and the dog ran")
    pieces = [decode(tokenizer, [i]) for i in ids]
    k = next(k for k in range(len(ids) - 1) if len(pieces[k]) >= 2 and len(pieces[k + 1]) >= 2)
    stop = pieces[k][-2:] + pieces[k + 1][:2]
    assert not any(stop in p for p in pieces)
    for sizes in ([1], [2], [len(ids)]):
        _, _, delta = stream(make(), new_request(stop=[stop]), ids, sizes)
        assert delta.stop_index == k + 1
        assert delta.text == "".join(pieces[: k + 1])[:-2]


def test_several_stop_strings(make, tokenizer):
    ids = encode(tokenizer, "the dog ran and the cat sat, happy")
    for stops, expected in [
        (["sat", "ran"], "the dog "),
        (["happy", "cat"], "the dog ran and the "),
        (["og ran", "ran", "zebra"], "the d"),  # both complete on " ran": the earlier start wins
    ]:
        for sizes in ([1], [2], [len(ids)]):
            _, _, delta = stream(make(), new_request(stop=stops), ids, sizes)
            assert (delta.text, delta.stop_index) == reference(tokenizer, ids, stops)
            assert delta.text == expected


def test_multibyte_stop_string(make, tokenizer):
    ids = encode(tokenizer, "a dog 😀 and a 猫 here")
    for sizes in ([1], [len(ids)]):
        _, _, delta = stream(make(), new_request(stop=["猫", "😀 a"]), ids, sizes)
        assert (
            (delta.text, delta.stop_index) == reference(tokenizer, ids, ["猫", "😀 a"]) == ("a dog ", delta.stop_index)
        )


def test_stop_found_while_a_character_is_incomplete(make, tokenizer):
    byte_ids = {b: tokenizer.convert_tokens_to_ids(c) for b, c in bytes_to_unicode().items()}
    ids = [byte_ids[b] for b in "xa😀".encode()]
    detok = make()
    detok.submit([(new_request(stop=["a"]), ids[:3])])  # "x", "a", first byte of 😀
    assert detok.collect()["r"] == DetokenizedDelta("x", 1)


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_stop_strings_match_reference(make, tokenizer, data):
    text = data.draw(TEXT.filter(lambda t: len(t) >= 2))
    stops = []
    for _ in range(data.draw(st.integers(1, 3))):
        a = data.draw(st.integers(0, len(text) - 1))
        b = data.draw(st.integers(a + 1, min(len(text), a + 6)))
        stops.append(data.draw(st.sampled_from([text[a:b], "zz~q"])))
    ids = encode(tokenizer, text)
    sizes = data.draw(st.lists(st.integers(1, 5), min_size=1, max_size=4))
    texts, ends, delta = stream(make(), new_request(stop=stops), ids, sizes)
    check_stream(tokenizer, texts, ends, ids)
    assert (delta.text, delta.stop_index) == reference(tokenizer, ids, stops)


def test_stopped_request_is_frozen(make, tokenizer):
    detok = make()
    ids = encode(tokenizer, "the cat sat on the mat")
    req = new_request(stop=["sat"])
    detok.submit([(req, ids)])
    first = detok.collect()["r"]
    detok.submit([(req, ids + encode(tokenizer, " and more"))])
    assert detok.collect()["r"] == first


# --------------------------------------------------------------------------- batches and threads


def test_sequential_and_parallel_agree_on_interleaved_batches(tokenizer):
    rng = random.Random(3)
    requests, outputs = [], {}
    for i in range(16):
        words = [rng.choice(WORDS) for _ in range(rng.randint(5, 30))]
        stop = [rng.choice(WORDS)] if i % 3 == 0 else None
        requests.append(new_request(f"r{i}", encode(tokenizer, rng.choice(WORDS)), stop))
        outputs[f"r{i}"] = encode(tokenizer, " ".join(words))
    detoks = [SequentialDetokenizer(tokenizer), ParallelDetokenizer(tokenizer)]
    sent = {r.request_id: 0 for r in requests}
    live = list(requests)
    try:
        while live:
            updates = []
            for r in rng.sample(live, rng.randint(1, len(live))):
                sent[r.request_id] = min(len(outputs[r.request_id]), sent[r.request_id] + rng.randint(1, 3))
                updates.append((r, outputs[r.request_id][: sent[r.request_id]]))
            for d in detoks:
                d.submit(updates)
            seq, par = (d.collect() for d in detoks)
            assert seq == par
            assert seq.keys() == {r.request_id for r, _ in updates}
            for r, ids in updates:
                delta = seq[r.request_id]
                if delta.stop_index is None:
                    assert delta.text == decode(tokenizer, ids) or decode(tokenizer, ids).endswith("\ufffd")
                if delta.stop_index is not None or len(ids) == len(outputs[r.request_id]):
                    expected = reference(tokenizer, outputs[r.request_id], r.params.stop)
                    assert (delta.text, delta.stop_index) == expected
                    live.remove(r)
                    for d in detoks:
                        d.release(r.request_id)
    finally:
        for d in detoks:
            d.close()


def detokenizer_threads(before: frozenset[int] = frozenset()) -> list[threading.Thread]:
    """The detokenizer workers alive now, but those in `before` (an engine another test left to the
    garbage collector may still hold its own)."""
    return [t for t in threading.enumerate() if t.name.startswith("infer-detokenizer") and t.ident not in before]


def thread_ids() -> frozenset[int]:
    return frozenset(t.ident for t in detokenizer_threads() if t.ident is not None)


@pytest.mark.parametrize("state", ["collected", "started", "queued"])
def test_close_leaves_no_thread(tokenizer, state):
    before = thread_ids()
    waits = DeviceWaits()
    detok = ParallelDetokenizer(tokenizer, waits)
    detok.submit([(new_request(), encode(tokenizer, "hello world"))])
    if state != "queued":
        waits.waiting()  # the job starts in the worker
        assert detokenizer_threads(before)
    if state == "collected":
        assert detok.collect()["r"].text == "hello world"
    detok.release("r")
    detok.close()
    assert not detokenizer_threads(before)


def test_parallel_job_starts_when_the_engine_waits_on_the_device(tokenizer):
    waits = DeviceWaits()
    detok = ParallelDetokenizer(tokenizer, waits)
    ran_in = []
    decode = detok._decode
    detok._decode = lambda windows: (ran_in.append(threading.current_thread().name), decode(windows))[1]
    try:
        detok.submit([(new_request(), encode(tokenizer, "the cat sat"))])
        time.sleep(0.05)
        assert ran_in == []  # not beside the host's launch of the next forward
        waits.waiting()
        assert detok.collect()["r"].text == "the cat sat"
        assert len(ran_in) == 1 and ran_in[0].startswith("infer-detokenizer")
        detok.submit([(new_request(), encode(tokenizer, "the cat sat on"))])
        assert detok.collect()["r"].text == "the cat sat on"  # no wait announced: collect starts it
        assert len(ran_in) == 2 and ran_in[1].startswith("infer-detokenizer")
    finally:
        detok.close()


def test_release_drops_state(make, tokenizer):
    before = thread_ids()
    detok = make()
    detok.submit([(new_request(), encode(tokenizer, "the cat sat"))])
    detok.collect()
    detok.release("r")
    detok.submit([(new_request(), encode(tokenizer, "a dog"))])
    assert detok.collect()["r"].text == "a dog"
    detok.release("r")
    detok.release("never-seen")
    detok.close()
    assert not detokenizer_threads(before)
