"""The real vLLM engine on the default model: answers, streaming, stops, aborts, prefix cache, KV events."""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import pytest_asyncio

from kvstore.hashing import block_hashes, chain_seed
from schemas.engine_settings import VLLMSettings
from schemas.kafka import GenerateRequest, SamplingParams
from schemas.kv_events import BlockStored, KVEventBatch
from schemas.settings import DEFAULT_MODEL_NAME as SERVED_MODEL_NAME
from schemas.settings import WorkerSettings
from server.model_files import ModelFiles
from workers.engine import EngineError, EngineOutput
from workers.engine_choice import build_engine
from workers.vllm_config import VLLMConfig
from workers.vllm_engine import VLLMEngine

pytestmark = pytest.mark.vllm

GREEDY = SamplingParams(temperature=0.0)
QUESTION = "What is the capital of France?"


@dataclass
class Result:
    """Everything one stream produced."""

    outputs: list[EngineOutput] = field(default_factory=list)

    @property
    def token_ids(self) -> list[int]:
        return [t for o in self.outputs for t in o.token_ids]

    @property
    def text(self) -> str:
        return "".join(o.text for o in self.outputs)

    @property
    def last(self) -> EngineOutput:
        return self.outputs[-1]


def request(
    prompt: list[int], max_tokens: int = 32, sampling: SamplingParams = GREEDY, **kw: object
) -> GenerateRequest:
    kw.setdefault("request_id", f"t-{uuid.uuid4().hex[:8]}")
    return GenerateRequest(
        model=SERVED_MODEL_NAME,
        prompt_token_ids=prompt,
        max_tokens=max_tokens,
        reply_topic="unused",
        sampling=sampling,
        **kw,  # type: ignore[arg-type]
    )


async def run(engine: VLLMEngine, req: GenerateRequest) -> Result:
    result = Result()
    async for out in engine.generate(req):
        result.outputs.append(out)
    assert result.last.finish_reason is not None
    assert sum(o.finish_reason is not None for o in result.outputs) == 1
    return result


@pytest.fixture(scope="module")
def files(model_path: Path) -> ModelFiles:
    return ModelFiles.load(model_path, SERVED_MODEL_NAME)


def chat(files: ModelFiles, *messages: tuple[str, str]) -> list[int]:
    text = files.render_chat([{"role": role, "content": content} for role, content in messages])
    return files.encode(text, add_special_tokens=False)


@pytest.fixture(scope="module")
def question(files: ModelFiles) -> list[int]:
    return chat(files, ("user", QUESTION))


@pytest_asyncio.fixture(scope="module")
async def answer(vllm_engine: VLLMEngine, question: list[int]) -> Result:
    """The greedy answer to the question, which several tests compare against."""
    return await run(vllm_engine, request(question, max_tokens=48))


@pytest_asyncio.fixture(scope="module")
async def kv_log(vllm_engine: VLLMEngine) -> AsyncIterator[list[KVEventBatch]]:
    """Every KV-event batch the engine publishes (the engine's single reader)."""
    batches: list[KVEventBatch] = []

    async def consume() -> None:
        async for batch in vllm_engine.kv_events():
            batches.append(batch)

    task = asyncio.create_task(consume())
    yield batches
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


def test_vllm_engine_takes_every_vllm_setting(model_path: Path) -> None:
    # Built only, not started: the configuration is what is checked.
    settings = WorkerSettings(
        engine="vllm", model_path=str(model_path), block_size=32, max_num_seqs=7, max_num_batched_tokens=1024,
        kv_cache_gib=0.5, kv_events_port=5999, max_loras=2, max_lora_rank=8, max_model_len=1024,
    )  # fmt: skip
    engine = build_engine(settings)
    assert isinstance(engine, VLLMEngine)
    for f in dataclasses.fields(VLLMSettings):
        assert getattr(engine.config, f.name) == getattr(settings, f.name), f.name
    defaults = build_engine(WorkerSettings(engine="vllm", model_path=str(model_path)))
    assert isinstance(defaults, VLLMEngine) and defaults.config.max_model_len == VLLMConfig().max_model_len


async def test_engine_reports_its_shape(vllm_engine: VLLMEngine) -> None:
    await vllm_engine.check_health()
    stats = vllm_engine.stats()
    assert (stats.block_size, stats.max_model_len) == (32, 2048)
    assert stats.total_blocks > 100
    assert vllm_engine.kv_events_endpoint.startswith("tcp://127.0.0.1:")


