"""Adapters against HF transformers + PEFT: random LoRA adapters on the kit's tiny checkpoint, saved by PEFT's
own `save_pretrained`, and the reference each makes, the adapter merged into a copy of HF's model
(`merge_and_unload`, fp32 on the CPU).

`check_lora` serves three adapters at once through model plugin `name` (ranks 8 and 16, different
target sets, one with rsLoRA scaling and one with a rank_pattern): each adapter's greedy tokens and
logprobs must be its merged model's (teacher-forced, as the model kit checks the base), the base
model's the base checkpoint's, and a batch mixing the three adapters and the base must give each
request the tokens it gets alone, prefills chunked and blocks cached in between (never shared across
adapters, or a request would read another adapter's K/V). With `tp` 2 the same runs on two gloo ranks.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from infer.api.adapters import LoRARequest
from infer.api.request import SamplingParams
from infer.testing.model import PARAMS, PROMPTS, Checkpoint, first_mismatch, one_thread

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj")  # HF names: Llama-style, and Phi-3's fused
MLP = ("gate_proj", "up_proj", "down_proj", "gate_up_proj")


@dataclass(frozen=True, slots=True)
class AdapterRecipe:
    name: str
    rank: int
    targets: tuple[str, ...]  # HF module names, those the model has
    rslora: bool = False
    rank_pattern: tuple[tuple[str, int], ...] = ()


RECIPES = (
    AdapterRecipe("all-r8", 8, ATTENTION + MLP),
    AdapterRecipe("attn-r16-rslora", 16, ATTENTION, rslora=True),
    AdapterRecipe("mlp-r8-pattern", 8, MLP, rank_pattern=(("down_proj", 4),)),
)


def linear_names(model: Any) -> set[str]:
    """The HF names of the linear projections inside the decoder layers (no head)."""
    return {
        n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and ".layers." in n
    }


def write_adapter(checkpoint: Checkpoint, recipe: AdapterRecipe, folder: Path, seed: int) -> Checkpoint:
    """A random PEFT LoRA adapter of `recipe` on `checkpoint`'s model, saved in `folder` by PEFT, and its
    reference: the adapter merged into a copy of HF's model."""
    from peft import LoraConfig, get_peft_model

    names = linear_names(checkpoint.hf_model)
    targets = sorted(t for t in recipe.targets if t in names)
    config = LoraConfig(
        r=recipe.rank,
        lora_alpha=2 * recipe.rank,
        target_modules=targets,
        lora_dropout=0.0,
        use_rslora=recipe.rslora,
        rank_pattern=dict(recipe.rank_pattern),
        init_lora_weights=False,  # B random too: an adapter that changes the outputs
    )
    torch.manual_seed(seed)
    model = get_peft_model(copy.deepcopy(checkpoint.hf_model), config)
    with torch.no_grad():  # PEFT's random init moves these tiny models too far for near-tie-free greedy tokens
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.mul_(0.5)
    model.save_pretrained(folder)
    merged = model.merge_and_unload().eval()
    return Checkpoint(checkpoint.architecture, checkpoint.folder, merged)


def check_lora(checkpoint: Checkpoint, name: str, tmp: Path, tp: int = 1, plugins: Sequence[Any] = ()) -> None:
    from infer.llm import LLM

    where = f"model {name} ({checkpoint.architecture}: {checkpoint.describe()}; tp {tp})"
    adapters = []
    for i, recipe in enumerate(RECIPES):
        reference = write_adapter(checkpoint, recipe, tmp / recipe.name, seed=100 + i)
        adapters.append((LoRARequest(recipe.name, i + 1, str(tmp / recipe.name)), reference))
    prompts = PROMPTS["plain"]
    options = dict(
        device="cpu", dtype="float32", tensor_parallel_size=tp, enable_lora=True, max_loras=3, max_lora_rank=16,
        block_size=4, max_num_batched_tokens=16,
    )  # fmt: skip
    with one_thread(), LLM(model=str(checkpoint.folder), model_impl=name, plugins=plugins, **options) as llm:
        alone: dict[str | None, list[list[int]]] = {}
        for lora, reference in [(None, checkpoint), *adapters]:
            label = "the base model" if lora is None else f"adapter {lora.lora_name}"
            outputs = llm.generate(prompts, PARAMS, lora_request=lora)
            mismatch = first_mismatch(reference, list(zip(prompts, outputs)))
            if mismatch is not None:
                raise AssertionError(
                    f"{where}, {label}: differs from HF transformers + PEFT (merged): {mismatch.message}"
                )
            alone[None if lora is None else lora.lora_name] = [o.outputs[0].token_ids for o in outputs]
        changed = [lora.lora_name for lora, _ in adapters if alone[lora.lora_name] == alone[None]]
        if changed:
            raise AssertionError(f"{where}: adapters {changed} change no token: the check would not see them applied")
        # every prompt under every adapter and the base, interleaved, in one batch
        loras: list[LoRARequest | None] = [None, *(lora for lora, _ in adapters)]
        batch = [(p, lora) for i, p in enumerate(prompts) for lora in loras[i % 4 :] + loras[: i % 4]]
        params = SamplingParams(max_tokens=PARAMS.max_tokens, temperature=0.0, ignore_eos=True)
        mixed = llm.generate([p for p, _ in batch], params, lora_request=[lora for _, lora in batch])
        for (prompt, lora), out in zip(batch, mixed):
            key = None if lora is None else lora.lora_name
            want = alone[key][prompts.index(prompt)]
            if out.error or out.outputs[0].token_ids != want:
                raise AssertionError(
                    f"{where}: in a batch mixing 3 adapters and the base, {key or 'the base model'}'s request of "
                    f"{len(prompt)} tokens gave {out.error or out.outputs[0].token_ids}, alone {want}"
                )
