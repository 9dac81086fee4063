"""Random small JSON schemas for the structured-output tests, from a seeded generator.

    schema = random_object_schema(random.Random(seed))

Objects of 1-4 fields: strings (maxLength 0-6, sometimes a minLength), integers in a range,
booleans, enums (with quotes, backslashes, accents and spaces in their words), arrays of
0-3 scalars, nested objects of 1-2 such fields (one level). Every one bounds the JSON it accepts (no
free whitespace assumed), so a random model's output ends within a few hundred tokens.
"""

from __future__ import annotations

import random
from typing import Any

EOS = 0  # the tiny checkpoints' eos (helpers_models)


def random_value_schema(rng: random.Random, depth: int) -> dict[str, Any]:
    kind = rng.choice(["string", "integer", "boolean", "enum", "array", "object"]
                      if depth < 1 else ["string", "integer", "boolean", "enum", "array"]
                      if depth < 2 else ["string", "integer", "boolean", "enum"])
    if kind == "string":
        schema: dict[str, Any] = {"type": "string", "maxLength": rng.randint(0, 6)}
        if rng.random() < 0.3:
            schema["minLength"] = rng.randint(0, schema["maxLength"])
        return schema
    if kind == "integer":
        low = rng.randint(-1000, 1000)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 5000)}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        words = ["red", "green", "blue", "a b", 'q"uote', "\u00e9t\u00e9", "x\\y"]
        return {"enum": rng.sample(words, rng.randint(1, 4))}
    if kind == "array":  # of scalars: arrays of objects make outputs too long
        items = random_value_schema(rng, depth=2)
        low = rng.randint(0, 1)
        return {"type": "array", "items": items, "minItems": low,
                "maxItems": low + rng.randint(0, 2)}
    return random_object_schema(rng, depth + 1)


def random_object_schema(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    """An object of 1-4 fields (string, integer, boolean, enum, array, nested object), some
    of them required, no others allowed."""
    names = rng.sample(["id", "name", "age", "tags", "ok", "kind", "size", "meta"],
                       rng.randint(1, 4 if depth == 0 else 2))
    properties = {name: random_value_schema(rng, depth) for name in names}
    required = [name for name in names if rng.random() < 0.7]
    return {"type": "object", "properties": properties, "required": required,
            "additionalProperties": False}


def assert_declared_order(value: Any, schema: dict[str, Any]) -> None:
    """An object's fields come in the order its schema lists them (xgrammar's default)."""
    if isinstance(value, dict) and "properties" in schema:
        order = list(schema["properties"])
        assert list(value) == sorted(value, key=order.index), (list(value), order)
        for name, item in value.items():
            assert_declared_order(item, schema["properties"][name])
    elif isinstance(value, list) and "items" in schema:
        for item in value:
            assert_declared_order(item, schema["items"])


def finished_on_eos(out: dict[str, Any]) -> bool:
    return bool(out["token_ids"]) and out["token_ids"][-1] == EOS
