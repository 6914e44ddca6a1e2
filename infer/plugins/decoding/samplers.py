"""Entry point of the built-in samplers; the code lives in `infer.plugins.decoding.sampling`."""

from __future__ import annotations

from infer.core.hookspecs import hookimpl
from infer.core.interfaces import RegisterFn
from infer.plugins.decoding.sampling import NaiveSampler, VectorizedSampler

__all__ = ["NaiveSampler", "VectorizedSampler", "infer_register_samplers"]


@hookimpl
def infer_register_samplers(register: RegisterFn) -> None:
    register("vectorized", VectorizedSampler)
    register("naive", NaiveSampler)
