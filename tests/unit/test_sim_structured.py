"""The simulated engine with structured outputs, logit_bias, min_tokens and min_p, on the default model's tokenizer."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from schemas.kafka import GenerateRequest, SamplingParams, StructuredOutput
from tests.unit.sim_support import SMALL_ENGINE
from workers.engine import EngineError, EngineOutput
from workers.model_dir import ModelInfo, load_model_info
from workers.sim import SimEngine
from workers.sim_config import SimConfig
from workers.sim_output import DrawnTokens, ScriptedTokens, TokenSource
from workers.structured import structured_text

MODEL = "sim-structured"
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "email": {"type": "string", "format": "email"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
        "city": {"anyOf": [{"type": "string"}, {"type": "null"}]},
    },
    "required": ["name", "age", "email", "tags", "city"],
    "additionalProperties": False,
}
JSON_PERSON = StructuredOutput(json_schema=json.dumps(PERSON))
PROMPT = [504, 3458, 314, 253, 1345, 28, 1159, 11, 216, 7, 10, 13]


@pytest.fixture(scope="module")
def info(model_path: Path) -> ModelInfo:
    return load_model_info(model_path)


MakeEngine = Callable[..., Awaitable[SimEngine]]


@pytest.fixture
async def make_engine(info: ModelInfo) -> AsyncIterator[MakeEngine]:
    engines: list[SimEngine] = []

    async def make(tokenizer: Tokenizer | None = None, **overrides: Any) -> SimEngine:
        engine = SimEngine(
            MODEL, tokenizer or info.tokenizer, SimConfig(**(SMALL_ENGINE | overrides)), info.eos_token_id
        )
        await engine.start()
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        await engine.stop()


def req(rid: str, max_tokens: int = 200, prompt: list[int] = PROMPT, **sampling: Any) -> GenerateRequest:
    return GenerateRequest(rid, MODEL, prompt, max_tokens, "replies", sampling=SamplingParams(**sampling))


async def run(engine: SimEngine, request: GenerateRequest) -> list[EngineOutput]:
    return [out async for out in engine.generate(request)]


def tokens(outs: list[EngineOutput]) -> list[int]:
    return [t for o in outs for t in o.token_ids]


def text(outs: list[EngineOutput]) -> str:
    return "".join(o.text for o in outs)


async def test_json_schema_answer_is_the_schema_text_in_model_tokens_then_eos(
    make_engine: MakeEngine, info: ModelInfo
) -> None:
    engine = await make_engine()
    outs = await run(engine, req("a", structured=JSON_PERSON, seed=3))
    answer = text(outs)
    jsonschema.validate(json.loads(answer), PERSON)
    expected = info.tokenizer.encode(answer, add_special_tokens=False).ids
    assert tokens(outs) == [*expected, info.eos_token_id]
    assert outs[-1].finish_reason == "stop" and outs[-1].stop_reason is None
    # One token per decode step, as for any output.
    assert all(len(o.token_ids) == 1 for o in outs)
    assert outs[0].prompt_tokens == len(PROMPT)


async def test_same_request_same_text_on_any_engine_and_seed_or_index_change_it(
    make_engine: MakeEngine,
) -> None:
    one, two = await make_engine(), await make_engine()
    first = text(await run(one, req("a", structured=JSON_PERSON, seed=3)))
    # Another engine, another request id, read late so deltas merge: still the same answer.
    stream = two.generate(req("b", structured=JSON_PERSON, seed=3))
    late = await run(two, req("warm", max_tokens=30, ignore_eos=True))  # lets "b" finish unread
    assert late
    assert text([out async for out in stream]) == first
    assert text(await run(one, req("c", structured=JSON_PERSON, seed=4))) != first
    other = GenerateRequest(
        "d", MODEL, PROMPT, 200, "r", sampling=SamplingParams(structured=JSON_PERSON, seed=3), index=1
    )
    assert text(await run(one, other)) != first


async def test_max_tokens_truncates_with_length(make_engine: MakeEngine) -> None:
    engine = await make_engine()
    full = await run(engine, req("a", structured=JSON_PERSON, seed=1))
    cut = await run(engine, req("b", max_tokens=5, structured=JSON_PERSON, seed=1))
    assert tokens(cut) == tokens(full)[:5]
    assert cut[-1].finish_reason == "length"
    assert text(full).startswith(text(cut))


async def test_migration_continues_the_same_text(make_engine: MakeEngine, info: ModelInfo) -> None:
    engine = await make_engine()
    full = await run(engine, req("a", structured=JSON_PERSON, seed=2))
    ids = tokens(full)
    for k in (1, 7, len(ids) - 1):
        moved = GenerateRequest(
            "m",
            MODEL,
            PROMPT,
            200 - k,
            "r",
            sampling=SamplingParams(structured=JSON_PERSON, seed=2),
            generated_token_ids=ids[:k],
            attempt=1,
        )
        rest = await run(engine, moved)
        assert ids[:k] + tokens(rest) == ids
        assert info.tokenizer.decode(ids[:k]) + text(rest) == text(full)


async def test_migration_after_another_tokenization_continues_the_text(
    make_engine: MakeEngine, info: ModelInfo
) -> None:
    engine = await make_engine()
    answer = text(await run(engine, req("a", structured=JSON_PERSON, seed=2)))
    # The first 12 characters, one token per character, as another engine might have produced them.
    prior = [t for ch in answer[:12] for t in info.tokenizer.encode(ch, add_special_tokens=False).ids]
    moved = GenerateRequest(
        "m",
        MODEL,
        PROMPT,
        300,
        "r",
        sampling=SamplingParams(structured=JSON_PERSON, seed=2),
        generated_token_ids=prior,
    )
    assert answer[:12] + text(await run(engine, moved)) == answer
    diverged = GenerateRequest(
        "x",
        MODEL,
        PROMPT,
        300,
        "r",
        sampling=SamplingParams(structured=JSON_PERSON, seed=2),
        generated_token_ids=info.tokenizer.encode("[1,", add_special_tokens=False).ids,
    )
    with pytest.raises(EngineError) as err:
        engine.generate(diverged)
    assert err.value.code == "structured_output_mismatch" and not err.value.retriable


async def test_choice_regex_and_json_object(make_engine: MakeEngine) -> None:
    engine = await make_engine()
    choices = ["positive", "negative", "neutral"]
    picks = {
        text(await run(engine, req(f"c{s}", structured=StructuredOutput(choice=choices), seed=s)))
        for s in range(12)
    }
    assert picks == set(choices)
    pattern = r"[A-Z][a-z]+-\d{3}"
    out = text(await run(engine, req("r", structured=StructuredOutput(regex=pattern), seed=1)))
    assert re.fullmatch(pattern, out)
    obj = json.loads(text(await run(engine, req("j", structured=StructuredOutput(json_object=True)))))
    assert isinstance(obj, dict) and obj


@pytest.mark.parametrize(
    ("constraint", "field"),
    [
        (StructuredOutput(grammar='root ::= "a"'), "grammar"),
        (StructuredOutput(regex=r"(?=x)x"), "regex"),
        (StructuredOutput(json_schema=json.dumps({"if": {"type": "string"}, "then": {}})), "json"),
    ],
)
async def test_unsupported_constraints_fail_fast_and_for_good(
    make_engine: MakeEngine, constraint: StructuredOutput, field: str
) -> None:
    engine = await make_engine()
    with pytest.raises(EngineError) as err:
        engine.generate(req("a", structured=constraint))
    assert err.value.code == "unsupported_structured_output" and not err.value.retriable
    assert str(err.value).startswith(f"structured_outputs.{field} is not supported by the simulated engine")
    assert engine.stats().waiting == 0


async def test_stop_strings_and_ignore_eos_apply_to_structured_text(
    make_engine: MakeEngine, info: ModelInfo
) -> None:
    engine = await make_engine()
    answer = text(await run(engine, req("a", structured=JSON_PERSON, seed=5)))
    stopped = await run(engine, req("b", structured=JSON_PERSON, seed=5, stop=['"age"']))
    assert text(stopped) == answer[: answer.index('"age"')]
    assert stopped[-1].stop_reason == '"age"'
    no_eos = await run(engine, req("c", structured=JSON_PERSON, seed=5, ignore_eos=True))
    assert text(no_eos) == answer and info.eos_token_id not in tokens(no_eos)
    assert no_eos[-1].finish_reason == "stop"


async def test_min_tokens_does_not_pad_a_finished_structured_output(make_engine: MakeEngine) -> None:
    engine = await make_engine()
    outs = await run(engine, req("a", structured=StructuredOutput(choice=["yes"]), min_tokens=50))
    assert text(outs) == "yes" and outs[-1].finish_reason == "stop"


async def test_a_ban_on_a_token_the_text_needs_is_refused(make_engine: MakeEngine, info: ModelInfo) -> None:
    engine = await make_engine()
    brace = info.tokenizer.encode("yes", add_special_tokens=False).ids[0]
    with pytest.raises(EngineError) as err:
        engine.generate(req("a", structured=StructuredOutput(choice=["yes"]), logit_bias={brace: -100.0}))
    assert err.value.code == "unsupported_structured_output" and "logit_bias" in str(err.value)


async def test_a_tokenizer_that_cannot_say_the_text_exactly_is_refused(make_engine: MakeEngine) -> None:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "</s>"], show_progress=False)
    tok.train_from_iterator(["yes no maybe the quick brown fox"] * 20, trainer)
    engine = await make_engine(tokenizer=tok)
    with pytest.raises(EngineError) as err:
        engine.generate(req("a", prompt=[5, 6, 7, 8, 9], structured=StructuredOutput(choice=["yes"])))
    assert err.value.code == "unsupported_structured_output" and "tokenizer" in str(err.value)


async def test_logprobs_come_with_structured_tokens(make_engine: MakeEngine) -> None:
    engine = await make_engine()
    outs = await run(engine, req("a", structured=JSON_PERSON, logprobs=2))
    assert [lp.token_id for o in outs for lp in o.logprobs] == tokens(outs)


# ---- logit_bias, min_tokens and min_p on drawn tokens -----------------------------------------


async def test_banned_tokens_never_appear(make_engine: MakeEngine, info: ModelInfo) -> None:
    engine = await make_engine()
    free = tokens(await run(engine, req("a", max_tokens=40, ignore_eos=True)))
    banned = {t: -100.0 for t in free[:20]}
    biased = tokens(await run(engine, req("b", max_tokens=40, ignore_eos=True, logit_bias=banned)))
    assert len(biased) == 40 and not set(biased) & set(banned)
    # Only the positions that drew a banned token change.
    assert [b for f, b in zip(free, biased, strict=True) if f not in banned] == [
        f for f in free if f not in banned
    ]
    # Weaker biases are ignored: the sim has no logits to shift.
    mild = tokens(
        await run(engine, req("c", max_tokens=40, ignore_eos=True, logit_bias={t: -99.0 for t in free}))
    )
    assert mild == free


async def test_a_banned_eos_runs_to_max_tokens(make_engine: MakeEngine, info: ModelInfo) -> None:
    engine = await make_engine()
    outs = await run(engine, req("a", max_tokens=60, logit_bias={info.eos_token_id: -100.0}))
    assert len(tokens(outs)) == 60 and outs[-1].finish_reason == "length"


async def test_forced_tokens_are_all_that_is_said(make_engine: MakeEngine) -> None:
    engine = await make_engine()
    forced = {1000: 100.0, 2000: 150.0}
    outs = await run(engine, req("a", max_tokens=30, logit_bias=forced))
    assert set(tokens(outs)) == {1000, 2000} and len(tokens(outs)) == 30
    assert outs[-1].finish_reason == "length"


async def test_forced_eos_waits_for_min_tokens(make_engine: MakeEngine, info: ModelInfo) -> None:
    engine = await make_engine()
    outs = await run(engine, req("a", max_tokens=30, logit_bias={info.eos_token_id: 100.0}, min_tokens=6))
    ids = tokens(outs)
    assert len(ids) == 7 and ids[-1] == info.eos_token_id and info.eos_token_id not in ids[:-1]
    assert outs[-1].finish_reason == "stop"


async def test_min_tokens_outlasts_the_natural_length(make_engine: MakeEngine, info: ModelInfo) -> None:
    engine = await make_engine()
    natural = tokens(await run(engine, req("a", max_tokens=100)))
    assert len(natural) <= 24
    outs = await run(engine, req("b", max_tokens=100, min_tokens=40))
    ids = tokens(outs)
    assert len(ids) == 41 and ids[-1] == info.eos_token_id and outs[-1].finish_reason == "stop"


async def test_stop_token_ids_wait_for_min_tokens(make_engine: MakeEngine) -> None:
    engine = await make_engine()
    free = tokens(await run(engine, req("a", max_tokens=30, ignore_eos=True)))
    stops = free[:10]
    early = await run(engine, req("b", max_tokens=30, ignore_eos=True, stop_token_ids=stops))
    assert len(tokens(early)) == 1 and early[-1].stop_reason == stops[0]
    late = await run(engine, req("c", max_tokens=30, ignore_eos=True, stop_token_ids=stops, min_tokens=8))
    ids = tokens(late)
    assert not set(ids[:8]) & set(stops)
    assert len(ids) == 30 or (ids[-1] in stops and late[-1].stop_reason == ids[-1])


async def test_min_p_is_accepted_and_changes_nothing(make_engine: MakeEngine) -> None:
    engine = await make_engine()
    assert tokens(await run(engine, req("a", min_p=0.3))) == tokens(await run(engine, req("b")))


def test_drawn_tokens_plan() -> None:
    source = TokenSource(tokenizer=Tokenizer(models.BPE()), vocab=[10, 11, 12, 13], eos=0)
    plan = DrawnTokens(
        source, SamplingParams(logit_bias={11: -100, 12: -100.5}), lambda pos: 1, natural_len=3
    )
    assert [plan.next_token(p) for p in range(3)] == [(13, False), (13, False), (0, True)]
    late = DrawnTokens(
        source, SamplingParams(min_tokens=5, stop_token_ids=[11]), lambda pos: 1, natural_len=3
    )
    assert [late.next_token(p) for p in (4, 5)] == [(12, False), (0, True)]
    no_eos = TokenSource(tokenizer=source.tokenizer, vocab=source.vocab, eos=None)
    plan = DrawnTokens(no_eos, SamplingParams(), lambda pos: 2, natural_len=2)
    assert [plan.next_token(p) for p in range(2)] == [(12, False), (12, True)]
    with pytest.raises(EngineError, match="every token"):
        DrawnTokens(source, SamplingParams(logit_bias={t: -100 for t in source.vocab}), lambda pos: 0, 3)


def test_scripted_tokens_plan() -> None:
    assert [ScriptedTokens([5, 6], eos=0).next_token(p) for p in range(3)] == [
        (5, False),
        (6, False),
        (0, True),
    ]
    assert [ScriptedTokens([5, 6], eos=None).next_token(p) for p in range(2)] == [(5, False), (6, True)]
    with pytest.raises(EngineError):
        ScriptedTokens([], eos=None)
    assert structured_text(JSON_PERSON, 1) == structured_text(JSON_PERSON, 1)
