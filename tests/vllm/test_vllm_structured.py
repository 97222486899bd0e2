"""Structured outputs, logit_bias, min_p and min_tokens on the real vLLM engine with the default model."""

from __future__ import annotations

import json
import re
import uuid

import jsonschema
import pytest

from schemas.kafka import GenerateRequest, SamplingParams, StructuredOutput
from schemas.settings import DEFAULT_MODEL_NAME
from server.model_files import ModelFiles
from workers.engine import EngineError, EngineOutput
from workers.vllm_engine import VLLMEngine
from workers.vllm_params import logit_fields

pytestmark = pytest.mark.vllm

CAPITAL = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "country": {"type": "string", "maxLength": 24},
        "is_capital": {"type": "boolean"},
    },
    "required": ["city", "country", "is_capital"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def question(files: ModelFiles) -> list[int]:
    text = files.render_chat([{"role": "user", "content": "What is the capital of France? Answer in JSON."}])
    return files.encode(text, add_special_tokens=False)


async def run(
    engine: VLLMEngine, prompt: list[int], max_tokens: int = 64, **sampling: object
) -> list[EngineOutput]:
    request = GenerateRequest(
        request_id=f"s-{uuid.uuid4().hex[:8]}",
        model=DEFAULT_MODEL_NAME,
        prompt_token_ids=prompt,
        max_tokens=max_tokens,
        reply_topic="unused",
        sampling=SamplingParams(temperature=0.0, **sampling),  # type: ignore[arg-type]
    )
    return [out async for out in engine.generate(request)]


def text(outs: list[EngineOutput]) -> str:
    return "".join(o.text for o in outs)


def token_ids(outs: list[EngineOutput]) -> list[int]:
    return [t for o in outs for t in o.token_ids]


async def test_json_schema_answer_validates(vllm_engine: VLLMEngine, question: list[int]) -> None:
    outs = await run(vllm_engine, question, 96, structured=StructuredOutput(json_schema=json.dumps(CAPITAL)))
    assert outs[-1].finish_reason == "stop", text(outs)
    jsonschema.validate(json.loads(text(outs)), CAPITAL)


async def test_json_object_answer_is_an_object(vllm_engine: VLLMEngine, question: list[int]) -> None:
    outs = await run(vllm_engine, question, 96, structured=StructuredOutput(json_object=True))
    assert outs[-1].finish_reason == "stop", text(outs)
    assert isinstance(json.loads(text(outs)), dict)


async def test_choice_answer_is_one_of_the_choices(vllm_engine: VLLMEngine, question: list[int]) -> None:
    choices = ["Paris", "London", "Berlin"]
    outs = await run(vllm_engine, question, structured=StructuredOutput(choice=choices))
    assert text(outs) in choices and outs[-1].finish_reason == "stop"


async def test_regex_answer_matches(vllm_engine: VLLMEngine, question: list[int]) -> None:
    pattern = r"[A-Z][a-z]{2,10}, [A-Z][a-z]{2,10}"
    outs = await run(vllm_engine, question, structured=StructuredOutput(regex=pattern))
    assert re.fullmatch(pattern, text(outs)), text(outs)


@pytest.mark.parametrize(
    "constraint",
    [
        StructuredOutput(regex="(unclosed"),
        StructuredOutput(grammar="this is no grammar ::= ::="),
        StructuredOutput(
            json_schema=json.dumps({"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}})
        ),
    ],
)
async def test_a_constraint_vllm_refuses_is_a_non_retriable_error(
    vllm_engine: VLLMEngine, question: list[int], constraint: StructuredOutput
) -> None:
    with pytest.raises(EngineError) as err:
        await run(vllm_engine, question, structured=constraint)
    assert err.value.code == "invalid_structured_output" and not err.value.retriable
    # The engine goes on serving.
    assert (await run(vllm_engine, question, 4))[-1].finish_reason == "length"


async def test_min_tokens_outlasts_eos(
    vllm_engine: VLLMEngine, question: list[int], files: ModelFiles
) -> None:
    natural = await run(vllm_engine, question, 200)
    assert natural[-1].finish_reason == "stop"
    n = len(token_ids(natural))
    longer = await run(vllm_engine, question, 200, min_tokens=n + 8)
    assert len(token_ids(longer)) >= n + 8
    assert files.eos_token_id not in token_ids(longer)[: n + 7]


async def test_min_tokens_skips_an_early_stop_string(vllm_engine: VLLMEngine, files: ModelFiles) -> None:
    prompt = files.encode(
        files.render_chat([{"role": "user", "content": "What is the capital of France?"}]),
        add_special_tokens=False,
    )
    answer = await run(vllm_engine, prompt, 48)
    assert "Paris" in text(answer)
    stopped = await run(vllm_engine, prompt, 48, stop=["Paris"])
    assert stopped[-1].stop_reason == "Paris"
    k = len(token_ids(stopped))
    # With min_tokens past the token that completes "Paris", that occurrence does not stop it.
    later = await run(vllm_engine, prompt, 48, stop=["Paris"], min_tokens=k + 2)
    assert text(later).startswith(text(stopped) + "Paris")


async def test_logit_bias_bans_and_min_p_is_taken(vllm_engine: VLLMEngine, question: list[int]) -> None:
    free = token_ids(await run(vllm_engine, question, 8))
    banned = token_ids(await run(vllm_engine, question, 8, logit_bias={free[0]: -100.0}))
    assert banned[0] != free[0]
    forced = token_ids(await run(vllm_engine, question, 4, logit_bias={free[3]: 100.0}))
    assert set(forced) == {free[3]}
    assert token_ids(await run(vllm_engine, question, 8, min_p=0.1)) == free


def test_min_tokens_left_for_vllm_after_a_migration() -> None:
    def fields(min_tokens: int, prior: int, max_tokens: int) -> object:
        sampling = SamplingParams(min_tokens=min_tokens, logit_bias={5: 1.5}, min_p=0.2)
        req = GenerateRequest(
            "r", "m", [1, 2], max_tokens, "t", sampling=sampling, generated_token_ids=[7] * prior
        )
        return logit_fields(req)

    assert fields(10, 0, 20) == {"logit_bias": {5: 1.5}, "min_p": 0.2, "min_tokens": 10}
    assert fields(10, 4, 16) == {"logit_bias": {5: 1.5}, "min_p": 0.2, "min_tokens": 6}
    assert fields(10, 12, 8) == {"logit_bias": {5: 1.5}, "min_p": 0.2, "min_tokens": 0}


async def test_a_migrated_structured_request_is_refused(vllm_engine: VLLMEngine, question: list[int]) -> None:
    # vLLM's grammar would start again after the migrated tokens: an error beats invalid JSON.
    request = GenerateRequest(
        request_id="migrated",
        model=DEFAULT_MODEL_NAME,
        prompt_token_ids=question,
        max_tokens=16,
        reply_topic="unused",
        sampling=SamplingParams(structured=StructuredOutput(json_object=True)),
        generated_token_ids=[90],
        attempt=1,
    )
    with pytest.raises(EngineError) as err:
        vllm_engine.generate(request)
    assert err.value.code == "structured_output_not_resumable" and not err.value.retriable
