"""min_tokens in the Detokenizer: a stop string counts only if it ends in the text of a later token, as in vLLM."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from schemas.kafka import SamplingParams
from workers.detok import Detokenizer

EOS = 0


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    """Byte-level BPE with a few merges, so some tokens carry several characters."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(["abcab cabba stop STOP ab"] * 50, trainer)
    return tok


def run(
    tok: Tokenizer, tokens: Sequence[int], sampling: SamplingParams, prior: Sequence[int] = ()
) -> tuple[str, str | int | None]:
    detok = Detokenizer(tok, sampling, EOS, prior_output_ids=prior)
    text = ""
    for i, t in enumerate(tokens):
        out = detok.step(t, final=i == len(tokens) - 1)
        text += out.text
        if out.stopped:
            return text, out.stop_reason
    return text, None


def vllm_reference(
    tok: Tokenizer, tokens: Sequence[int], stop: str, min_tokens: int
) -> tuple[str, str | None]:
    """vLLM's rule, one token per step (vllm/v1/engine/detokenizer.py): stop strings are checked once
    more than min_tokens tokens exist, in the text that ends after the last min_tokens-th token."""
    text = ""
    for i, t in enumerate(tokens):
        piece = tok.decode([t])
        text += piece
        if i + 1 > min_tokens:
            index = text.find(stop, max(0, len(text) - len(piece) - len(stop) + 1))
            if index >= 0:
                return text[:index], stop
    return text, None


def ids(tok: Tokenizer, text: str) -> list[int]:
    return tok.encode(text).ids


def test_stop_string_inside_the_first_min_tokens_does_not_count(tok: Tokenizer) -> None:
    tokens = [t for ch in "xxstopyy" for t in ids(tok, ch)]
    assert run(tok, tokens, SamplingParams(stop=["stop"])) == ("xx", "stop")
    # "stop" ends in token 5 (0-based): min_tokens 5 lets it count, 6 does not.
    assert run(tok, tokens, SamplingParams(stop=["stop"], min_tokens=5)) == ("xx", "stop")
    assert run(tok, tokens, SamplingParams(stop=["stop"], min_tokens=6)) == ("xxstopyy", None)


def test_a_later_occurrence_still_stops(tok: Tokenizer) -> None:
    tokens = [t for ch in "stop-stop!" for t in ids(tok, ch)]
    assert run(tok, tokens, SamplingParams(stop=["stop"], min_tokens=4)) == ("stop-", "stop")


def test_a_protected_stop_string_that_prefixes_another_is_not_found_later(tok: Tokenizer) -> None:
    # "ab" is held back as a prefix of "abc" while protected; the next token must not make it count.
    tokens = [t for ch in "xabyab" for t in ids(tok, ch)]
    assert run(tok, tokens, SamplingParams(stop=["ab", "abc"], min_tokens=3)) == ("xaby", "ab")


def test_migrated_tokens_count_towards_min_tokens(tok: Tokenizer) -> None:
    prior = [t for ch in "xx" for t in ids(tok, ch)]
    rest = [t for ch in "stopyy" for t in ids(tok, ch)]
    assert run(tok, rest, SamplingParams(stop=["stop"], min_tokens=5), prior=prior) == ("", "stop")
    assert run(tok, rest, SamplingParams(stop=["stop"], min_tokens=6), prior=prior) == ("stopyy", None)


def test_eos_and_stop_tokens_still_end_the_sequence(tok: Tokenizer) -> None:
    # Engines keep them from being produced early (vLLM masks their logits); if one comes, it ends it.
    a = ids(tok, "a")[0]
    assert run(tok, [a, EOS, a], SamplingParams(min_tokens=5)) == ("a", None)
    assert run(tok, [a, a, a], SamplingParams(min_tokens=5, stop_token_ids=[a])) == ("", a)


def test_matches_vllm_on_random_texts(tok: Tokenizer) -> None:
    rng = random.Random(0)
    for _ in range(400):
        text = "".join(rng.choice("abc ") for _ in range(rng.randint(1, 24)))
        tokens = ids(tok, text)
        stop = "".join(rng.choice("abc") for _ in range(rng.randint(1, 3)))
        min_tokens = rng.randint(0, len(tokens) + 1)
        assert run(tok, tokens, SamplingParams(stop=[stop], min_tokens=min_tokens)) == vllm_reference(
            tok, tokens, stop, min_tokens
        ), (text, stop, min_tokens)