async def test_answers_the_capital_of_france(answer: Result, question: list[int], files: ModelFiles) -> None:
    assert "Paris" in answer.text
    assert answer.last.finish_reason == "stop" and answer.last.stop_reason is None  # EOS
    assert answer.outputs[0].prompt_tokens == answer.last.prompt_tokens == len(question)


async def test_streamed_deltas_make_the_whole_answer(answer: Result, files: ModelFiles) -> None:
    assert len(answer.outputs) > 1
    assert all(len(o.token_ids) >= 1 for o in answer.outputs)
    assert answer.text == files.decode(answer.token_ids)
    assert answer.token_ids[-1] == files.eos_token_id


async def test_stop_string(vllm_engine: VLLMEngine, question: list[int], answer: Result) -> None:
    sampling = SamplingParams(temperature=0.0, stop=["Paris"])
    result = await run(vllm_engine, request(question, sampling=sampling))
    assert (result.last.finish_reason, result.last.stop_reason) == ("stop", "Paris")
    assert result.text == answer.text[: answer.text.index("Paris")]
    assert result.token_ids == answer.token_ids[: len(result.token_ids)]


async def test_stop_token_id(vllm_engine: VLLMEngine, question: list[int], answer: Result) -> None:
    stop_id = answer.token_ids[2]
    sampling = SamplingParams(temperature=0.0, stop_token_ids=[stop_id])
    result = await run(vllm_engine, request(question, sampling=sampling))
    assert (result.last.finish_reason, result.last.stop_reason) == ("stop", stop_id)
    assert result.token_ids == answer.token_ids[:3]


async def test_max_tokens_ends_with_length(
    vllm_engine: VLLMEngine, question: list[int], answer: Result
) -> None:
    result = await run(vllm_engine, request(question, max_tokens=3))
    assert result.last.finish_reason == "length"
    assert result.token_ids == answer.token_ids[:3]
    assert answer.text.startswith(result.text)


async def test_migration_continues_the_sequence(
    vllm_engine: VLLMEngine, question: list[int], answer: Result
) -> None:
    k = 4
    head = await run(vllm_engine, request(question, max_tokens=k))
    tail = await run(
        vllm_engine,
        request(question, max_tokens=len(answer.token_ids) - k, generated_token_ids=answer.token_ids[:k]),
    )
    assert head.token_ids + tail.token_ids == answer.token_ids
    assert head.text + tail.text == answer.text
    assert tail.last.finish_reason == "stop"
    # Usage counts the client's prompt only; that prompt was cached by the earlier runs.
    assert tail.last.prompt_tokens == len(question)
    assert tail.last.cached_tokens == len(question) // 32 * 32


async def test_logprobs(vllm_engine: VLLMEngine, question: list[int], answer: Result) -> None:
    sampling = SamplingParams(temperature=0.0, logprobs=3)
    result = await run(vllm_engine, request(question, max_tokens=4, sampling=sampling))
    logprobs = [lp for o in result.outputs for lp in o.logprobs]
    assert [lp.token_id for lp in logprobs] == result.token_ids == answer.token_ids[:4]
    for lp in logprobs:
        assert len(lp.top) == 3
        # Greedy: the sampled token ranks first; alternatives follow in rank order.
        assert lp.top[0] == (lp.token_id, lp.logprob)
        assert [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)
        assert lp.logprob <= 0.0


async def test_seed_and_index_make_sampling_reproducible(
    vllm_engine: VLLMEngine, question: list[int]
) -> None:
    sampling = SamplingParams(temperature=1.0, seed=1234, ignore_eos=True)
    a, b, c = await asyncio.gather(
        run(vllm_engine, request(question, max_tokens=8, sampling=sampling)),
        run(vllm_engine, request(question, max_tokens=8, sampling=sampling)),
        run(vllm_engine, request(question, max_tokens=8, sampling=sampling, index=1)),
    )
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids


