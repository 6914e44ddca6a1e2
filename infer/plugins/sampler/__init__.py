"""Samplers: `vectorized` (one batched pass, counter-based RNG) and `naive` (a per-row loop)."""
