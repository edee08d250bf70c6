"""The JSON schemas of ``mindspec bench --scenario structured``: one per kind of JSON a service is
asked for, each a plain dict with every string and array bounded (maxLength, maxItems), so that
a model that writes nonsense content, as the shipped code model does under a schema, still ends
its document within the token budget. Every object lists all its properties as required and
allows no others: the structure is the format's, the values the model's.

- ``nested_object``: a profile with an address object inside, a string pattern (a zip code).
- ``enums``: a ticket of string, integer and nullable enums.
- ``array_of_objects``: an order with 1-3 line items, each an object.
- ``numbers``: a measurement of numbers and integers within ranges (minimum / maximum).
- ``booleans``: feature flags, an array of booleans and a nullable short string.

Prompts are assigned to them round robin (prompt i gets ``SCHEMAS[i % 5]``).
"""
from __future__ import annotations

SCHEMAS: dict[str, dict] = {
    "nested_object": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "minLength": 1, "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "address": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "minLength": 1, "maxLength": 12},
                    "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                },
                "required": ["city", "zip"],
                "additionalProperties": False,
            },
        },
        "required": ["name", "age", "address"],
        "additionalProperties": False,
    },
    "enums": {
        "type": "object",
        "properties": {
            "status": {"enum": ["open", "closed", "pending"]},
            "priority": {"type": "integer", "enum": [1, 2, 3, 4]},
            "kind": {"type": "string", "enum": ["bug", "feature", "question"]},
            "assignee": {"enum": ["alice", "bob", "carol", None]},
        },
        "required": ["status", "priority", "kind", "assignee"],
        "additionalProperties": False,
    },
    "array_of_objects": {
        "type": "object",
        "properties": {
            "order_id": {"type": "integer", "minimum": 1, "maximum": 99999},
            "items": {
                "type": "array",
                "minItems": 1,
                "maxItems": 3,
                "items": {
                    "type": "object",
                    "properties": {
                        "sku": {"type": "string", "minLength": 1, "maxLength": 8},
                        "qty": {"type": "integer", "minimum": 1, "maximum": 9},
                    },
                    "required": ["sku", "qty"],
                    "additionalProperties": False,
                },
            },
        },
        "required": ["order_id", "items"],
        "additionalProperties": False,
    },
    "numbers": {
        "type": "object",
        "properties": {
            "temperature": {"type": "number", "minimum": -50, "maximum": 60},
            "humidity": {"type": "integer", "minimum": 0, "maximum": 100},
            "ratio": {"type": "number", "minimum": 0, "maximum": 1},
            "count": {"type": "integer", "minimum": 0, "maximum": 1000},
        },
        "required": ["temperature", "humidity", "ratio", "count"],
        "additionalProperties": False,
    },
    "booleans": {
        "type": "object",
        "properties": {
            "enabled": {"type": "boolean"},
            "beta": {"type": "boolean"},
            "flags": {"type": "array", "maxItems": 4, "items": {"type": "boolean"}},
            "note": {"type": ["string", "null"], "maxLength": 10},
        },
        "required": ["enabled", "beta", "flags", "note"],
        "additionalProperties": False,
    },
}


def schema_of(index: int) -> str:
    """The schema prompt ``index`` is given (round robin)."""
    names = list(SCHEMAS)
    return names[index % len(names)]