async def test_abort_frees_the_request(vllm_engine: VLLMEngine, question: list[int]) -> None:
    long = SamplingParams(temperature=0.0, ignore_eos=True)
    req = request(question, max_tokens=500, sampling=long)
    stream = vllm_engine.generate(req)
    first = await anext(stream)
    assert first.token_ids and first.finish_reason is None
    assert first.prompt_tokens == len(question)
    assert vllm_engine.stats().running == 1
    await vllm_engine.abort(req.request_id)
    rest = [out async for out in stream]
    assert rest[-1].finish_reason == "abort"
    stats = vllm_engine.stats()
    assert (stats.running, stats.waiting, stats.kv_usage) == (0, 0, 0.0)
    await vllm_engine.abort(req.request_id)  # unknown by now: a no-op
    # The id is free again at once (a migrated request may come back to the same worker).
    again = await run(vllm_engine, request(question, max_tokens=2, request_id=req.request_id))
    assert again.last.finish_reason == "length"

    # Closing the stream early aborts as well.
    stream = vllm_engine.generate(request(question, max_tokens=500, sampling=long))
    await anext(stream)
    await stream.aclose()  # type: ignore[attr-defined]
    assert vllm_engine.stats().running == 0


async def test_cancelled_consumers_leave_nothing_behind(vllm_engine: VLLMEngine, question: list[int]) -> None:
    long = SamplingParams(temperature=0.0, ignore_eos=True)
    outputs: list[list[EngineOutput]] = [[] for _ in range(4)]
    started = [asyncio.Event() for _ in range(4)]

    async def consume(i: int, max_tokens: int) -> None:
        async for out in vllm_engine.generate(request(question, max_tokens=max_tokens, sampling=long)):
            outputs[i].append(out)
            started[i].set()

    tasks = [asyncio.create_task(consume(i, 500 if i % 2 else 12)) for i in range(4)]
    await asyncio.gather(*(e.wait() for e in started))
    for task in tasks[1::2]:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    assert [o[-1].finish_reason for o in outputs[::2]] == ["length", "length"]
    stats = vllm_engine.stats()
    assert (stats.running, stats.waiting, stats.kv_usage) == (0, 0, 0.0)
    assert not vllm_engine._live


async def test_errors_are_raised_at_call_time(vllm_engine: VLLMEngine, question: list[int]) -> None:
    with pytest.raises(EngineError) as e:
        vllm_engine.generate(request(question, max_tokens=2048))
    assert e.value.code == "context_length_exceeded" and not e.value.retriable
    with pytest.raises(EngineError, match="empty"):
        vllm_engine.generate(request([], max_tokens=4))
    with pytest.raises(EngineError) as e:
        vllm_engine.generate(request([10**6], max_tokens=4))
    assert e.value.code == "invalid_request"
    with pytest.raises(EngineError) as e:
        vllm_engine.generate(request(question, sampling=SamplingParams(temperature=-1.0)))
    assert e.value.code == "invalid_request"
    req = request(question, max_tokens=2)
    stream = vllm_engine.generate(req)
    with pytest.raises(EngineError) as e:
        vllm_engine.generate(req)
    assert e.value.code == "duplicate_request"
    assert [o async for o in stream][-1].finish_reason == "length"


async def test_shared_prefix_is_cached_and_reported_in_ferry_hashes(
    vllm_engine: VLLMEngine, files: ModelFiles, kv_log: list[KVEventBatch]
) -> None:
    system = "You are a careful geography tutor. " + " ".join(
        f"Fact {i}: rivers flow from high ground to the sea." for i in range(24)
    )
    first = chat(files, ("system", system), ("user", "Name a river in Spain."))
    second = chat(files, ("system", system), ("user", "Name a river in Italy."))
    shared = next(i for i, (a, b) in enumerate(zip(first, second, strict=False)) if a != b)
    assert shared >= 8 * 32, "the prompts must share several blocks"

    a = await run(vllm_engine, request(first, max_tokens=2))
    b = await run(vllm_engine, request(second, max_tokens=2))
    assert a.last.cached_tokens == 0
    assert b.last.cached_tokens == shared // 32 * 32
    assert vllm_engine.stats().prefix_hit_rate > 0.0

    seed = chain_seed(SERVED_MODEL_NAME)
    expected = set(block_hashes(first, 32, seed)) | set(block_hashes(second, 32, seed))

    def stored() -> set[int]:
        return {
            h
            for batch in kv_log
            for ev in batch.events
            if isinstance(ev, BlockStored)
            for h in ev.block_hashes
        }

    # Events travel over ZMQ after the step that cached the blocks.
    for _ in range(100):
        if expected <= stored():
            break
        await asyncio.sleep(0.05)
    assert expected <= stored()
    assert vllm_engine.kv_event_gaps == 0
