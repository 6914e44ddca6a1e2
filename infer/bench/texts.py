"""The text `infer bench accuracy` scores: the chats of the Chit-Chat Challenge (the `chitchat-dataset`
package: 7,168 open-domain conversations between people, in English), in the order its file lists them.

A chat is its messages one per line (a message's utterances joined by spaces); chats are separated by
a blank line. Perplexity windows are consecutive slices of the chats' token ids, from the first chat
on; the greedy prompts are the opening tokens of the chats after those the windows used, so no prompt
is text a window scored. A model without a tokenizer (a tiny test model) reads the text's UTF-8 bytes,
each modulo its vocabulary, as token ids.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator

from infer.api.errors import ConfigError

SOURCE = "chitchat-dataset"


@dataclass(slots=True)
class TextSet:
    name: str  # where the text came from, and how much of it was used
    windows: list[list[int]]  # perplexity windows: window_tokens ids each, consecutive in the text
    prompts: list[list[int]]  # greedy prompts: the first prompt_tokens ids of later chats, one each


def chats() -> Iterator[str]:
    """Every chat as text, in the dataset's order."""
    try:
        import chitchat_dataset
    except ImportError:
        raise ConfigError(
            f"the chat text (infer bench accuracy's, and infer models quantize's calibration) comes from the "
            f"{SOURCE} package, which is not installed: pip install 'infer[bench]' (or {SOURCE}==0.9.0), "
            f"or give infer models quantize --calibration a text file"
        ) from None
    for chat in chitchat_dataset.Dataset().values():
        yield "\n".join(" ".join(u["text"] for u in message) for message in chat["messages"])


def encoder(tokenizer: Any | None, vocab_size: int) -> Callable[[str], list[int]]:
    if tokenizer is None:
        return lambda text: [b % vocab_size for b in text.encode("utf-8")]
    return lambda text: list(tokenizer.encode(text, add_special_tokens=False))


def load_text_set(
    tokenizer: Any | None, vocab_size: int, num_windows: int, window_tokens: int, num_prompts: int, prompt_tokens: int
) -> TextSet:
    encode = encoder(tokenizer, vocab_size)
    texts = chats()
    asked = f"--windows {num_windows} x --window-tokens {window_tokens}"
    windows, num_chats = _windows(texts, encode, num_windows, window_tokens, asked)
    prompts: list[list[int]] = []
    for text in texts:  # the chats after the windows'
        if len(prompts) == num_prompts:
            break
        ids = encode(text)
        if len(ids) >= prompt_tokens:
            prompts.append(ids[:prompt_tokens])
    if len(prompts) < num_prompts:
        raise ConfigError(
            f"{SOURCE} has {len(prompts)} chats of {prompt_tokens}+ tokens after the windows, not --prompts "
            f"{num_prompts}: ask for fewer prompts or windows"
        )
    name = f"{SOURCE}: {num_windows} x {window_tokens} tokens of {num_chats} chats, {num_prompts} later chats' openings"
    return TextSet(name, windows, prompts)


def calibration_windows(tokenizer: Any | None, vocab_size: int, num_windows: int, window_tokens: int) -> TextSet:
    """Windows of the chats taken from the dataset's end, last chat first: text that no window or prompt of
    `load_text_set` (which reads from its start) holds, for calibrating a quantizer on."""
    encode = encoder(tokenizer, vocab_size)
    asked = f"--calibration-windows {num_windows} x --window-tokens {window_tokens}"
    windows, num_chats = _windows(reversed(list(chats())), encode, num_windows, window_tokens, asked)
    return TextSet(f"{SOURCE}: {num_windows} x {window_tokens} tokens of its last {num_chats} chats", windows, [])


def _windows(
    texts: Iterator[str], encode: Callable[[str], list[int]], num_windows: int, window_tokens: int, asked: str
) -> tuple[list[list[int]], int]:
    """Consecutive windows of the token ids of `texts` (each followed by a blank line), read only as far as
    they need (a caller may go on with the same iterator): the windows and the texts read. Too little text
    for them is a ConfigError that names what was `asked` for (the options that set the windows)."""
    stream: list[int] = []
    num_chats = 0
    for text in texts:
        stream += encode(text + "\n\n")
        num_chats += 1
        if len(stream) >= num_windows * window_tokens:
            break
    if len(stream) < num_windows * window_tokens:
        raise ConfigError(
            f"{SOURCE} holds {len(stream)} tokens, fewer than {asked}: ask for fewer windows or shorter ones"
        )
    return [stream[i * window_tokens : (i + 1) * window_tokens] for i in range(num_windows)], num_chats
