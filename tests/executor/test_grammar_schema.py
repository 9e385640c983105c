"""JSON schemas as vLLM's default backend reads them: objects closed where they say
nothing of other properties."""

from __future__ import annotations

from hybridkv.executor.grammars import close_objects


def test_objects_that_list_properties_are_closed_at_every_depth() -> None:
    schema = {
        "type": "object",
        "properties": {
            "properties": {"type": "object", "properties": {"x": {"type": "number"}}},
            "tags": {"type": "array", "items": {"type": "object", "properties": {}}},
        },
        "$defs": {"p": {"anyOf": [{"properties": {"a": {}}}, {"type": "string"}]}},
    }
    closed = close_objects(schema)
    assert closed["additionalProperties"] is False
    inner = closed["properties"]["properties"]  # a property named "properties"
    assert (
        inner["additionalProperties"] is False and "additionalProperties" not in inner["properties"]
    )
    assert closed["properties"]["tags"]["items"]["additionalProperties"] is False
    assert closed["$defs"]["p"]["anyOf"][0]["additionalProperties"] is False
    assert schema.get("additionalProperties") is None  # the input is left as it was


def test_what_a_schema_says_of_other_properties_holds() -> None:
    assert close_objects({"type": "object"}) == {"type": "object"}  # any object
    open_one = {"properties": {"a": {}}, "additionalProperties": True}
    assert close_objects(open_one)["additionalProperties"] is True
    typed = {"properties": {}, "additionalProperties": {"properties": {"b": {}}}}
    assert close_objects(typed)["additionalProperties"]["additionalProperties"] is False
