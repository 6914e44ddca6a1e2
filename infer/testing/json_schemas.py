"""Random JSON schemas for structured-output tests, seeded, each with a bound on its documents' size.

The schemas use what xgrammar (0.2.8) compiles faithfully: nested objects with a required subset
of their properties, arrays with minItems/maxItems (and prefixItems), strings with
minLength/maxLength, enum or an anchored pattern, integers and numbers with ranges (exclusive
bounds too), booleans, null, const, mixed enums, type lists and anyOf. They leave out what it
compiles but does not enforce (uniqueItems, allOf, oneOf's exclusivity, formats), so every
document the grammar admits is valid against the schema.

Every schema's language is finite: `max_bytes` bounds the UTF-8 size of any document it admits in
the compact form the `xgrammar` processor generates (", " and ": " between items, no other
whitespace). A byte-level tokenizer never spends more tokens than bytes, so `max_tokens` of
`max_bytes + 1` (the EOS) is never what ends a document.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any

WORDS = (
    "id name title city color size count price score tags owner email year rating active kind "
    "note label level code status items width height weight author genre"
).split()
# anchored patterns (JSON Schema searches, xgrammar matches whole: anchored, the two agree) and
# their longest match, ASCII only
PATTERNS = {
    r"^[a-z]{2,6}$": 6,
    r"^\d{3}-\d{4}$": 8,
    r"^[A-Z][a-z]{1,7}$": 8,
    r"^(red|green|blue)$": 5,
    r"^[0-9a-f]{4,8}$": 8,
    r"^\d{4}-\d{2}-\d{2}$": 10,
    r"^[A-Z]{2}[0-9]{2,3}$": 5,
}
ENUM_WORDS = ("north", "south", "east", "west", "small", "medium", "large", "yes", "no", "maybe", "café", "naïve")
MAX_CHAR_BYTES = 4  # a free string character (maxLength) may be any code point but a quote, backslash or newline


@dataclass(frozen=True, slots=True)
class SchemaCase:
    schema: dict[str, Any]  # a JSON schema whose root is an object
    max_bytes: int  # the longest document it admits, in UTF-8 bytes (compact separators)


def random_schemas(count: int, seed: int = 0, max_bytes: int = 200) -> list[SchemaCase]:
    """`count` object schemas, each admitting no document over `max_bytes` bytes."""
    rng = random.Random(seed)
    cases: list[SchemaCase] = []
    while len(cases) < count:
        schema, size = _object(rng, depth=0)
        if size <= max_bytes:
            cases.append(SchemaCase(schema, size))
    return cases


def _value(rng: random.Random, depth: int) -> tuple[dict[str, Any], int]:
    """A schema below the root and the size of its longest document."""
    kinds = ["string", "enum", "pattern", "integer", "number", "boolean", "null", "const", "nullable", "anyOf"]
    if depth < 2:
        kinds += ["object", "array", "array"]
    kind = rng.choice(kinds)
    if kind == "object":
        return _object(rng, depth + 1)
    if kind == "array":
        return _array(rng, depth + 1)
    if kind == "anyOf":
        branches = [
            _scalar(rng, rng.choice(["string", "enum", "integer", "number", "boolean", "null"])) for _ in range(2)
        ]
        return {"anyOf": [s for s, _ in branches]}, max(n for _, n in branches)
    if kind == "nullable":  # a type list
        schema, size = _scalar(rng, rng.choice(["integer", "string"]))
        return {**schema, "type": [schema["type"], "null"]}, max(size, 4)
    return _scalar(rng, kind)


def _scalar(rng: random.Random, kind: str) -> tuple[dict[str, Any], int]:
    if kind == "string":
        longest = rng.randint(1, 10)
        schema: dict[str, Any] = {"type": "string", "maxLength": longest}
        if rng.random() < 0.5:
            schema["minLength"] = rng.randint(0, longest)
        return schema, 2 + MAX_CHAR_BYTES * longest
    if kind == "enum":
        words = rng.sample(ENUM_WORDS, rng.randint(2, 4))
        return {"type": "string", "enum": words}, max(_size(w) for w in words)
    if kind == "pattern":
        pattern = rng.choice(sorted(PATTERNS))
        return {"type": "string", "pattern": pattern}, 2 + PATTERNS[pattern]
    if kind == "integer":
        low = rng.randint(-1000, 100)
        high = low + rng.choice([0, 1, 9, 99, 5000])
        return {"type": "integer", "minimum": low, "maximum": high}, max(len(str(low)), len(str(high)))
    if kind == "number":
        low = rng.choice([-10, -1.5, 0, 0.25, 3])
        high = low + rng.choice([0.5, 1, 10, 250])
        schema = {"type": "number", "maximum": high}
        schema["exclusiveMinimum" if rng.random() < 0.3 else "minimum"] = low
        # sign, integer digits, point, six decimals: xgrammar's bounded numbers stop at six
        return schema, 1 + len(str(int(max(abs(low), abs(high))))) + 1 + 6
    if kind == "boolean":
        return {"type": "boolean"}, 5
    if kind == "null":
        return {"type": "null"}, 4
    if kind == "const":
        value = rng.choice(["v1", 42, True, None, "fixed"])
        return {"const": value}, _size(value)
    assert kind == "mixed-enum", kind
    values = rng.sample(["a", "b", 0, 1, 2.5, True, None], 3)
    return {"enum": values}, max(_size(v) for v in values)


def _object(rng: random.Random, depth: int) -> tuple[dict[str, Any], int]:
    names = rng.sample(WORDS, rng.randint(1, 4 if depth == 0 else 3))
    properties, size = {}, 2 + 2 * (len(names) - 1)  # braces, ", " between members
    for name in names:
        properties[name], value_size = _value(rng, depth) if rng.random() > 0.1 else _scalar(rng, "mixed-enum")
        size += _size(name) + 2 + value_size  # "name": value
    required = [n for n in names if rng.random() < 0.6]
    schema: dict[str, Any] = {"type": "object", "properties": properties}
    if required:
        schema["required"] = required
    if rng.random() < 0.5:
        schema["additionalProperties"] = False
    return schema, size


def _array(rng: random.Random, depth: int) -> tuple[dict[str, Any], int]:
    low = rng.randint(0, 2)
    high = low + rng.randint(0, 2)
    if rng.random() < 0.2:  # a tuple: prefixItems, nothing after them
        items = [_scalar(rng, k) for k in rng.sample(["integer", "boolean", "enum", "null"], 2)]
        schema = {"type": "array", "prefixItems": [s for s, _ in items], "items": False}
        return schema, 2 + sum(n for _, n in items) + 2
    item, item_size = _value(rng, depth) if depth < 2 else _scalar(rng, rng.choice(["integer", "enum", "boolean"]))
    schema = {"type": "array", "items": item, "minItems": low, "maxItems": high}
    return schema, 2 + high * item_size + 2 * max(high - 1, 0)


def _size(value: Any) -> int:
    return len(json.dumps(value, ensure_ascii=False).encode())
