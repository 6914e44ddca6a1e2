"""Accepting draft tokens: the greedy rule and rejection sampling (Leviathan et al., 2023).

Notation follows the paper: p is the target's distribution, q the draft's, x the draft tokens.
A row's draft is accepted token by token while u < p(x) / q(x); at the first rejection the next
token is drawn from normalize(max(0, p - q)); when all k are accepted, a bonus token is drawn
from p at position k. The emitted tokens then follow p exactly, whatever q is.

Randomness is counter-based (`sampling.rng`): every draw is a pure function of the request's
seed, the output index it decides and a salt per purpose, so a request's tokens do not depend
on its batch. Each (salt, index) stream is consumed at most once by an emitted token: a proposal
at an index that is later discarded is redrawn with the same counter, but nothing before that
index ever depended on it.

`accept_on_device` applies both rules to a verify step's rows as kernels and brings the outcome
to the host in one copy (the speculative decoder's path for sampled requests and device drafts).
"""

from __future__ import annotations

import torch

from infer.api import DeviceWaits, VerifyingSampler
from infer.api.request import Request
from infer.api.transfer import row_index, to_device
from infer.kernels import rng

DRAFT_SALT = 0x5DEECE66D1F3A7B  # the draft's own draws (x ~ q)
ACCEPT_SALT = 0x2545F4914F6CDD1D  # the uniforms u of the acceptance test
# the residual / bonus draw uses the request's seed itself, so a row with no draft draws the
# token the sampler would have drawn


def salted(seed: int, salt: int) -> int:
    return (seed ^ salt) & (2**63 - 1)


def seed_tensor(seeds: list[int], device: torch.device | str) -> torch.Tensor:
    # -> [R, 2] int64: low, high 32 bits
    return to_device([rng.split_seed(s) for s in seeds], torch.int64, torch.device(device)).reshape(-1, 2)


def uniforms(seeds: torch.Tensor, positions: torch.Tensor, width: int) -> torch.Tensor:
    # seeds: [R, 2]; positions: [R] output index of column 0 -> [R, width] float64 in (0, 1)
    rows = seeds.shape[0]
    cols = torch.arange(width, device=seeds.device)
    key, mult = rng.row_keys(seeds.repeat_interleave(width, dim=0), (positions[:, None] + cols).reshape(-1))
    h = rng.token_hash(key, mult, torch.zeros(1, dtype=torch.int64, device=seeds.device))  # [R * width, 1]
    return h.double().add_(0.5).mul_(2.0**-32).view(rows, width)


