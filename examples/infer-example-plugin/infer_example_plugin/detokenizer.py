"""`example-redecode`: each step, every updated request's whole output decoded again, on the engine's thread.

No incremental state: the text is `tokenizer.decode` of the last few prompt tokens (context for a
tokenizer that spells a word's leading space by what comes before it) and the output, minus the
context's own text, with an incomplete character at the end (U+FFFD) held back until its bytes
arrive. Stop strings: the first output token whose text contains one ends the request
(`stop_index`), and the text is cut before the earliest of them. Quadratic in the output length,
so slow for long outputs, but short and plain.
"""

from __future__ import annotations

from typing import Any

import infer
from infer.api import DetokenizedDelta, DeviceWaits
from infer.api.request import Request

INFER_PLUGIN_API = ">=2.1,<3"  # 2.1: the factory gets the engine's DeviceWaits
CONTEXT = 5  # prompt tokens decoded before the output
INCOMPLETE = "\ufffd"  # what decoding renders a character whose bytes have not all arrived as


class RedecodeDetokenizer:
    def __init__(self, tokenizer: Any, waits: DeviceWaits) -> None:  # decodes in `submit`: nothing to defer
        self.tokenizer = tokenizer
        self.ready: dict[str, DetokenizedDelta] = {}  # the last submit's texts
        self.stopped: dict[str, DetokenizedDelta] = {}  # requests whose stop string was found: final

    def text(self, request: Request, output_ids: list[int]) -> str:
        context = request.prompt_token_ids[-CONTEXT:]
        prefix = self.decode(context)
        if prefix.endswith(INCOMPLETE):  # the prompt ends inside a character: decode the output alone
            context, prefix = [], ""
        return self.decode(context + output_ids)[len(prefix) :].rstrip(INCOMPLETE)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def submit(self, updates: list[tuple[Request, list[int]]]) -> None:
        for request, output_ids in updates:
            rid, stops = request.request_id, request.params.stop or []
            delta = self.stopped.get(rid)
            if delta is None:
                text = self.text(request, output_ids)
                if any(stop in text for stop in stops):
                    # the first token that completes one; the text up to it, cut before the earliest stop
                    k = next(
                        k
                        for k in range(len(output_ids))
                        if any(s in self.text(request, output_ids[: k + 1]) for s in stops)
                    )
                    text = self.text(request, output_ids[: k + 1])
                    cut = min(i for i in (text.find(stop) for stop in stops) if i >= 0)
                    delta = self.stopped[rid] = DetokenizedDelta(text[:cut], stop_index=k)
                else:
                    delta = DetokenizedDelta(text)
            self.ready[rid] = delta

    def collect(self) -> dict[str, DetokenizedDelta]:
        ready, self.ready = self.ready, {}
        return ready

    def release(self, request_id: str) -> None:
        self.stopped.pop(request_id, None)

    def close(self) -> None:
        self.ready.clear()
        self.stopped.clear()


@infer.hookimpl
def infer_register_detokenizers(register) -> None:
    register("example-redecode", RedecodeDetokenizer)
