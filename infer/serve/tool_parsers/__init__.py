"""Tool-call parsers: the calls a model wrote in its text, read whole (`parse`) or as the text streams
(`stream().feed(piece)`). `PARSERS` are the formats `infer serve --tool-call-parser` names; `forced`
reads the calls a `tool_choice` constrained the output to."""

from __future__ import annotations

from infer.serve.tool_parsers.base import (
    CallDelta,
    ParsedToolCalls,
    StreamPiece,
    ToolCall,
    ToolCallStream,
    ToolParser,
)
from infer.serve.tool_parsers.hermes import HermesParser
from infer.serve.tool_parsers.llama3_json import Llama3JsonParser

PARSERS: dict[str, type[ToolParser]] = {"hermes": HermesParser, "llama3_json": Llama3JsonParser}

__all__ = [
    "PARSERS",
    "CallDelta",
    "HermesParser",
    "Llama3JsonParser",
    "ParsedToolCalls",
    "StreamPiece",
    "ToolCall",
    "ToolCallStream",
    "ToolParser",
]
