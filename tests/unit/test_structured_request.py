"""Request fields beyond the plain sampling knobs: response_format and vLLM's structured outputs to one
StructuredOutput, logit_bias, min_p, min_tokens, chat_template_kwargs, continuous usage, and every field
Ferry does not support refused with a 400 naming it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import msgspec
import pytest

from schemas.kafka import ErrorInfo, StructuredOutput
from schemas.openai import chat_request_decoder, completion_request_decoder
from server.errors import APIError, error_status, from_validation_error
from server.model_files import ModelFiles
from server.preprocess import Prepared, Preprocessor

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
MSGS = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def pre(model_path: Path) -> Preprocessor:
    return Preprocessor(ModelFiles.load(model_path, "m"), 10_000)


async def chat(pre: Preprocessor, **fields: Any) -> Prepared:
    """A chat request through the decoder and the preprocessor, as the route runs it."""
    try:
        req = chat_request_decoder.decode(json.dumps({"model": "m", "messages": MSGS, **fields}))
    except msgspec.ValidationError as e:
        raise from_validation_error(e) from None
    return await pre.chat(req, 2048)


async def completion(pre: Preprocessor, **fields: Any) -> Prepared:
    try:
        req = completion_request_decoder.decode(json.dumps({"model": "m", "prompt": "hi", **fields}))
    except msgspec.ValidationError as e:
        raise from_validation_error(e) from None
    return await pre.completion(req, 2048)


async def refused(pre: Preprocessor, **fields: Any) -> APIError:
    with pytest.raises(APIError) as err:
        await chat(pre, **fields)
    assert err.value.status == 400
    return err.value


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"response_format": {"type": "text"}}, None),
        ({"response_format": {"type": "json_object"}}, StructuredOutput(json_object=True)),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "A", "schema": SCHEMA, "strict": True},
                }
            },
            StructuredOutput(json_schema=json.dumps(SCHEMA, separators=(",", ":"))),
        ),
        (
            {"structured_outputs": {"json": SCHEMA}},
            StructuredOutput(json_schema=json.dumps(SCHEMA, separators=(",", ":"))),
        ),
        (
            {"structured_outputs": {"json": json.dumps(SCHEMA)}},
            StructuredOutput(json_schema=json.dumps(SCHEMA, separators=(",", ":"))),
        ),
        ({"structured_outputs": {"regex": "[ab]+"}}, StructuredOutput(regex="[ab]+")),
        ({"structured_outputs": {"choice": ["yes", "no"]}}, StructuredOutput(choice=["yes", "no"])),
        ({"structured_outputs": {"grammar": 'root ::= "a"'}}, StructuredOutput(grammar='root ::= "a"')),
        ({"structured_outputs": {"json_object": True}}, StructuredOutput(json_object=True)),
        ({"guided_json": SCHEMA}, StructuredOutput(json_schema=json.dumps(SCHEMA, separators=(",", ":")))),
        ({"guided_regex": "x+"}, StructuredOutput(regex="x+")),
        ({"guided_choice": ["a", "b"]}, StructuredOutput(choice=["a", "b"])),
        ({"guided_grammar": 'root ::= "a"'}, StructuredOutput(grammar='root ::= "a"')),
    ],
)
async def test_every_way_to_ask_for_a_constraint_is_one_structured_output(
    pre: Preprocessor, fields: dict[str, Any], expected: StructuredOutput | None
) -> None:
    assert (await chat(pre, **fields)).sampling.structured == expected
    assert (await completion(pre, **fields)).sampling.structured == expected


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "A", "schema": {"type": "nope"}}}},
         "response_format.json_schema.schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "A", "schema": {"minLength": -1}}}},
         "response_format.json_schema.schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "A"}}}, "response_format.json_schema.schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "a b", "schema": SCHEMA}}},
         "response_format.json_schema.name"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}}, "response_format.json_schema.name"),
        ({"response_format": {"type": "structural_tag"}}, "response_format.type"),
        ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json"),
        ({"structured_outputs": {"json": [1]}}, "structured_outputs.json"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
        ({"structured_outputs": {}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs.choice"),
        ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
        ({"structured_outputs": {"regex": "a", "whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern"),
        ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag"),
        ({"structured_outputs": {"regex": "a", "backend": "x"}}, "structured_outputs.backend"),
        ({"guided_json": SCHEMA, "guided_decoding_backend": "xgrammar"}, "guided_decoding_backend"),
    ],
)  # fmt: skip
async def test_bad_constraints_are_400s_naming_the_field(
    pre: Preprocessor, fields: dict[str, Any], param: str
) -> None:
    assert (await refused(pre, **fields)).param == param


async def test_an_invalid_schema_says_where(pre: Preprocessor) -> None:
    bad = {"type": "object", "properties": {"a": {"type": 5}}}
    err = await refused(
        pre, response_format={"type": "json_schema", "json_schema": {"name": "A", "schema": bad}}
    )
    assert "properties/a/type" in err.message and err.code == "invalid_value"


async def test_logit_bias_min_p_and_min_tokens_reach_the_worker(pre: Preprocessor) -> None:
    p = await chat(pre, logit_bias={"17": -100, "42": 5.5}, min_p=0.1, min_tokens=3, max_tokens=8)
    assert (p.sampling.logit_bias, p.sampling.min_p, p.sampling.min_tokens) == ({17: -100.0, 42: 5.5}, 0.1, 3)
    assert (await chat(pre, min_p=None)).sampling.min_p == 0.0


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"logit_bias": {"49152": 1}}, "logit_bias"),  # the vocabulary has 49,152 tokens
        ({"logit_bias": {"-1": 1}}, "logit_bias"),
        ({"logit_bias": {"hello": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"logit_bias": {"5": "x"}}, "logit_bias[...]"),
        ({"min_p": 1.5}, "min_p"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 9, "max_tokens": 8}, "min_tokens"),
        ({"min_tokens": 9, "max_completion_tokens": 8}, "min_tokens"),
    ],
)
async def test_sampling_extensions_are_checked(pre: Preprocessor, fields: dict[str, Any], param: str) -> None:
    assert (await refused(pre, **fields)).param == param


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("audio", {"voice": "alloy", "format": "wav"}),
        ("modalities", ["text", "audio"]),
        ("prediction", {"type": "content", "content": "x"}),
        ("web_search_options", {}),
        ("reasoning_effort", "low"),
        ("verbosity", "low"),
        ("use_beam_search", True),
        ("include_stop_str_in_output", True),
        ("bad_words", ["x"]),
        ("allowed_token_ids", [1]),
        ("continue_final_message", True),
        ("chat_template", "{{ messages }}"),
        ("echo", True),
        ("store", True),
        ("service_tier", "flex"),
        ("function_call", "auto"),  # unknown to Ferry altogether
        ("some_new_field", 1),
    ],
)
async def test_what_ferry_does_not_do_is_a_400_naming_the_field(
    pre: Preprocessor, field: str, value: object
) -> None:
    err = await refused(pre, **{field: value})
    assert (err.param, err.code) == (field, "unsupported_parameter")
    assert err.body().error.type == "invalid_request_error"


@pytest.mark.parametrize(
    "fields", [{"prompt_logprobs": -1}, {"prompt_logprobs": 21}, {"prompt_logprobs": 1, "stream": True}]
)
async def test_prompt_logprobs_are_bounded_and_not_streamed(
    pre: Preprocessor, fields: dict[str, object]
) -> None:
    assert (await refused(pre, **fields)).param == "prompt_logprobs"


async def test_prompt_logprobs_reach_the_worker(pre: Preprocessor) -> None:
    assert (await completion(pre, prompt_logprobs=3)).sampling.prompt_logprobs == 3
    assert (await chat(pre)).sampling.prompt_logprobs is None


async def test_unknown_fields_inside_objects_are_named_with_their_path(pre: Preprocessor) -> None:
    err = await refused(pre, stream=True, stream_options={"include_usage": True, "x": 1})
    assert (err.param, err.code) == ("stream_options.x", "unsupported_parameter")
    with pytest.raises(APIError) as e:
        await completion(pre, best_of=2)
    assert e.value.param == "best_of"


async def test_off_values_and_metadata_are_accepted(pre: Preprocessor) -> None:
    await chat(
        pre, user="u", safety_identifier="s", metadata={"k": "v"}, service_tier="auto", store=False,
        prompt_cache_key="k", modalities=["text"], use_beam_search=False, length_penalty=1, echo=False,
        include_stop_str_in_output=False, spaces_between_special_tokens=True, bad_words=[], add_special_tokens=False,
        stream=True, stream_options={"include_usage": True, "include_obfuscation": False},
    )  # fmt: skip
    await completion(pre, best_of=1, echo=True)


async def test_continuous_usage_needs_include_usage_as_in_vllm(pre: Preprocessor) -> None:
    on = {"include_usage": True, "continuous_usage_stats": True}
    assert (await chat(pre, stream=True, stream_options=on)).continuous_usage
    assert not (
        await chat(pre, stream=True, stream_options={"continuous_usage_stats": True})
    ).continuous_usage


@pytest.fixture
def thinking(model_path: Path, tmp_path: Path) -> Preprocessor:
    """The default model with a template that reads a variable of its own, as Qwen3's reads enable_thinking."""
    for f in model_path.iterdir():
        if f.is_file():
            shutil.copy(f, tmp_path / f.name)
    (tmp_path / "chat_template.jinja").write_text(
        "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if enable_thinking %}<think>{% endif %}{{ (tail or '') + '' }}"
    )
    return Preprocessor(ModelFiles.load(tmp_path, "m"), 10_000)


async def test_chat_template_kwargs_reach_the_template(thinking: Preprocessor) -> None:
    pre = thinking
    assert (await chat(pre, chat_template_kwargs={"enable_thinking": True})).prompt_texts == ["hi<think>"]
    assert (await chat(pre)).prompt_texts == ["hi"]
    err = await refused(pre, chat_template_kwargs={"messages": []})
    assert err.param == "chat_template_kwargs.messages"
    # A value the template cannot use is the request's fault, not a server error.
    assert (await chat(pre, chat_template_kwargs={"tail": "!"})).prompt_texts == ["hi!"]
    assert (await refused(pre, chat_template_kwargs={"tail": 5})).param == "messages"


def test_a_constraint_an_engine_refuses_is_the_clients_error() -> None:
    for code in ("invalid_structured_output", "unsupported_structured_output", "invalid_request"):
        assert error_status(ErrorInfo(code, "no")).status == 400
    assert error_status(ErrorInfo("engine_dead", "no")).status == 500
