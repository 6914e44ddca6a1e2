"""Prompt lookup against a brute-force reading of its rule: the latest earlier occurrence of the
sequence's last n tokens, longest n first, predicts the tokens that followed it."""

from __future__ import annotations

import random

import pytest

from infer.plugins.decoding.proposers import NgramProposer


def reference(ids: list[int], k: int, max_n: int, min_n: int) -> list[int]:
    for n in range(max_n, min_n - 1, -1):
        tail = ids[len(ids) - n :]
        for start in range(len(ids) - n - 1, -1, -1):  # an occurrence that ends before the last token
            if len(ids) > n and ids[start : start + n] == tail:
                return ids[start + n : start + n + k]
    return []


@pytest.mark.parametrize("max_n,min_n", [(3, 1), (4, 2), (2, 2), (5, 1)])
def test_lookup_matches_the_rule(max_n, min_n):
    rng = random.Random(max_n * 10 + min_n)
    proposer = NgramProposer(max_n, min_n)
    for _ in range(3000):
        vocab = rng.choice([2, 3, 5, 50])
        ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 40))]
        k = rng.randint(1, 6)
        assert proposer.lookup(ids, k) == reference(ids, k, max_n, min_n), ids


@pytest.mark.parametrize("max_n,min_n", [(3, 1), (2, 2)])
def test_lookup_skips_matches_across_token_boundaries(max_n, min_n):
    # ids whose bytes repeat across neighbours: a byte search finds the tail between two ids too
    words = [1, 256, 65536, 16777216, 0x01000100, 0x01010101, 0x00010001, 2**31 - 1]
    rng = random.Random(max_n)
    proposer = NgramProposer(max_n, min_n)
    for _ in range(3000):
        ids = [rng.choice(words) for _ in range(rng.randint(1, 30))]
        k = rng.randint(1, 5)
        assert proposer.lookup(ids, k) == reference(ids, k, max_n, min_n), ids
    # the last id's bytes (01 00 00 00) also start at the last byte of 0x01000000, later than the real match
    assert NgramProposer(3, 1).lookup([1, 5, 0x01000000, 0, 7, 1], 1) == [5]


def test_lookup_prefers_the_longest_then_the_latest_match():
    proposer = NgramProposer(3, 1)
    # "1 2 3" occurred once (-> 7); "3" alone last occurred before 9
    assert proposer.lookup([1, 2, 3, 7, 8, 3, 9, 1, 2, 3], 2) == [7, 8]
    assert proposer.lookup([5, 3, 7, 3, 9, 3], 3) == [9, 3]
    assert proposer.lookup([4, 5, 6], 3) == []


def test_the_default_needs_two_tokens_to_match():
    proposer = NgramProposer()
    assert proposer.lookup([5, 3, 7, 3, 9, 3], 3) == []  # only "3" recurs
    assert proposer.lookup([5, 3, 7, 9, 3, 8, 9, 3], 3) == [8, 9, 3]  # "9 3" last occurred before 8
