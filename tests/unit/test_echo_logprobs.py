"""`echo` with `logprobs` on /v1/completions, as vLLM shapes it: the prompt's tokens come first in each choice's
logprobs (the first with null logprob and alternatives), then the output's; text offsets count from the start
of the echoed text; streamed, the prompt and its logprobs go with each choice's first delta."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any, cast

from schemas.kafka import Chunk, ChunkUsage, TokenLogprob
from schemas.openai import json_encoder
from server.logprobs import LogprobFormatter
from server.responses import absorb, stream
from server.router import Decision
from server.shapes import ChoiceState, CompletionEvents, Finished, text_completion
from server.streams import Sequence, StreamSpec

# Token id -> its text; 1 is a BOS-like token whose text the echoed prompt does not contain.
VOCAB = {1: "<s>", 10: "Say", 11: " hi", 12: " there", 20: "!", 21: " ok", 22: "?", 23: " no"}


class Model:
    """Just enough of ModelFiles for the formatter."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(VOCAB[i] for i in ids)


FMT = LogprobFormatter(cast(Any, Model()))
PROMPTS = [[1, 10, 11], [10, 12]]
TEXTS = ["Say hi", "Say there"]


def prompt_lps(ids: list[int]) -> list[TokenLogprob | None]:
    """Prompt logprobs as engines send them: None first, then each token (rank 2) with one better token."""
    return [None, *(TokenLogprob(t, -1.5, [(22, -0.5)], rank=2) for t in ids[1:])]


def out_lp(token: int) -> TokenLogprob:
    """A sampled token's logprob with its one alternative (the token itself, rank 1)."""
    return TokenLogprob(token, -0.25, [(token, -0.25)])


