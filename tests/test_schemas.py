"""Every JSON schema a request constrains with (response_format, tool parameters) is closed by
default and checked for satisfiability before it becomes a grammar (arle/server/structured.py):
an object allows only the properties it names unless it says otherwise, and a schema no finite
value satisfies is the request's 400, naming the pointer."""

from __future__ import annotations

from typing import Any

import pytest

from arle.engine.grammar import GrammarCompiler
from arle.errors import InvalidRequestError
from arle.model.loader import LoadedModel
from arle.server.structured import closed, schema_grammar

CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
        "required": ["city"]}


def _accepts(tiny: LoadedModel, schema: dict[str, Any], text: str) -> bool:
    """Whether the grammar of `schema` (as a request sends it) takes all of `text`, to its end."""
    matcher = GrammarCompiler(tiny.tokenizer).matcher(schema_grammar(schema, False, "x"))
    ids = tiny.tokenizer.encode(text, add_special_tokens=False)
    return bool(matcher.validate_tokens(ids) == len(ids) and matcher.consume_tokens(ids)
                and matcher.is_accepting())


def test_an_object_allows_only_the_properties_it_names(tiny: LoadedModel) -> None:
    assert _accepts(tiny, CITY, '{"city":"Paris"}')
    assert not _accepts(tiny, CITY, '{"city":"Paris","extra":1}')
    nested = {"type": "array", "items": CITY}
    assert not _accepts(tiny, nested, '[{"city":"Paris","extra":1}]')


def test_additional_properties_true_keeps_extras(tiny: LoadedModel) -> None:
    assert _accepts(tiny, {**CITY, "additionalProperties": True}, '{"city":"Paris","extra":1}')
    typed = {**CITY, "additionalProperties": {"type": "integer"}}
    assert _accepts(tiny, typed, '{"city":"Paris","extra":1}')
    assert not _accepts(tiny, typed, '{"city":"Paris","extra":"no"}')


def test_closing_reaches_every_subschema_and_only_objects() -> None:
    schema = {"$defs": {"p": {"properties": {"a": {"type": "integer"}}}},
              "type": "object", "properties": {"xs": {"type": "array", "items": {"$ref": "#/$defs/p"}},
                                                "t": {"prefixItems": [{"type": "string"}]},
                                                "u": {"anyOf": [{"type": "object"}, {"type": "null"}]}}}
    out = closed(schema)
    assert out["additionalProperties"] is False
    assert out["$defs"]["p"]["additionalProperties"] is False
    assert out["properties"]["t"]["items"] is False
    assert out["properties"]["u"]["anyOf"][0]["additionalProperties"] is False
    assert "additionalProperties" not in out["properties"]["u"]["anyOf"][1]
    assert "additionalProperties" not in schema  # the request's own schema is left as sent


@pytest.mark.parametrize(("schema", "pointer"), [
    ({"$ref": "#"}, "#"),
    ({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
     "#/$defs/"),
    ({"type": "object", "properties": {"next": {"$ref": "#"}}, "required": ["next"]}, "#"),
    ({"type": "array", "minItems": 1, "items": {"$ref": "#"}}, "#"),
    ({"type": "object", "required": ["x"], "additionalProperties": False}, "#"),
])
def test_a_schema_no_value_satisfies_is_refused(schema: dict[str, Any], pointer: str) -> None:
    with pytest.raises(InvalidRequestError) as e:
        schema_grammar(schema, True, "response_format.json_schema.schema")
    assert e.value.param == "response_format.json_schema.schema"
    assert f"the schema at {pointer}" in str(e.value)


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"next": {"$ref": "#"}}},
    {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}}},
     "required": ["kids"]},
    {"anyOf": [{"type": "null"}, {"type": "object", "properties": {"n": {"$ref": "#"}},
                                   "required": ["n"]}]},
])
def test_a_recursive_schema_with_a_way_out_is_kept(tiny: LoadedModel,
                                                    schema: dict[str, Any]) -> None:
    schema_grammar(schema, True, "x")
    assert _accepts(tiny, schema, "null" if "anyOf" in schema else '{"kids":[]}'
                    if "kids" in schema["properties"] else "{}")
