"""Samplers: `vectorized` (one batched pass, counter-based RNG) and `naive` (a per-row loop)."""

from infer.plugins.decoding.sampling.naive import NaiveSampler
from infer.plugins.decoding.sampling.vectorized import VectorizedSampler

__all__ = ["NaiveSampler", "VectorizedSampler"]
