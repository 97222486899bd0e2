"""What the simulated engine's tests share: a small in-memory tokenizer, engines that record their steps, requests."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from schemas.kafka import GenerateRequest, SamplingParams
from schemas.kv_events import KVEventBatch
from workers.engine import EngineOutput
from workers.sim import SimEngine, _Seq, _Step
from workers.sim_config import SimConfig

MODEL = "sim-test"
EOS = 0
CORPUS = [
    "The quick brown fox jumps over the lazy dog. Ferry streams tokens from Kafka to clients.",
    "Prefix caching keeps blocks of the prompt; the router sends requests where blocks live.",
    "héllo wörld, 日本語のテキスト, emoji ☃ and numbers 0123456789.",
]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    """A small byte-level BPE trained in memory (no downloads)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 20, trainer)
    assert tok.token_to_id("<|endoftext|>") == EOS
    return tok


class RecordingEngine(SimEngine):
    """Records what each step scheduled and which sequences were preempted."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.steps: list[dict[str, int]] = []
        self.victims: list[str] = []

    def _schedule(self) -> _Step | None:
        step = super()._schedule()
        if step is not None:
            self.steps.append({rid: n for rid, (_, n) in step.work.items()})
        return step

    def _preempt(self, seq: _Seq) -> None:
        self.victims.append(seq.request.request_id)
        super()._preempt(seq)


class CrashingEngine(SimEngine):
    """Fails inside its step loop, as a bug would."""

    def _complete(self, step: _Step) -> None:
        raise RuntimeError("boom")


MakeEngine = Callable[..., Awaitable[RecordingEngine]]

# A small, fast simulated engine: what the sim tests' engines start from (their overrides on top).
SMALL_ENGINE: dict[str, Any] = {
    "speedup": 1e9,
    "block_size": 16,
    "num_blocks": 256,
    "max_model_len": 1024,
    "min_output_tokens": 4,
    "max_output_tokens": 24,
}


@pytest.fixture
async def make_engine(tokenizer: Tokenizer) -> AsyncIterator[MakeEngine]:
    engines: list[SimEngine] = []

    async def make(engine_cls: type[SimEngine] = RecordingEngine, **overrides: Any) -> Any:
        engine = engine_cls(MODEL, tokenizer, SimConfig(**(SMALL_ENGINE | overrides)), eos_token_id=EOS)
        await engine.start()
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        await engine.stop()


def prompt(n: int, salt: int = 0) -> list[int]:
    return [3 + (i * 7 + salt * 31) % 390 for i in range(n)]


def req(rid: str, tokens: list[int], max_tokens: int = 16, **kw: Any) -> GenerateRequest:
    sampling = kw.pop("sampling", SamplingParams(ignore_eos=True))
    return GenerateRequest(rid, MODEL, tokens, max_tokens, "replies", sampling=sampling, **kw)


@dataclass
class Result:
    outputs: list[EngineOutput] = field(default_factory=list)

    @property
    def tokens(self) -> list[int]:
        return [t for o in self.outputs for t in o.token_ids]

    @property
    def text(self) -> str:
        return "".join(o.text for o in self.outputs)

    @property
    def last(self) -> EngineOutput:
        return self.outputs[-1]


async def collect(stream: AsyncIterator[EngineOutput]) -> Result:
    result = Result()
    async for out in stream:
        result.outputs.append(out)
    return result



async def drain(engine: SimEngine) -> list[KVEventBatch]:
    await engine.stop()
    return [batch async for batch in engine.kv_events()]



class TimedEngine(RecordingEngine):
    """Also records each step's simulated seconds."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.seconds: list[float] = []

    def _schedule(self) -> _Step | None:
        step = super()._schedule()
        if step is not None:
            self.seconds.append(step.seconds)
        return step

