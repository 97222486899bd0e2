"""Tool-call parsers: whole outputs read as vLLM's parsers of the same name read them, and streamed outputs
cut anywhere give the same calls, piece by piece."""

from __future__ import annotations

import json
import random
import typing

import pytest

from schemas.openai import DeltaToolCall
from schemas.settings import ToolCallParser
from schemas.streams import ToolCallMode
from server.tool_parsers import PARSERS, ToolParser, assemble, call_id, parser_for
from server.tool_parsers.base import Step
from server.tool_parsers.partial_json import NotJSON, scan_object, value_end


def auto(name: str) -> ToolParser:
    return parser_for(ToolCallMode("auto", parser=name), "chatcmpl-x", 0)


def streamed(parser: ToolParser, text: str, cuts: list[int]) -> Step:
    """Feed `text` cut at `cuts`, then end; every step's content and call pieces in order."""
    out = Step()
    last = 0
    for cut in [*cuts, len(text)]:
        out.extend(parser.feed(text[last:cut]))
        last = cut
    out.extend(parser.end())
    return out


def cuttings(text: str) -> list[list[int]]:
    """One piece per character, and a few random cuttings."""
    rng = random.Random(len(text))
    ways = [list(range(1, len(text)))]
    for _ in range(5):
        ways.append(sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12)))))
    return ways


def check_pieces(pieces: list[DeltaToolCall]) -> None:
    """A call's first piece carries id, type and name; later pieces only more arguments."""
    seen: set[int] = set()
    for p in pieces:
        assert p.function is not None
        if p.index not in seen:
            assert p.id and p.type == "function" and p.function.name, p
            assert p.index == len(seen)  # calls start in order
            seen.add(p.index)
        else:
            assert p.id is None and p.type is None and p.function.name is None and p.function.arguments, p


HERMES = (
    'Let me check both. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n'
    '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "Europe/Paris", "n": [1, 2.5e3]}}\n'
    "</tool_call>"
)
LLAMA = '{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "arguments": {"tz": "UTC"}}'
MISTRAL_OLD = 'Checking.[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {"tz": "UTC"}}]'
MISTRAL_NEW = '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time{"tz": "UTC"}'
TWO_CALLS = [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "UTC"})]

CASES = [
    (
        "hermes",
        HERMES,
        "Let me check both. ",
        [
            ("get_weather", {"city": "Paris", "unit": "c"}),
            ("get_time", {"tz": "Europe/Paris", "n": [1, 2500.0]}),
        ],
    ),
    ("llama3_json", LLAMA, None, TWO_CALLS),
    ("llama3_json", "<|python_tag|>" + LLAMA, None, TWO_CALLS),
    ("mistral", MISTRAL_OLD, "Checking.", TWO_CALLS),
    ("mistral", MISTRAL_NEW, None, TWO_CALLS),
]


def test_every_parser_flag_value_has_a_parser() -> None:
    assert set(typing.get_args(ToolCallParser)) - {""} == set(PARSERS)


@pytest.mark.parametrize(("name", "text", "content", "calls"), CASES)
def test_whole_output(name: str, text: str, content: str | None, calls: list[tuple[str, object]]) -> None:
    got_content, got = auto(name).whole(text)
    assert got_content == content
    assert [(c.function.name, json.loads(c.function.arguments)) for c in got] == calls
    # Arguments re-encoded as vLLM re-encodes them.
    assert got[0].function.arguments == json.dumps(calls[0][1], ensure_ascii=False)
    assert len({c.id for c in got}) == len(got)


@pytest.mark.parametrize(("name", "text", "content", "calls"), CASES)
def test_streamed_output_cut_anywhere(
    name: str, text: str, content: str | None, calls: list[tuple[str, object]]
) -> None:
    for cuts in cuttings(text):
        step = streamed(auto(name), text, cuts)
        check_pieces(step.calls)
        assert (step.content or None) == content, cuts
        got = assemble(step.calls)
        assert [(c.function.name, json.loads(c.function.arguments)) for c in got] == calls, cuts
        # The same ids as the whole output's: a function of the request, the choice and the index.
        assert [c.id for c in got] == [c.id for c in auto(name).whole(text)[1]]


