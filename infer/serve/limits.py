"""How much one client may ask of the server: `ServeLimits`, one `infer serve` option per field.

The HTTP limits (body size, the protocol's timeouts) are enforced by `http_limits`; the rest bound
the work a request's fields cost before its first token (stop strings the detokenizer scans for,
logit_bias entries, the constraints compiled into a grammar) and are checked by
`request_limits.check_request` before any work is done. This module imports no server library:
the CLI reads its defaults.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from infer.api.errors import ConfigError

__all__ = ["ServeLimits", "option_name"]

KiB, MiB = 1024, 1024 * 1024


@dataclass(frozen=True, slots=True)
class ServeLimits:
    """Every limit a client meets; each field is an `infer serve` option (`--max-request-bytes`, ...)."""

    # a request body past this many bytes is a 413 (refused by Content-Length, or counted as it arrives)
    max_request_bytes: int = 4 * MiB
    # a request body with no byte for this long (a body shorter than its Content-Length included) is a 408
    body_timeout_s: float = 30.0
    # a connection holding a request's partial headers this long is closed (slowloris)
    header_timeout_s: float = 10.0
    # an idle keep-alive connection is closed after this long (uvicorn's timeout_keep_alive)
    keep_alive_timeout_s: float = 5.0
    # stop strings per request: each is looked for in every new piece of every sample's text
    max_stop: int = 32
    # logit_bias entries: each is added to every step's logits
    max_logit_bias: int = 1024
    # a JSON schema's size as JSON text (response_format, structured_outputs, guided_json, tool parameters)
    max_schema_bytes: int = 64 * KiB
    # a JSON schema's nesting depth (objects and arrays inside each other): the grammar compiler recurses on it
    max_schema_depth: int = 32
    # guided_choice (structured_outputs.choice) strings, at most
    max_choices: int = 1024
    # guided_choice strings' characters, all together
    max_choices_length: int = 64 * KiB
    # a guided_regex (structured_outputs.regex), in characters
    max_regex_length: int = 8 * KiB
    # a guided_grammar (structured_outputs.grammar), in characters
    max_grammar_length: int = 64 * KiB

    def __post_init__(self) -> None:
        for field in fields(self):
            value = getattr(self, field.name)  # a dataclass field, by its name from fields()
            if not value > 0:
                raise ConfigError(f"{option_name(field.name)} must be positive, not {value!r}")


def option_name(field_name: str) -> str:
    """The `infer serve` option of a ServeLimits field: body_timeout_s -> --body-timeout."""
    return "--" + field_name.removesuffix("_s").replace("_", "-")
