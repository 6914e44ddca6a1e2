"""A reader that fell behind gets the outputs it missed as one: the concatenations are unchanged."""

from __future__ import annotations

from infer.core.stream import CompletionDelta, StreamOutput, merge


def test_merge_concatenates_each_sample_and_keeps_the_later_state():
    a = StreamOutput(
        "r", [CompletionDelta(0, "He", [1], [{1: -0.1}]), CompletionDelta(1, "X", [7], [{7: -1.0}])], False
    )
    b = StreamOutput("r", [CompletionDelta(1, "Y", [8], [{8: -2.0}], "stop")], False)
    c = StreamOutput("r", [CompletionDelta(0, "llo", [2, 3], [{2: -0.2}, {3: -0.3}], "length")], True, final=None)
    out = merge(merge(a, b), c)
    assert out.finished and out.request_id == "r"
    by = {d.index: d for d in out.deltas}
    assert (by[0].text, by[0].token_ids, by[0].finish_reason) == ("Hello", [1, 2, 3], "length")
    assert by[0].logprobs == [{1: -0.1}, {2: -0.2}, {3: -0.3}]
    assert (by[1].text, by[1].token_ids, by[1].finish_reason, by[1].logprobs) == (
        "XY",
        [7, 8],
        "stop",
        [{7: -1.0}, {8: -2.0}],
    )
    assert [d.index for d in out.deltas] == [0, 1]  # the samples keep their order
