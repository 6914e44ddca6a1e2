"""Sampler checks: exact distributions by chi-square, seeds independent of the batch, greedy = argmax.

A sampler class may declare the `SamplingParams` it honours with a class attribute
`supported_params = frozenset({"temperature", "seed"})` (names from `KNOWN_PARAMS`); the kit
tests only those. Without one, every known parameter is tested.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from typing import Any

import torch

from infer.api import SupportedParams
from infer.api.request import Request, SamplingParams

KNOWN_PARAMS = frozenset({"temperature", "top_k", "top_p", "min_p", "seed"})
LOGITS8 = [0.3, 2.0, -1.2, 1.1, 0.0, 1.6, -0.4, 0.8]  # ranks differ from token order
NUM_DRAWS = 10_000
# chi-square critical values at p = 0.001, by degrees of freedom
CHI2_P001 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515, 6: 22.458, 7: 24.322}

DISTRIBUTION_CASES = {
    "temperature": SamplingParams(temperature=0.7),
    "top_k": SamplingParams(temperature=1.5, top_k=3),
    "top_p": SamplingParams(top_p=0.7),
    "min_p": SamplingParams(min_p=0.15),
    "combined": SamplingParams(temperature=0.8, min_p=0.05, top_k=5, top_p=0.85),
}
CASE_PARAMS = {  # the parameters a case exercises
    "temperature": {"temperature"},
    "top_k": {"temperature", "top_k"},
    "top_p": {"top_p"},
    "min_p": {"min_p"},
    "combined": {"temperature", "top_k", "top_p", "min_p"},
}
HINTS = {
    "temperature": "are the logits divided by the temperature before the softmax?",
    "top_k": "are all but the k most likely tokens removed (after the temperature)?",
    "top_p": "is the kept set the smallest prefix of tokens by probability whose mass reaches top_p "
    "(the token that crosses top_p is kept)?",
    "min_p": "are tokens whose probability is below min_p times the largest probability removed?",
    "combined": "are the filters applied in vLLM's order: temperature, min-p, top-k, then top-p on the renormalised rest?",
}


def supported_params(factory: Any) -> frozenset[str]:
    declared = factory.supported_params if isinstance(factory, SupportedParams) else None
    return KNOWN_PARAMS if declared is None else frozenset(declared)


def distribution_cases(factory: Any) -> list[str]:
    supported = supported_params(factory)
    return [name for name in DISTRIBUTION_CASES if CASE_PARAMS[name] <= supported]


def make_request(i: int, params: SamplingParams, seed: int = 0, prompt=(0,), output=()) -> Request:
    r = Request(request_id=f"r{i}", prompt_token_ids=list(prompt), params=params, arrival=i, seed=seed)
    r.output_token_ids = list(output)
    return r


def ref_distribution(logits: list[float], p: SamplingParams) -> list[float]:
    # temperature, min-p, top-k, then top-p over the renormalised remainder (vLLM's order)
    scaled = [x / p.temperature for x in logits]
    top = max(scaled)
    weights = [math.exp(s - top) for s in scaled]
    keep = [w >= p.min_p for w in weights]
    order = sorted(range(len(scaled)), key=lambda t: -scaled[t])
    for t in order[p.top_k or len(order) :]:
        keep[t] = False
    total = sum(w for w, k in zip(weights, keep) if k)
    ahead = 0.0
    for t in order:
        if keep[t]:
            keep[t] = p.top_p == 1.0 or ahead < p.top_p
            ahead += weights[t] / total
    weights = [w if k else 0.0 for w, k in zip(weights, keep)]
    return [w / sum(weights) for w in weights]


def chi_square(counts: list[int], probs: list[float]) -> tuple[float, int]:
    n = sum(counts)
    cells = [(c, n * p) for c, p in zip(counts, probs) if p > 0]
    return sum((c - e) ** 2 / e for c, e in cells), len(cells) - 1


def draw(factory: Any, params: SamplingParams, vary: str, device: torch.device | str = "cpu") -> list[int]:
    """NUM_DRAWS samples of LOGITS8: one row per draw, each with its own seed (or position)."""
    if vary == "seed":
        reqs = [make_request(i, params, seed=1_000_003 * i + 17) for i in range(NUM_DRAWS)]
        positions = [5] * NUM_DRAWS
    else:
        reqs = [make_request(i, params, seed=1234) for i in range(NUM_DRAWS)]
        positions = list(range(NUM_DRAWS))
    logits = torch.tensor(LOGITS8, device=device).expand(NUM_DRAWS, 8).contiguous()
    return list(factory(8, torch.device(device)).sample(logits, reqs, positions).token_ids)


def check_distribution(name: str, factory: Any, case: str, vary: str, device: torch.device | str = "cpu") -> None:
    params = DISTRIBUTION_CASES[case]
    probs = ref_distribution(LOGITS8, params)
    counts = Counter(draw(factory, params, vary, device))
    where = (
        f"sampler {name}: {_show(params)}, {NUM_DRAWS} draws from one row of logits "
        f"{LOGITS8}, a different {vary} per draw"
    )
    filtered = sorted(t for t in counts if not 0 <= t < 8 or probs[t] == 0)
    if filtered:
        raise AssertionError(
            f"{where}: drew token(s) {filtered} that the filters remove (reference probability 0); {HINTS[case]}"
        )
    stat, dof = chi_square([counts[t] for t in range(8)], probs)
    if stat >= CHI2_P001[dof]:
        freq = ", ".join(f"{t}: {counts[t] / NUM_DRAWS:.3f} vs {probs[t]:.3f}" for t in range(8))
        raise AssertionError(
            f"{where}: the sampled distribution differs from the reference (chi-square {stat:.1f} >= "
            f"{CHI2_P001[dof]} at p = 0.001, {dof} dof; token: drawn vs expected frequency: {freq}); {HINTS[case]}"
        )


def check_greedy(name: str, factory: Any, device: torch.device | str = "cpu") -> None:
    logits = torch.randn(64, 100, generator=torch.Generator().manual_seed(0)).to(device)
    reqs = [make_request(i, SamplingParams(temperature=0.0), seed=i) for i in range(64)]
    got = list(factory(100, torch.device(device)).sample(logits, reqs).token_ids)
    want = logits.argmax(dim=-1).tolist()
    wrong = [i for i, (g, w) in enumerate(zip(got, want)) if g != w]
    if len(got) != len(want) or wrong:
        i = wrong[0] if wrong else 0
        raise AssertionError(
            f"sampler {name}: temperature=0 must pick the argmax of each row; row {i} of 64 got token "
            f"{got[i] if i < len(got) else 'none'} but the argmax is {want[i]} ({len(wrong)} rows differ, "
            f"{len(got)} tokens returned for 64 rows)"
        )


def _show(params: SamplingParams) -> str:
    fields = [f"temperature={params.temperature}"]
    fields += [
        f"{k}={value}"
        for k, value, off in (("top_k", params.top_k, 0), ("top_p", params.top_p, 1.0), ("min_p", params.min_p, 0.0))
        if value != off
    ]
    return f"SamplingParams({', '.join(fields)})"


def seeded_requests(factory: Any, n: int, vocab: int, seed: int) -> tuple[torch.Tensor, list[Request], list[int]]:
    """n sampled (temperature > 0) requests using only the parameters the sampler supports."""
    supported, rnd = supported_params(factory), random.Random(seed)
    reqs = []
    for i in range(n):
        params = SamplingParams(
            temperature=rnd.choice([0.5, 1.0, 1.3]) if "temperature" in supported else 1.0,
            top_k=rnd.choice([0, 3, 10]) if "top_k" in supported else 0,
            top_p=rnd.choice([1.0, 0.9, 0.5]) if "top_p" in supported else 1.0,
            min_p=rnd.choice([0.0, 0.1]) if "min_p" in supported else 0.0,
        )
        output = [rnd.randrange(vocab) for _ in range(rnd.randrange(0, 8))]
        reqs.append(make_request(i, params, seed=rnd.getrandbits(63), output=output))
    logits = torch.randn(n, vocab, generator=torch.Generator().manual_seed(seed)) * 2
    positions = [len(r.output_token_ids) + rnd.randrange(3) for r in reqs]
    return logits, reqs, positions


def check_seeds(name: str, factory: Any, device: torch.device | str = "cpu") -> None:
    vocab = 50
    logits, reqs, positions = seeded_requests(factory, 8, vocab, seed=3)
    logits = logits.to(device)
    sampler = factory(vocab, torch.device(device))
    batch = list(sampler.sample(logits, reqs, positions).token_ids)
    rule = (
        "seeded sampling must depend only on the request's seed, its position and its logits row, "
        "never on the other rows: derive each row's randomness from requests[i].seed and positions[i]"
    )

    def fail(i: int, got: int, how: str) -> AssertionError:
        r = reqs[i]
        return AssertionError(
            f"sampler {name}: request {r.request_id} (seed {r.seed}, position {positions[i]}) drew "
            f"token {batch[i]} in a batch of 8 but token {got} {how}; {rule}"
        )

    for i in range(8):
        alone = sampler.sample(logits[i : i + 1], [reqs[i]], [positions[i]]).token_ids[0]
        if alone != batch[i]:
            raise fail(i, alone, "when sampled alone")
    for perm_seed in range(3):
        perm = random.Random(perm_seed).sample(range(8), 8)
        permuted = sampler.sample(logits[perm], [reqs[i] for i in perm], [positions[i] for i in perm]).token_ids
        for row, i in enumerate(perm):
            if permuted[row] != batch[i]:
                raise fail(i, permuted[row], f"when the batch is permuted (it sat in row {row})")
    others, other_reqs, other_positions = seeded_requests(factory, 7, vocab, seed=4)
    others = others.to(device)
    for i in range(8):
        rows = torch.cat([others[:5], logits[i : i + 1], others[5:]])
        mixed = sampler.sample(
            rows,
            [*other_reqs[:5], reqs[i], *other_reqs[5:]],
            [*other_positions[:5], positions[i], *other_positions[5:]],
        ).token_ids
        if mixed[5] != batch[i]:
            raise fail(i, mixed[5], "beside seven other requests")
    flat = torch.zeros(40, vocab, device=device)
    streams = {
        "position": ([make_request(i, SamplingParams(), seed=99) for i in range(40)], list(range(40))),
        "seed": ([make_request(i, SamplingParams(), seed=i) for i in range(40)], [0] * 40),
    }
    for varied, (rows_reqs, rows_positions) in streams.items():
        distinct = len(set(sampler.sample(flat, rows_reqs, rows_positions).token_ids))
        if distinct <= 15:
            raise AssertionError(
                f"sampler {name}: 40 draws from a uniform distribution over {vocab} tokens, one per {varied}, gave only "
                f"{distinct} distinct tokens; each (seed, position) must start a different random stream"
            )


def check_sample_tokens(name: str, factory: Any, device: torch.device | str = "cpu") -> None:
    """A sampler's optional `sample_tokens` (decode pipelining) must give exactly `sample`'s tokens."""
    vocab = 50
    logits, reqs, positions = seeded_requests(factory, 8, vocab, seed=5)
    greedy = [make_request(8 + i, SamplingParams(temperature=0.0)) for i in range(3)]
    logits = torch.cat([logits, torch.randn(3, vocab, generator=torch.Generator().manual_seed(6))]).to(device)
    reqs, positions = reqs + greedy, positions + [0, 0, 0]
    sampler = factory(vocab, torch.device(device))
    tokens = sampler.sample_tokens(logits, reqs, positions)
    if tokens is None:
        raise AssertionError(
            f"sampler {name}: sample_tokens returned None for a batch without logprobs; it may "
            f"return None only for batches it cannot serve on the device (logprobs asked)"
        )
    expected = sampler.sample(logits, reqs, positions).token_ids
    if tokens.tolist() != list(expected):
        raise AssertionError(
            f"sampler {name}: sample_tokens gave {tokens.tolist()} but sample gave {list(expected)} "
            f"for the same rows: decode pipelining uses sample_tokens, so they must be one computation"
        )
