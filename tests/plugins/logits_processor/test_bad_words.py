"""bad_words: a word of one token is banned everywhere, the last token of a word of several only
right after the others (in the output or the draft before the row); on SmolLM2 the words never
appear in the text, greedy or sampled."""

from __future__ import annotations

import pytest
import torch

from infer import SamplingParams
from infer.api import LogitsRow, ProcessorContext
from infer.plugins.logits_processor.bad_words import BadWords
from infer.testing.sampling import make_request

WORDS = ["Paris", "2018"]
PROMPT = "The capital of France is"  # greedy: " Paris.\n\nThe answer is: 2018-01-22 ..."


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


def test_a_word_of_several_tokens_is_banned_only_after_its_prefix(tokenizer):
    paris = {tokenizer.encode(w, add_special_tokens=False)[0] for w in ("Paris", " Paris")}
    year = tokenizer.encode("2018", add_special_tokens=False)
    assert len(paris) == 2 and len(year) == 4  # one token each way; four digits
    *prefix, last = year
    cases = [  # (output, draft) -> the tokens banned besides Paris
        ([], (), set()),
        ([5, *prefix[:2]], (), set()),
        ([5, *prefix], (), {last}),
        ([5, 99, *prefix[1:]], (), set()),
        ([5, prefix[0]], tuple(prefix[1:]), {last}),
        ([], tuple(prefix), {last}),
        (prefix, (7,), set()),
    ]
    processor = BadWords(ProcessorContext(tokenizer, 49152, frozenset({2}), torch.device("cpu")))
    params = SamplingParams(bad_words=WORDS)
    rows = []
    for i, (output, draft, _) in enumerate(cases):
        r = make_request(i, params, output=output)
        rows.append(LogitsRow(i, r, processor.admit(r), draft))
    logits = torch.zeros(len(cases), 49152)
    processor.apply(logits, rows)
    for i, (output, draft, banned) in enumerate(cases):
        got = set(torch.isinf(logits[i]).nonzero().flatten().tolist())
        assert got == paris | banned, (output, draft)


@pytest.mark.slow
def test_bad_words_never_appear_in_the_text(smollm2):
    greedy = dict(max_tokens=24, temperature=0)
    (plain,) = smollm2.generate([PROMPT], SamplingParams(**greedy))
    assert all(w in plain.outputs[0].text for w in WORDS)  # the reference says both
    params = [SamplingParams(**greedy, bad_words=["2018"]), SamplingParams(**greedy, bad_words=WORDS)]
    params += [SamplingParams(max_tokens=24, temperature=1.0, seed=s, bad_words=WORDS) for s in range(4)]
    outputs = smollm2.generate([PROMPT] * len(params), params)
    texts = [o.outputs[0].text for o in outputs]
    assert "2018" not in texts[0] and "Paris" in texts[0], texts[0]
    assert "201" in texts[0]  # the year's first digits are not banned: only its last, after them
    assert not any(w in text for w in WORDS for text in texts[1:]), texts
