"""Chat templates: the model's (or a custom one) rendered and tokenized exactly as HF transformers does.

The ids are `tokenizer.apply_chat_template(..., tokenize=True)`'s: the rendered text is tokenized
without special tokens, so a template that writes the BOS itself (Llama 3's `{{ bos_token }}`) gets
one BOS, not a second one from a BOS-adding tokenizer.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from infer.api.errors import ConfigError, RequestError, one_line
from infer.inputs.prompts import check_encodable


def load_chat_template(value: str | None) -> str | None:
    """--chat-template: a jinja file's path, or the template's text itself; None keeps the model's."""
    if value is None:
        return None
    path = Path(value).expanduser()
    if _is_file(path):
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"cannot read the chat template {value} ({exc}): pass a readable jinja file") from exc
        if not text.strip():
            raise ConfigError(f"the chat template file {value} is empty: pass a jinja template")
        return text
    if "{{" in value or "{%" in value:  # the template itself
        return value
    raise ConfigError(
        f"chat template file {value} does not exist: pass a jinja file's path or the template text itself"
    )


def template_for(tokenizer: Any, chat_template: str | None = None) -> str:
    """The template a chat is rendered with: `chat_template` (already loaded), else the tokenizer's."""
    if tokenizer is None:
        raise RequestError("this model has no tokenizer, so it cannot chat: pass token ids to generate()")
    template = chat_template or getattr(tokenizer, "chat_template", None)  # a duck-typed HF tokenizer's, if any
    if not template:
        raise RequestError(
            "this model has no chat template: pass one with --chat-template PATH (LLM(chat_template=...)), "
            "or use generate() with plain prompts"
        )
    return template


def check_template_kwargs(tokenizer: Any, chat_template_kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
    """The template's extra variables; none may be one of apply_chat_template's own parameters
    (`tokenize`, `chat_template`, ...), which would change the call instead of reaching the template."""
    if chat_template_kwargs is None:
        return {}
    if not isinstance(chat_template_kwargs, Mapping):
        raise RequestError(f"chat_template_kwargs must be a dict, got {type(chat_template_kwargs).__name__}")
    params = inspect.signature(tokenizer.apply_chat_template).parameters
    reserved = {n for n, p in params.items() if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
    if clash := sorted(set(chat_template_kwargs) & reserved):
        raise RequestError(f"chat_template_kwargs may not set {', '.join(clash)}: pass them as chat() arguments")
    return dict(chat_template_kwargs)


def chat_token_ids(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    chat_template: str | None = None,
    add_generation_prompt: bool = True,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> list[int]:
    """The prompt ids of one conversation. chat_template_kwargs reach the template as variables
    (enable_thinking, ...); tools are OpenAI-style function dicts. A conversation the template cannot
    render is a RequestError naming why."""
    template = template_for(tokenizer, chat_template)
    kwargs = check_template_kwargs(tokenizer, chat_template_kwargs)
    return render_chat(tokenizer, messages, template, add_generation_prompt, kwargs, tools)


def render_chat(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    template: str,
    add_generation_prompt: bool,
    kwargs: dict[str, Any],
    tools: Sequence[Mapping[str, Any]] | None,
) -> list[int]:
    """`chat_token_ids` with the template and its kwargs already resolved (`template_for`,
    `check_template_kwargs`): a chat call resolves them once for all its conversations."""
    from jinja2 import TemplateError

    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence) or not messages:
        raise RequestError(
            "a conversation is a non-empty list of {'role': ..., 'content': ...} dicts: fix the messages"
        )
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
            raise RequestError(f"message {i} of the conversation is not a dict with a 'role' string: fix the messages")
        if isinstance(m.get("content"), str):
            check_encodable(m["content"], f"message {i}'s content")
    try:
        out = tokenizer.apply_chat_template(
            [dict(m) for m in messages], tools=list(tools) if tools is not None else None, chat_template=template,
            add_generation_prompt=add_generation_prompt, tokenize=True, **kwargs,
        )  # fmt: skip
    except TemplateError as exc:  # raise_exception(...) in the template, an undefined field, a syntax error
        raise RequestError(
            f"the chat template cannot render this conversation ({_one_line(exc)}): fix the messages or the template"
        ) from exc
    except (ValueError, TypeError, KeyError, IndexError) as exc:
        raise RequestError(
            f"cannot apply the chat template to this conversation ({type(exc).__name__}: {_one_line(exc)}): fix the messages"
        ) from exc
    ids = out["input_ids"] if isinstance(out, Mapping) else out  # transformers 5 returns a BatchEncoding
    return [int(t) for t in ids]


def _is_file(path: Path) -> bool:
    try:
        return path.is_file()
    except OSError:  # a template's text is often no valid path (too long a name)
        return False


def _one_line(exc: BaseException) -> str:
    return one_line(exc) or type(exc).__name__