def test_hermes_streams_arguments_as_they_arrive() -> None:
    parser = auto("hermes")
    assert parser.feed("Sure") == Step("Sure")
    # A possible start of a tag is held back, not sent as content.
    assert parser.feed(" <tool_") == Step(" ")
    first = parser.feed('call>{"name": "f", "arguments": {"a": "xy')
    assert first.content == ""
    [piece] = first.calls
    assert (piece.index, piece.id, piece.function.name) == (0, call_id("chatcmpl-x/0/0"), "f")  # type: ignore[union-attr]
    assert piece.function.arguments == '{"a": "xy'  # type: ignore[union-attr]
    more = parser.feed('z"}}</tool_call>')
    assert [(p.index, p.id, p.function.arguments) for p in more.calls] == [(0, None, 'z"}')]  # type: ignore[union-attr]
    assert parser.end() == Step()


def test_text_that_only_looked_like_a_call_is_content_in_the_end() -> None:
    parser = auto("hermes")
    assert parser.feed("a <tool") == Step("a ")
    assert parser.end() == Step("<tool")
    parser = auto("hermes")
    text = "see <tool_call>not json</tool_call>"
    assert streamed(parser, text, [5, 12]).content == text
    assert auto("hermes").whole(text) == (text, [])


def test_plain_answers_have_no_calls() -> None:
    for name in PARSERS:
        assert auto(name).whole("Paris is the capital of France.") == ("Paris is the capital of France.", [])
        step = streamed(auto(name), "Paris is the capital.", [3, 9])
        assert step.content == "Paris is the capital." and not step.calls


def test_llama_json_without_a_name_is_content() -> None:
    text = '{"city": "Paris"}'
    assert auto("llama3_json").whole(text) == (text, [])
    assert streamed(auto("llama3_json"), text, [4]).content == text


def test_mistral_ids_are_nine_alphanumerics() -> None:
    _, calls = auto("mistral").whole(MISTRAL_NEW)
    assert all(len(c.id) == 9 and c.id.isalnum() for c in calls)


def required(parallel: bool = True) -> ToolParser:
    return parser_for(ToolCallMode("required", parallel=parallel), "chatcmpl-r", 1)


def test_required_output_is_an_array_of_calls() -> None:
    text = (
        '[{"name":"get_weather","parameters":{"city":"Paris"}},{"parameters":{"tz":"UTC"},"name":"get_time"}]'
    )
    content, calls = required().whole(text)
    assert content is None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == TWO_CALLS
    for cuts in cuttings(text):
        step = streamed(required(), text, cuts)
        check_pieces(step.calls)
        assert step.content == ""
        got = assemble(step.calls)
        assert [(c.function.name, c.function.arguments) for c in got] == [
            ("get_weather", '{"city":"Paris"}'),
            ("get_time", '{"tz":"UTC"}'),
        ]
        assert [c.id for c in got] == [c.id for c in calls]


def test_named_output_is_the_arguments() -> None:
    parser = parser_for(ToolCallMode("named", function="get_weather"), "chatcmpl-n", 0)
    assert parser.feed("") == Step()
    [first] = parser.feed('{"ci').calls
    assert (first.id, first.type, first.function.name, first.function.arguments) == (  # type: ignore[union-attr]
        call_id("chatcmpl-n/0/0"),
        "function",
        "get_weather",
        '{"ci',
    )
    [more] = parser.feed('ty": "Paris"}').calls
    assert more.function.arguments == 'ty": "Paris"}' and more.id is None  # type: ignore[union-attr]
    assert parser.end() == Step()
    whole = parser_for(ToolCallMode("named", function="get_weather"), "chatcmpl-n", 0).whole(
        '{"city": "Paris"}\n'
    )
    assert whole[0] is None and [(c.function.name, c.function.arguments) for c in whole[1]] == [
        ("get_weather", '{"city": "Paris"}')
    ]


def test_partial_json_scanning() -> None:
    text = '{"a": [1, {"b": "}"}], "c": "x\\"y", "d": 12'
    obj = scan_object(text, 0)
    assert [m.key for m in obj.members] == ["a", "c", "d"] and obj.end is None
    assert text[obj.members[0].start : obj.members[0].end] == '[1, {"b": "}"}]'
    assert obj.members[2].end is None  # a number at the end may still grow
    assert value_end('"abc', 0) is None and value_end("true,", 0) == 4
    with pytest.raises(NotJSON):
        scan_object('{"a" 1}', 0)
