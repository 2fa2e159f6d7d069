"""Random JSON schemas and documents that satisfy them: the structured-output tests' and benchmarks' inputs.

Each schema keeps every value bounded (strings have maxLength, numbers both bounds, arrays maxItems),
so a model constrained by it must finish a document in a bounded number of tokens: what lets a test
require that every output parses and validates within max_tokens.
"""

from __future__ import annotations

import random
import string

# `tandem bench --json-schema builtin`: records of short fields, up to 16 of them (long enough documents
# for a decode-speed measurement, bounded so that every document ends).
BENCH_SCHEMA = {"type": "array", "minItems": 4, "maxItems": 16, "items": {
    "type": "object", "additionalProperties": False, "required": ["id", "name", "tags", "score"],
    "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 100000},
                   "name": {"type": "string", "maxLength": 24},
                   "tags": {"type": "array", "items": {"enum": ["new", "old", "hot", "cold"]}, "maxItems": 3},
                   "score": {"type": "number", "minimum": 0, "maximum": 1}}}}

_WORDS = ["alpha", "beta", "gamma", "delta", "red", "green", "blue", "cat", "dog", "yes", "no", "x1", "tier-2"]


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """A schema of objects, arrays, enums, bounded integers / numbers, short strings and booleans,
    nested up to three levels."""
    kinds = ["string", "integer", "number", "boolean", "enum"] + (["object", "array"] if depth < 3 else [])
    kind = rng.choice(kinds if depth else ["object"])
    if kind == "object":
        names = rng.sample(["id", "name", "count", "tags", "score", "ok", "kind", "items", "meta", "level"],
                           rng.randint(1, 4))
        props = {n: random_schema(rng, depth + 1) for n in names}
        required = [n for n in names if rng.random() < 0.7] or names[:1]
        return {"type": "object", "properties": props, "required": required, "additionalProperties": False}
    if kind == "array":
        return {"type": "array", "items": random_schema(rng, depth + 1), "minItems": rng.randint(0, 1),
                "maxItems": rng.randint(1, 3)}
    if kind == "enum":
        return {"enum": rng.sample(_WORDS, rng.randint(2, 4))}
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(1, 8)}
    if kind == "integer":
        lo = rng.randint(-50, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 500)}
    if kind == "number":
        lo = rng.randint(-10, 10)
        return {"type": "number", "minimum": lo, "maximum": lo + rng.randint(1, 100)}
    return {"type": "boolean"}


def random_instance(schema: dict, rng: random.Random):
    """A document that satisfies `schema` (one of `random_schema`'s)."""
    if "enum" in schema:
        return rng.choice(schema["enum"])
    kind = schema["type"]
    if kind == "object":
        props = schema["properties"]
        keep = [n for n in props if n in schema["required"] or rng.random() < 0.5]
        return {n: random_instance(props[n], rng) for n in keep}
    if kind == "array":
        return [random_instance(schema["items"], rng)
                for _ in range(rng.randint(schema["minItems"], schema["maxItems"]))]
    if kind == "string":
        return "".join(rng.choice(string.ascii_letters + " ") for _ in range(rng.randint(0, schema["maxLength"])))
    if kind == "integer":
        return rng.randint(schema["minimum"], schema["maximum"])
    if kind == "number":
        return round(rng.uniform(schema["minimum"], schema["maximum"]), 2)
    return rng.random() < 0.5


def schemas(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [random_schema(rng) for _ in range(n)]