def chunks_of(choice: int) -> list[Chunk]:
    """Two output tokens then the finish; the first chunk carries the prompt logprobs."""
    rid, prompt = f"r.{choice}", PROMPTS[choice // 2]
    first, second = (20, 21) if choice % 2 == 0 else (23, 20)
    return [
        Chunk(rid, 0, token_ids=[first], text=VOCAB[first], logprobs=[out_lp(first)],
              prompt_logprobs=prompt_lps(prompt)),
        Chunk(rid, 1, token_ids=[second], text=VOCAB[second], logprobs=[out_lp(second)]),
        Chunk(rid, 2, finish_reason="length", usage=ChunkUsage(len(prompt), 2)),
    ]  # fmt: skip


def check_choice(lp: dict[str, Any], text: str, choice: int) -> None:
    """What vLLM shows for one echoed choice."""
    prompt = PROMPTS[choice // 2]
    out = [20, 21] if choice % 2 == 0 else [23, 20]
    assert lp["tokens"] == [VOCAB[t] for t in [*prompt, *out]]
    assert lp["token_logprobs"] == [None] + [-1.5] * (len(prompt) - 1) + [-0.25, -0.25]
    assert lp["top_logprobs"][0] is None
    # The token itself first, then the alternatives (as vLLM: its rank does not matter).
    assert lp["top_logprobs"][1] == {VOCAB[prompt[1]]: -1.5, "?": -0.5}
    assert list(lp["top_logprobs"][1]) == [VOCAB[prompt[1]], "?"]
    assert lp["top_logprobs"][-1] == {VOCAB[out[-1]]: -0.25}
    # Offsets: each token's length after the one before, from 0 (a BOS text moves them past the echo).
    lengths = [len(t) for t in lp["tokens"]]
    assert lp["text_offset"] == [sum(lengths[:i]) for i in range(len(lengths))]
    assert text == TEXTS[choice // 2] + "".join(VOCAB[t] for t in out)
    if prompt[0] != 1:
        # Without special tokens, every offset points at its token in the echoed text.
        assert all(text[o:].startswith(t) for o, t in zip(lp["text_offset"], lp["tokens"], strict=True))


def finished(show: bool) -> Finished:
    states = {c: ChoiceState() for c in range(4)}
    for c, state in states.items():
        assert absorb(state, chunks_of(c)) is None
    return Finished("cmpl-x", 0, "m", states, True, [3, 2], 2, TEXTS, None, [1, 10], show)


def test_whole_body_puts_the_prompt_logprobs_in_front() -> None:
    body = json.loads(json_encoder.encode(text_completion(finished(False), FMT)))
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    for c in body["choices"]:
        check_choice(c["logprobs"], c["text"], c["index"])
        assert "prompt_logprobs" not in c  # not asked for: computed only for the echo
    shown = json.loads(json_encoder.encode(text_completion(finished(True), FMT)))
    assert shown["choices"][0]["prompt_logprobs"][1] == {
        "10": {"logprob": -1.5, "rank": 2, "decoded_token": "Say"},
        "22": {"logprob": -0.5, "rank": 1, "decoded_token": "?"},
    }


def test_moved_sequence_prompt_logprobs_are_cut_at_the_prompt() -> None:
    # A later attempt's prompt is the prompt and the output so far: only the prompt's part is echoed.
    state = ChoiceState()
    longer = Chunk("r.0", 0, token_ids=[21], text=" ok", logprobs=[out_lp(21)],
                   prompt_logprobs=prompt_lps([1, 10, 11, 20]))  # fmt: skip
    absorb(state, [longer, Chunk("r.0", 1, finish_reason="stop")])
    done = Finished("cmpl-x", 0, "m", {0: state}, True, [3], 1, ["Say hi"], None, [1], False)
    lp = text_completion(done, FMT).choices[0].logprobs
    assert lp is not None and lp.tokens == ["<s>", "Say", " hi", " ok"]


def test_without_echo_the_output_alone_from_offset_zero() -> None:
    done = finished(False)
    plain = Finished("cmpl-x", 0, "m", done.states, True, [3, 2], 2, None, None, [1, 10], False)
    lp = text_completion(plain, FMT).choices[1].logprobs
    assert lp is not None
    assert (lp.tokens, lp.token_logprobs, lp.text_offset) == ([" no", "!"], [-0.25, -0.25], [0, 3])


class Source:
    """A ChunkSource that sends the given batches."""

    id, created, model = "cmpl-x", 0, "m"

    def __init__(self, batches: list[list[Chunk]]) -> None:
        self.spec = StreamSpec(
            n=2, prompt_lens=[3, 2], logprobs=True, prompt_texts=TEXTS, first_tokens=[1, 10]
        )
        self.metrics = None
        self._batches = batches
        self._seqs = {f"r.{c}": Sequence(f"r.{c}", c, c // 2, Decision("w"), 3) for c in range(4)}

    async def chunks(self) -> AsyncIterator[list[tuple[Sequence, Chunk]]]:
        """Each batch in turn."""
        for batch in self._batches:
            yield [(self._seqs[c.request_id], c) for c in batch]

    async def close(self) -> None:
        """Nothing to close."""


async def streamed(batches: list[list[Chunk]], ids: bool) -> dict[int, tuple[str, dict[str, list[Any]]]]:
    """Each choice's text and logprobs, joined over its deltas."""
    src = Source(batches)
    data = b"".join(
        [e async for e in stream(cast(Any, src), CompletionEvents(cast(Any, src), FMT, True), ids=ids)]
    )
    joined: dict[int, tuple[str, dict[str, list[Any]]]] = {}
    firsts: dict[int, str] = {}
    for line in data.split(b"\n"):
        if not line.startswith(b"data: {"):
            continue
        for c in json.loads(line.removeprefix(b"data: "))["choices"]:
            firsts.setdefault(c["index"], c["text"])
            text, lp = joined.setdefault(c["index"], ("", {}))
            for k, v in (c["logprobs"] or {}).items():
                lp.setdefault(k, []).extend(v)
            joined[c["index"]] = (text + c["text"], lp)
    # The echo came with each choice's first token, in one delta.
    for c, first in firsts.items():
        assert first == TEXTS[c // 2] + VOCAB[20 if c % 2 == 0 else 23]
    return joined


async def test_stream_sends_the_prompt_with_each_choices_first_delta() -> None:
    every = [chunks_of(c) for c in range(4)]
    # Choices start in different batches; merged (live) and one event per chunk (resumable) alike.
    batches = [[every[1][0], every[0][0]], [every[0][1], every[2][0], every[1][1]], [every[3][0]],
               [every[0][2], every[1][2], every[2][1], every[2][2], every[3][1], every[3][2]]]  # fmt: skip
    for ids in (False, True):
        joined = await streamed(batches, ids)
        assert sorted(joined) == [0, 1, 2, 3]
        for c, (text, lp) in joined.items():
            check_choice(lp, text, c)
