"""A token-id prompt is decoded to text only when the response echoes it: the decode runs on the event loop
(about 0.4 ms for 2,048 tokens) and nothing else reads the text."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import msgspec
import pytest

from schemas.openai import CompletionRequest
from server.model_files import ModelFiles
from server.preprocess import Preprocessor


class CountingModel:
    """The real model files, counting decodes."""

    def __init__(self, files: ModelFiles) -> None:
        self.files = files
        self.decodes = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.files, name)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        self.decodes += 1
        return self.files.decode(ids, skip_special_tokens)


@pytest.fixture(scope="module")
def files(model_path: Path) -> ModelFiles:
    return ModelFiles.load(model_path, "m")


def _completion(**fields: object) -> CompletionRequest:
    return msgspec.convert({"model": "m", "max_tokens": 4, **fields}, CompletionRequest)


@pytest.mark.parametrize("prompt", [[9906, 1917], [[9906, 1917], [9906]]], ids=["ids", "lists-of-ids"])
async def test_token_ids_are_decoded_only_for_an_echo(files: ModelFiles, prompt: list[object]) -> None:
    model = CountingModel(files)
    pre = Preprocessor(cast(ModelFiles, model), threshold_chars=10_000)
    plain = await pre.completion(_completion(prompt=prompt), 1024)
    assert model.decodes == 0
    assert all(t == "" for t in plain.prompt_texts)
    echoed = await pre.completion(_completion(prompt=prompt, echo=True), 1024)
    assert model.decodes == len(echoed.prompts)
    assert echoed.prompt_texts == [files.decode(p, skip_special_tokens=False) for p in echoed.prompts]
    assert all(echoed.prompt_texts)
    assert plain.prompts == echoed.prompts


async def test_a_text_prompt_keeps_its_text(files: ModelFiles) -> None:
    prepared = await Preprocessor(files, threshold_chars=10_000).completion(_completion(prompt="Hello there"), 1024)
    assert prepared.prompt_texts == ["Hello there"]
