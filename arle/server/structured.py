"""`response_format` and tool parameters -> the grammar the engine constrains the output with.

`json_object`: any JSON object. `json_schema`: JSON that validates against the schema. With
`strict: true` a schema keyword the grammar cannot enforce is refused (400); without it such a
keyword is ignored (the rest still holds), as OpenAI's non-strict mode promises no more.

Two rules hold for every schema, strict or not (docs/structured.md):
- closed by default, as xgrammar's strict mode in vLLM and SGLang: an object schema that does
  not say `additionalProperties` allows only the properties it names, and an array with
  `prefixItems` and no `items` only those items. `"additionalProperties": true` (or a schema)
  keeps extras.
- satisfiable: a schema no finite JSON value can satisfy (a `$ref` cycle with no way out, a
  required property that cannot exist) is refused with a 400 naming the pointer, rather than
  constraining the output to nothing.
"""

from __future__ import annotations

from typing import Any

from arle.engine.request import Grammar
from arle.errors import InvalidRequestError
from arle.server.protocol import ResponseFormat


def schema_grammar(schema: dict[str, Any], strict: bool, param: str) -> Grammar:
    """A JSON schema as a grammar, closed and checked (module docstring); not strict: keywords
    the grammar cannot enforce are ignored."""
    unsatisfiable = _unsatisfiable(schema)
    if unsatisfiable is not None:
        raise InvalidRequestError(f"the schema at {unsatisfiable} admits no finite JSON value "
                                  "(a $ref cycle with no way out, or a required property that "
                                  "cannot exist)", param=param)
    schema = closed(schema)
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


_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")
_SUBSCHEMAS = ("items", "additionalProperties", "not", "if", "then", "else", "contains")


def closed(schema: Any) -> Any:
    """`schema` with every object that does not say `additionalProperties` closed to the
    properties it names, and every array with `prefixItems` and no `items` to those items."""
    if not isinstance(schema, dict):
        return schema
    out = {k: closed(v) if k in _SUBSCHEMAS else v for k, v in schema.items()}
    for key in _SUBSCHEMA_LISTS:
        if isinstance(schema.get(key), list):
            out[key] = [closed(v) for v in schema[key]]
    for key in _SUBSCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            out[key] = {k: closed(v) for k, v in schema[key].items()}
    is_object = schema.get("type") == "object" or "properties" in schema
    if is_object and "additionalProperties" not in schema and "patternProperties" not in schema:
        out["additionalProperties"] = False
    if "prefixItems" in schema and "items" not in schema:
        out["items"] = False
    return out


def _unsatisfiable(root: Any) -> str | None:
    """The pointer of a local `$ref` whose target no finite value satisfies ("#": the root
    itself), or None when the schema can be satisfied. A least fixpoint: every ref starts
    unsatisfiable and passes once its target is satisfiable with the refs passed so far, so a
    cycle passes only through a way out of it."""
    ok = dict.fromkeys(_local_refs(root), False)
    changed = True
    while changed:
        changed = False
        for ref, passed in ok.items():
            target = _resolve(root, ref)
            if not passed and target is not None and _satisfiable(target, ok):
                ok[ref] = changed = True
    if _satisfiable(root, ok):
        return None
    return next((ref for ref, passed in ok.items() if not passed), "#")


def _local_refs(node: Any) -> list[str]:
    if isinstance(node, list):
        return [r for v in node for r in _local_refs(v)]
    if not isinstance(node, dict):
        return []
    own = node.get("$ref")
    found = [own] if isinstance(own, str) and own.startswith("#") else []
    return found + [r for v in node.values() for r in _local_refs(v)]


def _satisfiable(schema: Any, refs: dict[str, bool]) -> bool:
    """Whether some finite value satisfies `schema`, each local `$ref` as `refs` says."""
    if isinstance(schema, bool) or not isinstance(schema, dict):
        return schema is not False
    ref = schema.get("$ref")
    if isinstance(ref, str) and not refs.get(ref, True):
        return False

    def sat(s: Any) -> bool:
        return _satisfiable(s, refs)

    if not all(sat(s) for s in schema.get("allOf", [])):
        return False
    if any(key in schema and not any(sat(s) for s in schema[key]) for key in ("anyOf", "oneOf")):
        return False
    props = schema.get("properties", {})
    extra = schema.get("additionalProperties", True)
    if not all(sat(props.get(name, extra)) for name in schema.get("required", [])):
        return False
    least = schema.get("minItems", 0) if schema.get("type") == "array" else 0
    prefix = schema.get("prefixItems", [])
    return (all(sat(s) for s in prefix[:least])
            and (least <= len(prefix) or sat(schema.get("items", True))))


def _resolve(root: Any, pointer: str) -> Any:
    """The subschema a local `$ref` names ("#", "#/$defs/a", JSON pointer escapes); None if
    it names nothing."""
    node = root
    for part in pointer.lstrip("#").split("/")[1:] if pointer != "#" else []:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node
