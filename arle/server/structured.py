"""`response_format` -> the grammar the engine constrains the output with.

`json_object`: any JSON object. `json_schema`: JSON that validates against the schema. With
`strict: true` a schema keyword the grammar cannot enforce is refused (400); without it such a
keyword is ignored (the rest still holds), as OpenAI's non-strict mode promises no more.
"""

from __future__ import annotations

from typing import Any

from arle.engine.request import Grammar
from arle.errors import InvalidRequestError
from arle.server.protocol import ResponseFormat


def schema_grammar(schema: dict[str, Any], strict: bool, param: str) -> Grammar:
    """A JSON schema as a grammar; not strict: keywords the grammar cannot enforce are ignored."""
    if not strict:
        options = schema.get("x-guidance") if isinstance(schema.get("x-guidance"), dict) else {}
        schema = {**schema, "x-guidance": {"lenient": True, **(options or {})}}
    return Grammar("json_schema", schema, param=param)


def response_format_grammar(fmt: ResponseFormat | None) -> Grammar | None:
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return Grammar("json_object", param="response_format")
    js = fmt.json_schema
    if js is None:
        raise InvalidRequestError("response_format json_schema needs its json_schema object",
                                  param="response_format.json_schema")
    schema = js.schema_ if js.schema_ is not None else {"type": "object"}
    return schema_grammar(schema, bool(js.strict), "response_format.json_schema.schema")
