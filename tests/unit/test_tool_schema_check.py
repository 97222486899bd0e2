"""A tool's parameters are checked by jsonschema against the meta-schema of the draft they name: the 400
names the tool, its parameter path and jsonschema's reason."""

from __future__ import annotations

from typing import Any

from server.tools import schema_problem
from tests.unit.test_tool_requests import WEATHER, planned, refused


def _tool(parameters: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": "broken", "parameters": parameters}}


def test_the_400_names_the_tool_the_place_and_the_reason() -> None:
    err = refused(tools=[WEATHER, _tool({"type": "object", "properties": {"n": {"minimum": "zero"}}})])
    assert err.param == "tools[1].function.parameters"
    assert "tool 'broken'" in err.message and "properties/n/minimum" in err.message
    assert "'zero' is not of type 'number'" in err.message


def test_the_draft_a_schema_names_is_the_one_it_is_checked_against() -> None:
    # Tuple items: valid in draft 7, not in 2020-12 (where prefixItems took their place).
    tuple_items = {"type": "array", "items": [{"type": "string"}, {"type": "integer"}]}
    draft7 = {"$schema": "http://json-schema.org/draft-07/schema#", **tuple_items}
    assert schema_problem(draft7) is None
    assert schema_problem(tuple_items) is not None
    # At the top of the parameters, where jsonschema reads it.
    params = {"$schema": draft7["$schema"], "type": "object", "properties": {"pair": tuple_items}}
    assert planned(tools=[_tool(params)]).tools


def test_a_schema_nested_too_deeply_is_a_400() -> None:
    deep: dict[str, Any] = {"type": "object"}
    for _ in range(300):  # within what json and msgspec take, beyond what a recursive check would
        deep = {"type": "object", "properties": {"a": deep}}
    err = refused(tools=[_tool(deep)])
    assert err.param == "tools[0].function.parameters"
