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
import json
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
    alpha_pattern: tuple[tuple[str, float], ...] = ()


RECIPES = (
    AdapterRecipe("all-r8", 8, ATTENTION + MLP),
    AdapterRecipe("attn-r16-rslora", 16, ATTENTION, rslora=True),
    # PEFT's patterns: a module name's end, and a full path from the base model's root (anchored)
    AdapterRecipe(
        "mlp-r8-pattern",
        8,
        MLP,
        rank_pattern=(("down_proj", 4),),
        alpha_pattern=(("^model.layers.1.mlp.down_proj", 2),),
    ),
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
        alpha_pattern=dict(recipe.alpha_pattern),
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


def check_lora(
    checkpoint: Checkpoint,
    name: str,
    tmp: Path,
    tp: int = 1,
    plugins: Sequence[Any] = (),
    options: dict[str, Any] | None = None,
) -> None:
    """`options`: engine options over the kit's (the GPU tests run it on CUDA, graphs and kernels on)."""
    from infer.llm import LLM

    where = f"model {name} ({checkpoint.architecture}: {checkpoint.describe()}; tp {tp}{', ' if options else ''}"
    where += f"{', '.join(f'{k}={v}' for k, v in (options or {}).items())})"
    adapters = []
    for i, recipe in enumerate(RECIPES):
        reference = write_adapter(checkpoint, recipe, tmp / recipe.name, seed=100 + i)
        adapters.append((LoRARequest(recipe.name, i + 1, str(tmp / recipe.name)), reference))
    prompts = PROMPTS["plain"]
    settings = {
        **dict(
            device="cpu", dtype="float32", tensor_parallel_size=tp, enable_lora=True, max_loras=3, max_lora_rank=16,
            block_size=4, max_num_batched_tokens=16,
        ),
        **(options or {}),
    }  # fmt: skip
    with one_thread(), LLM(model=str(checkpoint.folder), model_impl=name, plugins=plugins, **settings) as llm:
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


PEFT_NAMES = {  # our target's pieces -> PEFT module paths under a decoder layer
    "q_proj": "self_attn.q_proj",
    "k_proj": "self_attn.k_proj",
    "v_proj": "self_attn.v_proj",
    "o_proj": "self_attn.o_proj",
    "gate_proj": "mlp.gate_proj",
    "up_proj": "mlp.up_proj",
    "down_proj": "mlp.down_proj",
}


def write_random_adapter(model_config: Any, folder: Path, rank: int = 16, seed: int = 0, scale: float = 0.01) -> Path:
    """A PEFT LoRA folder of random weights on every projection of every layer of a model of `model_config`
    (an `infer.api.config.ModelConfig`: a named shape's, dummy weights too), as PEFT's save_pretrained lays it
    out: for benchmarks at real shapes, where no trained adapter is at hand."""
    from safetensors.torch import save_file

    c = model_config
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    shapes = {  # piece -> (in, out)
        "q_proj": (c.hidden_size, q),
        "k_proj": (c.hidden_size, kv),
        "v_proj": (c.hidden_size, kv),
        "o_proj": (q, c.hidden_size),
        "gate_proj": (c.hidden_size, c.intermediate_size),
        "up_proj": (c.hidden_size, c.intermediate_size),
        "down_proj": (c.intermediate_size, c.hidden_size),
    }
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(c.num_layers):
        for piece, (n_in, n_out) in shapes.items():
            prefix = f"base_model.model.model.layers.{layer}.{PEFT_NAMES[piece]}"
            tensors[f"{prefix}.lora_A.weight"] = (torch.randn(rank, n_in, generator=g) * scale).to(torch.bfloat16)
            tensors[f"{prefix}.lora_B.weight"] = (torch.randn(n_out, rank, generator=g) * scale).to(torch.bfloat16)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": sorted(shapes), "bias": "none"}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return folder
