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
"""

from __future__ import annotations

import torch

from infer.kernels import rng
from infer.runtime.transfer import to_device

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
