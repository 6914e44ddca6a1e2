"""Embeddings (`LLM.embed`, `SamplingParams.pooling`): the real SmolLM2 against HF transformers' hidden states
pooled the same way, and what the engine does with embedding requests beside generating ones. Every built-in
family's tiny checkpoint is checked by the model kit's `test_embeddings_match_hf_transformers`
(tests/testing/test_conformance_kit.py runs it for every built-in model)."""

from __future__ import annotations

import base64
import json
import shutil

import numpy as np
import pytest
import torch

from infer import SamplingParams
from infer.api.errors import RequestError
from infer.api.pooling import PoolingParams, default_pooler, hidden_rows, keep_hidden
from infer.api.request import FinishReason, Request
from infer.core.output import Pooling
from infer.llm import LLM
from infer.plugins.pooler.basic import MeanPooler
from infer.testing.prompts import SMOLLM2_PROMPTS


@pytest.fixture(scope="module")
def smollm2(smollm2_dir):
    with LLM(str(smollm2_dir), attention="torch", dtype="float32", device="cpu", max_num_batched_tokens=16) as llm:
        yield llm


@pytest.fixture(scope="module")
def hf_hidden(smollm2_dir):
    from transformers import AutoTokenizer, LlamaModel

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    model = LlamaModel.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return [model(torch.tensor([tok.encode(p)])).last_hidden_state[0] for p in SMOLLM2_PROMPTS]


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
@pytest.mark.parametrize("pooler", ["last", "mean", "cls"])
def test_smollm2_equals_hf_pooled_within_1e_5(smollm2, hf_hidden, pooler):
    outs = smollm2.embed(SMOLLM2_PROMPTS, PoolingParams(pooler))
    for out, hidden in zip(outs, hf_hidden):
        pooled = {"last": hidden[-1], "mean": hidden.mean(0), "cls": hidden[0]}[pooler]
        want = torch.nn.functional.normalize(pooled, dim=-1)
        assert out.error is None and len(out.outputs.embedding) == 576
        assert float((torch.tensor(out.outputs.embedding) - want).abs().max()) <= 1e-5


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
def test_smollm2_unnormalized_is_the_raw_pool(smollm2, hf_hidden):
    out = smollm2.embed(SMOLLM2_PROMPTS[0], PoolingParams("mean", normalize=False))[0]
    torch.testing.assert_close(torch.tensor(out.outputs.embedding), hf_hidden[0].mean(0), rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
def test_embedding_requests_share_steps_with_generation(smollm2):
    """One batch of generating and embedding requests: the generated tokens are those of the generation alone,
    and each embedding that of the embedding alone."""
    greedy = SamplingParams(max_tokens=8, temperature=0)
    alone = [o.outputs[0].token_ids for o in smollm2.generate(SMOLLM2_PROMPTS, greedy)]
    embeds = [o.outputs.embedding for o in smollm2.embed(SMOLLM2_PROMPTS)]
    pooled = SamplingParams(max_tokens=1, temperature=0, pooling=PoolingParams())
    mixed = smollm2.generate(SMOLLM2_PROMPTS * 2, [greedy] * len(SMOLLM2_PROMPTS) + [pooled] * len(SMOLLM2_PROMPTS))
    assert [o.outputs[0].token_ids for o in mixed[: len(SMOLLM2_PROMPTS)]] == alone
    for o, e in zip(mixed[len(SMOLLM2_PROMPTS) :], embeds):
        np.testing.assert_allclose(o.embedding, e, atol=1e-6)


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
def test_preempted_embedding_keeps_what_it_computed(tiny_llama_dir, monkeypatch):
    """A KV cache too small for every request at once: embedding requests are preempted and computed again
    (recompute) keeping the rows they had, and the embeddings still equal those of a roomy cache."""
    import infer.runtime.runner as runner

    recomputed = []

    def counting(request, start, num_tokens):
        if request.params.pooling is not None and start < request.num_pooled_rows:
            recomputed.append(request.request_id)
        return hidden_rows(request, start, num_tokens)

    monkeypatch.setattr(runner, "hidden_rows", counting)
    prompts = [[5 + i + j for j in range(30)] for i in range(6)]
    params = SamplingParams(max_tokens=1, temperature=0, pooling=PoolingParams("mean"))
    gen = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    options = dict(device="cpu", dtype="float32", attention="torch")
    with LLM(str(tiny_llama_dir), **options) as llm:
        want = [o.embedding for o in llm.generate(prompts, params)]
    with LLM(
        str(tiny_llama_dir), num_kv_blocks=24, block_size=4, max_model_len=64, max_num_batched_tokens=8, **options
    ) as llm:
        outs = llm.generate(prompts * 2, [gen] * 6 + [params] * 6)
        assert recomputed, "no embedding request was computed again: the cache was roomy enough, nothing was tested"
    for o, w in zip(outs[6:], want):
        np.testing.assert_allclose(o.embedding, w, atol=1e-6)


def test_bad_pooling_is_refused_with_the_fix(smollm2):
    out = smollm2.embed(["a", "b"], [PoolingParams("median"), PoolingParams()])
    assert "unknown pooler 'median'" in out[0].error and "mean" in out[0].error
    assert out[1].error is None and out[1].outputs.embedding
    assert "Matryoshka" in smollm2.embed("a", PoolingParams(dimensions=8))[0].error
    with pytest.raises(RequestError, match="n=1, max_tokens=1"):
        SamplingParams(max_tokens=4, pooling=PoolingParams())
    with pytest.raises(RequestError, match="dimensions"):
        SamplingParams(max_tokens=1, pooling=PoolingParams(dimensions=0))
    with pytest.raises(RequestError, match="one per prompt"):
        smollm2.embed(["a", "b"], [PoolingParams()])


def test_sentence_transformers_folder_sets_pooler_and_matryoshka(tiny_llama_dir, tmp_path):
    """A folder saved by sentence-transformers names its pooling (modules.json -> 1_Pooling/config.json), and
    a Matryoshka config lets `dimensions` cut the vector before it is normalized."""
    folder = tmp_path / "st"
    shutil.copytree(tiny_llama_dir, folder)
    (folder / "1_Pooling").mkdir()
    (folder / "modules.json").write_text(
        json.dumps([{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                    {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}])
    )  # fmt: skip
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "matryoshka_dimensions": [16, 32]}))
    assert default_pooler(folder) == ("mean", "") and default_pooler(tiny_llama_dir) == ("last", "")
    options = dict(device="cpu", dtype="float32", attention="torch")
    with LLM(str(folder), **options) as llm:
        default, mean, raw = (
            llm.embed("hello there", p)[0].outputs.embedding
            for p in (PoolingParams(), PoolingParams("mean"), PoolingParams("mean", normalize=False))
        )
        cut = llm.embed("hello there", PoolingParams(dimensions=16))[0].outputs.embedding
        assert "have 64" in llm.embed("hello there", PoolingParams(dimensions=65))[0].error
    assert default == mean
    np.testing.assert_allclose(cut, torch.nn.functional.normalize(torch.tensor(raw[:16]), dim=-1), atol=1e-6)


