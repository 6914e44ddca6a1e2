"""What the kernel-time attribution charges each kernel."""

import pytest

from infer.bench.ceilings import _attribute


def test_overlapping_kernels_are_charged_what_they_add_to_the_step():
    # b starts early (as a dependent launch does), waits, and ends 3 us after a; a gap; c alone
    events = [
        {"name": "a", "ts": 0.0, "dur": 10.0},
        {"name": "b", "ts": 2.0, "dur": 11.0},
        {"name": "c", "ts": 15.0, "dur": 4.0},
    ]
    rows = {r["kernel"]: r for r in _attribute(events, steps=1)}
    assert rows["a"]["critical_us_per_step"] == pytest.approx(10.0)
    assert rows["b"]["critical_us_per_step"] == pytest.approx(3.0)
    assert rows["b"]["us_per_step"] == pytest.approx(11.0)
    assert rows["(idle)"]["critical_us_per_step"] == pytest.approx(2.0)
    assert rows["c"]["critical_us_per_step"] == pytest.approx(4.0)
    # the critical times and the idle gaps add up to the span
    assert sum(r["critical_us_per_step"] for r in rows.values()) == pytest.approx(19.0)


def test_a_kernel_inside_anothers_span_adds_nothing_and_steps_divide():
    events = [
        {"name": "long", "ts": 0.0, "dur": 20.0},
        {"name": "short", "ts": 5.0, "dur": 5.0},
        {"name": "long", "ts": 20.0, "dur": 20.0},
        {"name": "short", "ts": 25.0, "dur": 5.0},
    ]
    rows = {r["kernel"]: r for r in _attribute(events, steps=2)}
    assert rows["short"]["critical_us_per_step"] == 0.0
    assert rows["short"]["count_per_step"] == pytest.approx(1.0)
    assert rows["long"]["critical_us_per_step"] == pytest.approx(20.0)
    assert "(idle)" not in rows
