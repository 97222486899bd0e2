"""generation_config.json's sampling defaults reach a request that omits them, as vLLM applies them."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from schemas.openai import ChatCompletionRequest
from server.model_files import ModelFiles
from server.preprocess import Preprocessor
from tests.tiny_model import GENERATION, make_tiny_llama


@pytest.fixture(scope="module")
def tiny(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> ModelFiles:
    return ModelFiles.load(make_tiny_llama(model_path, tmp_path_factory.mktemp("tiny")), "tiny")


def _chat(**fields: object) -> ChatCompletionRequest:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], **fields}
    return msgspec.convert(body, ChatCompletionRequest)


async def test_defaults_fill_what_the_request_omits(tiny: ModelFiles) -> None:
    pre = Preprocessor(tiny, threshold_chars=10_000)
    s = (await pre.chat(_chat(), 1024)).sampling
    assert (s.temperature, s.top_p, s.top_k, s.repetition_penalty) == (0.6, 0.9, 20, 1.1)
    assert s.stop_token_ids == [0]  # the second eos id; 2 is the tokenizer's own
    given = (await pre.chat(_chat(temperature=1.0, top_p=0.5, top_k=5, stop_token_ids=[7]), 1024)).sampling
    assert (given.temperature, given.top_p, given.top_k, given.repetition_penalty) == (1.0, 0.5, 5, 1.1)
    assert given.stop_token_ids == [7, 0]
    assert (await pre.chat(_chat(ignore_eos=True), 1024)).sampling.stop_token_ids == []


async def test_a_model_without_defaults_keeps_openais(model_path: Path) -> None:
    files = ModelFiles.load(model_path, "m")
    s = (await Preprocessor(files, threshold_chars=10_000).chat(_chat(), 1024)).sampling
    assert (s.temperature, s.top_p, s.top_k, s.repetition_penalty, s.stop_token_ids) == (
        1.0,
        1.0,
        -1,
        1.0,
        [],
    )
    assert GENERATION["temperature"] != s.temperature
