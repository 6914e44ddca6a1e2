"""What both detokenizers run (`sequential` on the engine's thread, `parallel` in a worker thread):
 the same per-request state machine, vLLM's incremental detokenization: a request's
window of tokens is `prefix | unread`, where the prefix tokens are already rendered into the
text and only serve as context. Each round decodes `prefix` and `prefix | unread` and emits the
difference, so a step costs O(new tokens), not O(length). Text that ends in U+FFFD (a character
whose bytes have not all arrived) is held back until it completes, so at every point where no
character is half-generated the text equals `tokenizer.decode(output_ids, skip_special_tokens=True)`.
Known limit, as in vLLM: a real U+FFFD generated as the last character is held until more text follows.

Stop strings: the first token whose text contains any stop string ends the request; the text is
cut before the earliest-starting stop string in it. Only the new text plus the last
`max stop length - 1` old characters are scanned.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from infer.api import DetokenizedDelta
from infer.api.request import Request

REPLACEMENT = "\ufffd"  # what a lossy UTF-8 decode renders an incomplete character as
SEED_TOKENS = 5  # prompt tokens that seed a new request's prefix (vLLM's initial offset)

DecodeBatch = Callable[[list[list[int]]], list[str]]  # windows -> their texts, skipping special tokens


@dataclass(slots=True)
class _StopSearch:
    """A stop string was found in text that several unread tokens made: which token completed it?"""

    prefix_len: int  # len(decode(window[:read]))
    text: str  # old text + the new text's complete characters
    start: int  # earliest-ending stop string occurrence: text[start:end]
    end: int


@dataclass(slots=True)
class Stream:
    """One request's incremental detokenization state.

    Invariants: `window[:read]` is the prefix (already in `text`, or prompt tokens), `window[read:]`
    the output tokens not yet rendered; `window[-1]` is output token `num_output - 1`.
    """

    stops: tuple[str, ...]
    keep_stop: bool  # the stop string stays in the text (`include_stop_str_in_output`)
    tail: int  # max stop length - 1: how far back into old text a new match can start
    window: list[int]
    read: int
    seeded: bool  # window[:read] is prompt tokens, not yet checked to end on a whole character
    num_output: int = 0  # output tokens fed so far
    text: str = ""
    stop_index: int | None = None  # output token that completed a stop string; the stream is frozen
    search: _StopSearch | None = None  # set between the decode round and the stop-locating round

    @classmethod
    def for_request(cls, request: Request) -> "Stream":
        stops = tuple(request.params.stop or ())
        seed = list(request.prompt_token_ids[-SEED_TOKENS:])
        return cls(
            stops=stops,
            keep_stop=bool(request.params.include_stop_str_in_output),
            tail=max(map(len, stops), default=1) - 1,
            window=seed,
            read=len(seed),
            seeded=bool(seed),
        )

    def feed(self, output_ids: list[int]) -> bool:
        """Take the tokens past `num_output`; returns whether there is anything to decode."""
        if self.stop_index is not None:
            return False
        assert len(output_ids) >= self.num_output, "a request's output tokens shrank"
        self.window.extend(output_ids[self.num_output :])
        fed = len(output_ids) > self.num_output
        self.num_output = len(output_ids)
        return fed

    def delta(self) -> DetokenizedDelta:
        return DetokenizedDelta(self.text, self.stop_index)

    def windows(self) -> list[list[int]]:
        if self.search is None:
            return [self.window[: self.read], self.window]
        # candidates for the completing token; the last one (the whole window) is already decoded
        return [self.window[: j + 1] for j in range(self.read, len(self.window) - 1)]

    def advance(self, texts: list[str]) -> bool:
        """Consume the decoded `windows()`; returns whether another round is needed."""
        if self.search is not None:
            return self._locate(texts)
        prefix, full = texts
        if self.seeded:
            self.seeded = False
            if prefix.endswith(REPLACEMENT):  # prompt ends inside a character: render without it
                del self.window[: self.read]
                self.read = 0
                return True
        new = full[len(prefix) :]
        held = len(full) <= len(prefix) or new.endswith(REPLACEMENT)
        if self.stops:
            visible = self.text + (new.rstrip(REPLACEMENT) if held else new)
            hit = self._earliest_end(visible)
            if hit is not None and len(self.window) - self.read > 1:
                self.search = _StopSearch(len(prefix), visible, *hit)
                return True
            if hit is not None:
                self._stop(visible, len(self.window) - 1)
                return False
        if not held:
            self.text += new
            del self.window[: self.read]
            self.read = len(self.window)
        return False

    def _earliest_end(self, text: str) -> tuple[int, int] | None:
        lo = max(0, len(self.text) - self.tail)
        best: tuple[int, int] | None = None
        for stop in self.stops:
            start = text.find(stop, lo)
            if start >= 0 and (best is None or start + len(stop) < best[1]):
                best = (start, start + len(stop))
        return best

    def _locate(self, texts: list[str]) -> bool:
        search = self.search
        assert search is not None
        target = search.text[search.start : search.end]
        for k, decoded in enumerate(texts):
            candidate = self.text + decoded[search.prefix_len :]
            if candidate[search.start : search.end] == target:
                self._stop(candidate, self.read + k)
                return False
        self._stop(search.text, len(self.window) - 1)
        return False

    def _stop(self, text: str, j: int) -> None:
        """Token `window[j]` completed a stop string in `text`: cut before the earliest-starting one."""
        lo = max(0, len(self.text) - self.tail)
        start, _, stop = min((i, len(s), s) for s in self.stops if (i := text.find(s, lo)) >= 0)
        self.text = text[: start + len(stop)] if self.keep_stop else text[:start]
        self.stop_index = self.num_output - len(self.window) + j
        self.window, self.read, self.search = [], 0, None


def run_streams(streams: list[Stream], decode: DecodeBatch) -> None:
    """Drive streams to the end of their rounds (at most three); each round is one `decode` call."""
    while streams:
        windows = [s.windows() for s in streams]
        texts = decode([w for ws in windows for w in ws])
        again: list[Stream] = []
        i = 0
        for stream, ws in zip(streams, windows):
            if stream.advance(texts[i : i + len(ws)]):
                again.append(stream)
            i += len(ws)
        streams = again


class StreamTable:
    def __init__(self) -> None:
        self.streams: dict[str, Stream] = {}

    def feed(self, updates: list[tuple[Request, list[int]]]) -> tuple[list[Stream], list[tuple[str, Stream]]]:
        """Returns (streams with new tokens, every submitted request's stream)."""
        work: list[Stream] = []
        submitted: list[tuple[str, Stream]] = []
        for request, output_ids in updates:
            stream = self.streams.get(request.request_id)
            if stream is None:
                stream = self.streams[request.request_id] = Stream.for_request(request)
            if stream.feed(output_ids):
                work.append(stream)
            submitted.append((request.request_id, stream))
        return work, submitted
