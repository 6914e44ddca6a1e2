"""Where a model first departs from HF transformers: one tp = 1 prefill of the same tokens through both,
with forward hooks on the embedding and on every decoder layer (infer's side: `DecoderStack`), compared
in order; then the next token's logprobs, for the final norm and LM head."""

from __future__ import annotations

import functools
from typing import Any, Sequence

import torch

from infer.api import DecoderStack
from infer.api.request import SamplingParams
from infer.testing.model import LOGPROB_TOLERANCE, Checkpoint

# of the largest |value| in HF's output of that layer: fp32 summation order gives about 1e-6 here
LAYER_TOLERANCE = 1e-4


def _hidden(output: Any, hf: bool) -> torch.Tensor:
    """A layer's output as the hidden state [T, hidden]. HF's: a tensor (first of a tuple in older
    transformers); infer's: a tensor, or a pair (x, residual) that sums to it."""
    if isinstance(output, tuple):
        output = output[0] if hf else functools.reduce(torch.add, [t for t in output if t is not None])
    return output.detach().reshape(-1, output.shape[-1]).float().clone()


def _recorder(store: dict[str, torch.Tensor], key: str, hf: bool) -> Any:
    def hook(module: Any, args: Any, output: Any) -> None:
        if key not in store:  # the prefill; a later forward (none is expected) is not this sequence
            store[key] = _hidden(output, hf)

    return hook


def _watch(embedding: Any, layers: Sequence[Any], store: dict[str, torch.Tensor], hf: bool) -> list[Any]:
    handles = [embedding.register_forward_hook(_recorder(store, "embeddings", hf))]
    handles += [layer.register_forward_hook(_recorder(store, f"layer {i}", hf)) for i, layer in enumerate(layers)]
    return handles


def _hf_states(checkpoint: Checkpoint, ids: list[int]) -> tuple[dict[str, torch.Tensor], int | None, torch.Tensor]:
    """HF's embeddings and layer outputs over `ids` (no layers: none), its layer count, the last logprobs."""
    hf = checkpoint.hf_model
    layers = getattr(hf.get_decoder(), "layers", None)  # an HF decoder's optional attribute: most families have it
    states: dict[str, torch.Tensor] = {}
    handles = _watch(hf.get_input_embeddings(), layers, states, hf=True) if layers is not None else []
    try:
        logprobs = checkpoint.logits(ids)[-1].log_softmax(-1)
    finally:
        for h in handles:
            h.remove()
    return states, None if layers is None else len(layers), logprobs


def _compare(want: torch.Tensor, got: torch.Tensor) -> str | None:
    """None when `got` is `want` within LAYER_TOLERANCE, else how it differs."""
    if want.shape != got.shape:
        return f"its output has shape {tuple(got.shape)}, HF's {tuple(want.shape)}"
    diff = (got - want).abs()
    scale = float(want.abs().max())
    if float(diff.max()) <= LAYER_TOLERANCE * max(scale, 1.0):
        return None
    position = int(diff.amax(-1).argmax())
    return f"max abs diff {float(diff.max()):.3g} at position {position} of {len(want)} (HF's values up to {scale:.3g})"


def _agreeing(k: int) -> str:
    if k == 0:
        return "the embeddings agree"
    return "layer 0 agrees" if k == 1 else f"layers 0-{k - 1} agree"


def locate(checkpoint: Checkpoint, name: str, ids: list[int], plugins: Sequence[Any] = ()) -> str | None:
    """One sentence: the embeddings, the first decoder layer (of how many), or the final norm / LM head
    whose output differs from HF's on a prefill of `ids`; None when none does there."""
    from infer.llm import LLM

    want, num_layers, want_logprobs = _hf_states(checkpoint, ids)
    vocab = int(want_logprobs.numel())
    with LLM(model=str(checkpoint.folder), model_impl=name, plugins=plugins, device="cpu", dtype="float32") as llm:
        model = llm.engine.model
        watched = isinstance(model, DecoderStack) and num_layers is not None
        got: dict[str, torch.Tensor] = {}
        handles = _watch(model.embed_tokens, model.layers, got, hf=False) if watched else []
        try:
            out = llm.generate([ids], SamplingParams(max_tokens=1, temperature=0.0, logprobs=vocab))[0]
        finally:
            for h in handles:
                h.remove()
    if out.error:
        return f"the prefill was rejected: {out.error}"
    reported = out.outputs[0].logprobs[0]
    got_logprobs = torch.tensor([reported.get(t, float("-inf")) for t in range(vocab)])
    logits_diff = float((got_logprobs - want_logprobs).abs().max())
    if not watched:
        verdict = "differ" if logits_diff > LOGPROB_TOLERANCE else "agree"
        why = f"model {name} exposes no embed_tokens and layers (DecoderStack)"
        if num_layers is None:
            why = "HF's model has no list of decoder layers"
        return f"the next token's logprobs {verdict} (by up to {logits_diff:.2e}); no layer can be named: {why}"
    if len(model.layers) != num_layers:
        return f"model {name} has {len(model.layers)} decoder layers where HF's has {num_layers}"
    for k, key in enumerate(["embeddings", *(f"layer {i}" for i in range(num_layers))]):
        if key not in got:
            return f"the {key} module of model {name} was never called (its forward hook saw nothing)"
        problem = _compare(want[key], got[key])
        if problem is None:
            continue
        if k == 0:
            return f"embeddings differ: {problem}"
        return f"layer {k - 1} (of {num_layers}) differs first: {problem}, {_agreeing(k - 1)}"
    if logits_diff > LOGPROB_TOLERANCE:
        return (
            f"final norm / lm head differ: the embeddings and all {num_layers} layers agree, the next token's "
            f"logprobs differ by up to {logits_diff:.2e}"
        )
    return None
