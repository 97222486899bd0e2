"""Incremental detokenization: UTF-8 splits, stop strings with holdback, stop tokens, EOS, migration."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from schemas.kafka import SamplingParams
from workers.detok import Detokenizer

EOS = 0


@pytest.fixture(scope="module")
def byte_tok() -> Tokenizer:
    """Byte-level BPE without merges: every byte is its own token, so every string splits."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=258,
        special_tokens=["<|endoftext|>", "<|im_start|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(["unused"], trainer)
    assert tok.token_to_id("<|endoftext|>") == EOS
    return tok


def ids(tok: Tokenizer, text: str) -> list[int]:
    return tok.encode(text).ids


def run(
    tok: Tokenizer,
    tokens: Sequence[int],
    sampling: SamplingParams | None = None,
    prompt: Sequence[int] = (),
    prior: Sequence[int] = (),
) -> tuple[list[str], bool, str | int | None]:
    """Feed tokens one by one; return the text deltas, whether it stopped, and the stop reason."""
    detok = Detokenizer(tok, sampling or SamplingParams(), EOS, prompt, prior)
    deltas: list[str] = []
    for i, t in enumerate(tokens):
        out = detok.step(t, final=i == len(tokens) - 1)
        deltas.append(out.text)
        if out.stopped:
            return deltas, True, out.stop_reason
    return deltas, False, None


def test_multibyte_characters_split_across_tokens(byte_tok: Tokenizer) -> None:
    text = "héllo 日本語 ☃ wörld"
    tokens = ids(byte_tok, text)
    assert len(tokens) > len(text)  # multi-byte characters really are split
    deltas, stopped, _ = run(byte_tok, tokens)
    assert not stopped
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)
    # A character's text appears only when its last byte arrives.
    assert "" in deltas


def test_stop_string_split_across_tokens_is_cut_and_never_streamed(byte_tok: Tokenizer) -> None:
    text = "say hello STOP and more"
    sampling = SamplingParams(stop=["STOP"])
    deltas, stopped, reason = run(byte_tok, ids(byte_tok, text), sampling)
    assert stopped and reason == "STOP"
    assert "".join(deltas) == "say hello "
    # Holdback: while "S", "ST", "STO" could still become "STOP", none of it is streamed.
    streamed = ""
    for d in deltas:
        streamed += d
        assert "S" not in streamed


def test_abandoned_partial_match_is_released_without_retraction(byte_tok: Tokenizer) -> None:
    text = "a STOne, a STOrm, then STOP!"
    sampling = SamplingParams(stop=["STOP", "xyz"])
    deltas, stopped, reason = run(byte_tok, ids(byte_tok, text), sampling)
    assert stopped and reason == "STOP"
    full = "".join(deltas)
    assert full == "a STOne, a STOrm, then "
    prefixes = [""]
    for d in deltas:
        prefixes.append(prefixes[-1] + d)
    # Every streamed prefix is a prefix of the final text: nothing ever had to be taken back.
    assert all(full.startswith(p) for p in prefixes)
    # The held "STO" is released as soon as the next character rules the stop string out.
    first_sto = prefixes.index("a ")  # after "a ", the "STO" is held ...
    assert "a STOn" in prefixes[first_sto + 4]  # ... and released with the "n"


def test_earliest_stop_string_wins(byte_tok: Tokenizer) -> None:
    sampling = SamplingParams(stop=["cd", "bcde"])
    deltas, stopped, reason = run(byte_tok, ids(byte_tok, "abcdef"), sampling)
    assert stopped
    # "cd" completes first; "bcde" could not have matched earlier.
    assert ("".join(deltas), reason) == ("ab", "cd")


def test_held_text_is_flushed_on_the_final_token(byte_tok: Tokenizer) -> None:
    deltas, stopped, _ = run(byte_tok, ids(byte_tok, "ends with ST"), SamplingParams(stop=["STOP"]))
    assert not stopped
    assert "".join(deltas) == "ends with ST"
    assert deltas[-1].endswith("ST")


def test_eos_stops_without_text_unless_ignored(byte_tok: Tokenizer) -> None:
    tokens = [*ids(byte_tok, "hi"), EOS, *ids(byte_tok, "more")]
    deltas, stopped, reason = run(byte_tok, tokens)
    assert stopped and reason is None
    assert "".join(deltas) == "hi"
    deltas, stopped, _ = run(byte_tok, tokens, SamplingParams(ignore_eos=True))
    assert not stopped
    assert "".join(deltas) == "himore"
    deltas, _, _ = run(byte_tok, tokens, SamplingParams(ignore_eos=True, skip_special_tokens=False))
    assert "".join(deltas) == "hi<|endoftext|>more"


def test_stop_token_ids_report_the_token(byte_tok: Tokenizer) -> None:
    bang = ids(byte_tok, "!")[0]
    deltas, stopped, reason = run(byte_tok, ids(byte_tok, "wow! no"), SamplingParams(stop_token_ids=[bang]))
    assert stopped and reason == bang
    assert "".join(deltas) == "wow"


def test_prompt_primes_leading_space() -> None:
    vocab = {"<unk>": 0, "</s>": 1, "▁hello": 2, "▁world": 3, "▁again": 4}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.add_special_tokens([AddedToken("</s>", special=True)])
    # Alone, Metaspace drops the first word's space; after the prompt it must keep it.
    deltas, _, _ = run(tok, [3, 4])
    assert "".join(deltas) == "world again"
    deltas, _, _ = run(tok, [3, 4], prompt=[2, 2, 2, 2, 2])
    assert "".join(deltas) == " world again"


@pytest.mark.parametrize("split", [1, 4, 5, 8, 13, 14])
def test_migrated_sequence_continues_the_same_text(byte_tok: Tokenizer, split: int) -> None:
    # Splits fall inside "日" (3 bytes) and inside a held "ST", the two cases a restart could break.
    tokens = ids(byte_tok, "ab 日本 xxST and STOP tail")
    sampling = SamplingParams(stop=["STOP"])
    whole, stopped, reason = run(byte_tok, tokens, sampling)
    # What the first worker had streamed after `split` tokens, and what the second one adds.
    streamed_before = "".join(whole[:split])
    after, stopped_after, reason_after = run(byte_tok, tokens[split:], sampling, prior=tokens[:split])
    assert streamed_before + "".join(after) == "".join(whole) == "ab 日本 xxST and "
    assert (stopped_after, reason_after) == (stopped, reason) == (True, "STOP")
