"""The slot table against what reads it: hook specs, EngineConfig fields and flags, user spellings."""

from __future__ import annotations

import dataclasses

import pytest

from infer.api import hookspecs
from infer.api.config import EngineConfig
from infer.api.options import flag
from infer.api.slots import CHOSEN, PREFILL_ATTENTION, SLOTS, find


def test_every_slot_has_its_hook_spec_and_every_chosen_slot_its_field_and_flag():
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    assert all(callable(getattr(hookspecs, s.hook)) for s in SLOTS)
    for s in (*CHOSEN, PREFILL_ATTENTION):
        assert s.field in fields and s.flag == flag(s.field), s


@pytest.mark.parametrize(
    "spelling,slot",
    [
        ("decoder", "decoding"),
        ("decoding", "decoding"),
        ("kv-allocator", "kv_allocator"),
        ("allocator", "kv_allocator"),
        (" sampler ", "sampler"),
        ("model", "model"),
    ],
)
def test_find_accepts_names_fields_and_aliases(spelling, slot):
    found = find(spelling)
    assert found is not None and found.name == slot


def test_find_knows_no_other_word():
    assert find("block_size") is None and find("prefill_attention") is None
