"""generation_config.json's `max_new_tokens` is the default max_tokens of a chat request, as vLLM's
ModelConfig.get_diff_sampling_param and get_max_tokens make it: only for a request that names none, never
past the room the prompt leaves, never capping a value the request gives; completions keep OpenAI's 16."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import msgspec
import pytest

from schemas.openai import ChatCompletionRequest, CompletionRequest
from server.model_files import ModelFiles
from server.preprocess import Preprocessor


def _model(model_path: Path, out: Path, **generation: object) -> ModelFiles:
    """The default model's files (no weights) with `generation` as its generation_config.json."""
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_path / name, out / name)
    (out / "generation_config.json").write_text(json.dumps(generation))
    return ModelFiles.load(out, "m")


def _chat(**fields: object) -> ChatCompletionRequest:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    return msgspec.convert(body, ChatCompletionRequest)


@pytest.fixture
def pre(model_path: Path, tmp_path: Path) -> Preprocessor:
    return Preprocessor(_model(model_path, tmp_path, max_new_tokens=7), threshold_chars=10_000)


async def test_max_new_tokens_fills_an_omitted_max_tokens(pre: Preprocessor) -> None:
    assert pre.model.generation_defaults.max_tokens == 7
    assert (await pre.chat(_chat(), 1024)).max_tokens == 7
    # Given values win, above the default too (vLLM caps only with --generation-config <dir> or an override).
    assert (await pre.chat(_chat(max_tokens=3), 1024)).max_tokens == 3
    assert (await pre.chat(_chat(max_tokens=50), 1024)).max_tokens == 50
    assert (await pre.chat(_chat(max_completion_tokens=40), 1024)).max_tokens == 40


async def test_the_default_never_exceeds_the_room_the_prompt_leaves(pre: Preprocessor) -> None:
    prompt = len((await pre.chat(_chat(max_tokens=1), 1024)).prompts[0])
    assert (await pre.chat(_chat(), prompt + 4)).max_tokens == 4  # no 400: the default is only a ceiling


async def test_completions_keep_their_default_of_16(pre: Preprocessor) -> None:
    req = msgspec.convert({"model": "m", "prompt": "hi"}, CompletionRequest)
    assert (await pre.completion(req, 1024)).max_tokens == 16


@pytest.mark.parametrize("value", [0, -1, "8", True, None])
async def test_a_value_that_is_no_positive_integer_is_no_default(
    model_path: Path, tmp_path: Path, value: object
) -> None:
    files = _model(model_path, tmp_path, max_new_tokens=value)
    assert files.generation_defaults.max_tokens is None
    prepared = await Preprocessor(files, threshold_chars=10_000).chat(_chat(), 1024)
    assert prepared.max_tokens == 1024 - len(prepared.prompts[0])  # the whole room, as without the file