def test_base64_of_an_embedding_is_little_endian_float32():
    """What /v1/embeddings' encoding_format=base64 sends (OpenAI's client decodes it with numpy's float32)."""
    from infer.serve.embeddings import encode

    vector = [0.5, -1.25, 3.0]
    assert np.frombuffer(base64.b64decode(encode(vector, "base64")), dtype="<f4").tolist() == vector
    assert encode(vector, "float") == vector


def test_a_folder_asking_for_what_no_pooler_computes_makes_requests_name_one(tmp_path):
    """sentence-transformers' max pooling, two modes at once, or a Dense layer after the pooling: no silent
    fallback to the last token; a request must name a pooler, and is told why."""
    (tmp_path / "1_Pooling").mkdir()
    pooling = {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}
    dense = {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"}
    for modes, modules, says in [
        ({"pooling_mode_max_tokens": True}, [pooling], "pooling_mode_max_tokens"),
        ({"pooling_mode_mean_tokens": True, "pooling_mode_cls_token": True}, [pooling], "pooling_mode_cls_token + "),
        ({"pooling_mode_mean_tokens": True}, [pooling, dense], "Dense"),
    ]:
        (tmp_path / "modules.json").write_text(json.dumps(modules))
        (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(modes))
        default, problem = default_pooler(tmp_path)
        assert default is None and says in problem
        pooling_ = Pooling({"mean": object()}, default, None, problem)
        with pytest.raises(RequestError, match="name a pooler"):
            pooling_.check(PoolingParams())
        pooling_.check(PoolingParams("mean"))  # named: served


def _request(num_rows: int, reason: FinishReason, pooler: str = "mean") -> Request:
    params = SamplingParams(max_tokens=1, temperature=0, pooling=PoolingParams(pooler))
    request = Request("r", [3, 4, 5, 6], params, arrival=0, finish_reason=reason)
    for _ in range(num_rows):
        keep_hidden(request, torch.ones(1, 8))
    return request


def test_an_embedding_that_ends_early_or_whose_pooler_fails_is_an_error_not_a_crash():
    class Broken:
        def pool(self, hidden, token_ids):
            raise ValueError("no good")

    pooling = Pooling({"mean": MeanPooler(), "broken": Broken()})
    vector, error = pooling.embedding(_request(4, FinishReason.LENGTH))
    assert error is None and len(vector) == 8
    vector, error = pooling.embedding(cut := _request(2, FinishReason.CAPACITY))
    assert vector is None and "ended (capacity) with the hidden states of 2 of its 4 prompt tokens" in error
    assert cut.pooled_hidden == []  # its rows are let go
    assert pooling.embedding(_request(2, FinishReason.ABORT)) == (None, None)  # the caller asked for it
    vector, error = pooling.embedding(_request(4, FinishReason.LENGTH, "broken"))
    assert vector is None and error == "pooler 'broken' failed: no good"


@pytest.mark.slow  # over 0.3 s on two cores: left out of the quick loop
def test_embeddings_under_speculative_decoding_are_the_target_s(tmp_path):
    """With a draft model beside the target, an embedding is the target's alone (the draft never computes an
    embedding prompt), while the generating requests in the same batch draft as usual."""
    from infer.testing.decoder import write_tiny_llamas

    target, draft = write_tiny_llamas(tmp_path)
    prompts = [[5 + i + j for j in range(12 + 3 * i)] for i in range(4)]
    pooled = SamplingParams(max_tokens=1, temperature=0, pooling=PoolingParams("mean"))
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    options = dict(device="cpu", dtype="float32", attention="torch", max_num_batched_tokens=16)
    with LLM(str(target), **options) as llm:
        plain = llm.generate(prompts * 2, [greedy] * 4 + [pooled] * 4)
    spec = dict(decoding="speculative", draft=str(draft), num_speculative_tokens=3)
    with LLM(str(target), **options, **spec) as llm:
        drafted = llm.generate(prompts * 2, [greedy] * 4 + [pooled] * 4)
    assert [o.outputs[0].token_ids for o in drafted[:4]] == [o.outputs[0].token_ids for o in plain[:4]]
    for a, b in zip(drafted[4:], plain[4:]):
        assert a.error is None
        np.testing.assert_allclose(a.embedding, b.embedding, atol=1e-6)