def draw(probs: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    # probs: [R, V] (unnormalised is fine); seeds: [R, 2]; positions: [R] -> [R] int64 ~ probs
    # exponential race, as the vectorized sampler draws: argmax(p / E), E ~ Exp(1)
    key, mult = rng.row_keys(seeds, positions)
    noise = rng.exponential(key, mult, torch.arange(probs.shape[1], device=probs.device))
    return (probs / noise).argmax(dim=-1)


def greedy_accept(
    x: torch.Tensor,  # [R, K] draft tokens (padding ignored)
    num_draft: torch.Tensor,  # [R] k per row, <= K
    target: torch.Tensor,  # [R, K + 1] the target's argmax at each position
) -> tuple[torch.Tensor, torch.Tensor]:
    """Longest prefix of x equal to the target's choices, then the target's own next token.

    Returns (num_accepted [R], next_token [R]).
    """
    K = x.shape[1]
    valid = torch.arange(K, device=x.device)[None, :] < num_draft[:, None]
    match = (x == target[:, :K]) & valid
    n = match.int().cumprod(dim=1).sum(dim=1)  # [R]
    return n, target.gather(1, n[:, None].long())[:, 0]


def rejection_sample(
    x: torch.Tensor,  # [R, K] draft tokens (padding ignored)
    num_draft: torch.Tensor,  # [R] k per row, <= K
    p: torch.Tensor,  # [R, K + 1, V] target distributions (row j: the token at draft index j)
    q: torch.Tensor | None,  # [R, K, V] draft distributions; None: x was proposed deterministically
    seeds: torch.Tensor,  # [R, 2] the requests' seeds (low, high 32 bits)
    positions: torch.Tensor,  # [R] output index of x[:, 0]
    accept_seeds: torch.Tensor | None = None,  # [R, 2] seeds of the uniforms; default: salted seeds
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (num_accepted [R], next_token [R]): emit x[:n] then next_token."""
    R, K = x.shape
    device = x.device
    if accept_seeds is None:
        accept_seeds = seeds ^ to_device(list(rng.split_seed(ACCEPT_SALT)), torch.int64, device)
    idx = x[:, :, None].long()
    p_x = p[:, :K].gather(2, idx)[:, :, 0].double()  # [R, K]
    q_x = torch.ones_like(p_x) if q is None else q.gather(2, idx)[:, :, 0].double()
    u = uniforms(accept_seeds, positions, K)  # [R, K]
    valid = torch.arange(K, device=device)[None, :] < num_draft[:, None]
    accept = (u * q_x < p_x) & valid  # u < p(x) / q(x), no division by a zero q
    n = accept.int().cumprod(dim=1).sum(dim=1)  # [R]
    rows = torch.arange(R, device=device)
    p_n = p[rows, n].double()  # [R, V]
    rejected = n < num_draft
    if q is None:  # q is one-hot at x: the residual is p with x removed
        residual = p_n.scatter(1, x.gather(1, n.clamp(max=K - 1)[:, None]).long(), 0.0) if K else p_n
    else:
        residual = (p_n - q[rows, n.clamp(max=K - 1)].double()).clamp_(min=0.0) if K else p_n
    # a residual with no mass left means p == q there, where rejection has probability zero;
    # fall back to p so rounding can never leave an empty distribution
    empty = residual.sum(dim=1, keepdim=True) <= 0
    residual = torch.where(empty, p_n, residual)
    dist = torch.where(rejected[:, None], residual, p_n)
    return n, draw(dist, seeds, positions + n)


def accept_on_device(
    sampler: VerifyingSampler,
    logits: torch.Tensor,  # [sum(k_a + 1), V] the target's, request a's rows from offsets[a]
    requests: list[Request],
    num_draft: list[int],  # k_a
    q_rows: list[torch.Tensor | None],  # request a's draft distributions [k_a, V] (None: a deterministic proposer)
    x: torch.Tensor | None,  # [R, K] the drafts on the device, or None: made from `drafts`
    drafts: list[list[int]] | None,  # on the host, or None: copied back with the counts
    rows: tuple[list[int], list, list[int]],  # offsets, each row's request as the sampler sees it, output index
    choices: torch.Tensor | None,  # [T] the target's greedy token per row, where already chosen
    waits: DeviceWaits,  # announced before the copy to the host
) -> tuple[list[int], list[int], list[list[int]]]:
    """Greedy prefix matching and rejection sampling as kernels, then one copy to the host of the
    accepted counts, the next tokens and (when still on the device) the drafts."""
    device = logits.device
    offsets, views, positions = rows
    K = max(num_draft)
    if x is None:  # drafts from the host, padded to K
        assert drafts is not None
        x = to_device([d + [0] * (K - len(d)) for d in drafts], torch.int64, device).view(len(drafts), K)
    greedy = [a for a, r in enumerate(requests) if r.params.is_greedy]
    sampled = [a for a, r in enumerate(requests) if not r.params.is_greedy]
    p = None if choices is not None else sampler.probs(logits, views, positions)  # [T, V]
    if choices is None and greedy:
        assert p is not None
        choices = p.argmax(dim=-1)
    # index[a, j]: the row of draft index j of request a (rows past k_a repeat the last one)
    index = to_device([o + min(j, k) for o, k in zip(offsets, num_draft) for j in range(K + 1)], torch.int64, device)
    index = index.view(len(requests), K + 1)
    n_draft = to_device(num_draft, torch.int64, device)
    parts, owners = [], []
    if greedy:
        assert choices is not None
        g = row_index(greedy, len(requests), device)
        parts += list(greedy_accept(x[g], n_draft[g], choices[index[g]]))
        owners.append(greedy)
    if sampled:
        assert p is not None
        s_idx = row_index(sampled, len(requests), device)
        q = _draft_probs([q_rows[a] for a in sampled], [num_draft[a] for a in sampled], K, p)
        seeds = seed_tensor([requests[a].seed for a in sampled], device)
        base = to_device([len(requests[a].output_token_ids) for a in sampled], torch.int64, device)
        parts += list(rejection_sample(x[s_idx], n_draft[s_idx], p[index[s_idx]], q, seeds, base))
        owners.append(sampled)
    if drafts is None:
        parts.append(x.flatten())  # the drafts come back with the counts
    waits.waiting()
    flat = torch.cat(parts).tolist()  # the step's one device-to-host copy
    num_accepted, next_token = [0] * len(requests), [0] * len(requests)
    at = 0
    for group in owners:
        for j, a in enumerate(group):
            num_accepted[a], next_token[a] = flat[at + j], flat[at + len(group) + j]
        at += 2 * len(group)
    if drafts is None:
        drafts = [flat[at + a * K : at + a * K + k] for a, k in enumerate(num_draft)]
    return num_accepted, next_token, drafts


def _draft_probs(
    probs: list[torch.Tensor | None], num_draft: list[int], K: int, p: torch.Tensor
) -> torch.Tensor | None:
    # -> [S, K, V] q of the sampled rows, zero-padded; None when the proposer is deterministic
    if all(q is None for q, k in zip(probs, num_draft) if k):
        return None
    assert all(q is not None for q, k in zip(probs, num_draft) if k), "a model proposer gives q for every draft"
    q = p.new_zeros(len(probs), K, p.shape[1])
    for i, rows in enumerate(probs):
        if rows is not None:
            q[i, : rows.shape[0]] = rows
    return q
