"""The simulated engine's pseudo-random draws: a key per output stream, a draw per position, logprobs.

Everything is a pure function of the request (prompt, sampling seed, choice index) and the engine's
seed, so the same request says the same thing on every worker, streamed or not, and after a migration.
"""

from __future__ import annotations

import math
import struct

import numpy as np
import xxhash
from tokenizers import Tokenizer

from schemas.kafka import GenerateRequest, TokenLogprob

U64 = (1 << 64) - 1
# What a draw is for: the same position draws independently for each purpose.
TAG_TOKEN, TAG_LENGTH, TAG_LOGPROB, TAG_STRUCTURED, TAG_PROMPT_LOGPROB = 0, 1, 2, 3, 4
_STREAM_KEY = struct.Struct("<QQQ")
_DRAW = struct.Struct("<QQBI")


def output_vocab(tokenizer: Tokenizer, eos_token_id: int | None) -> list[int]:
    """The ordinary tokens a simulated sequence may say, sorted (no added or special tokens, no EOS)."""
    excluded = set(tokenizer.get_added_tokens_decoder())
    if eos_token_id is not None:
        excluded.add(eos_token_id)
    vocab = sorted(set(tokenizer.get_vocab(with_added_tokens=False).values()) - excluded)
    if not vocab:
        raise ValueError("the tokenizer has no ordinary tokens to generate")
    return vocab


def stream_key(request: GenerateRequest) -> int:
    """The key of one output stream: its prompt, sampling seed and choice index."""
    prompt_hash = xxhash.xxh3_64_intdigest(np.asarray(request.prompt_token_ids, dtype="<u4").tobytes())
    seed = (request.sampling.seed or 0) & U64
    return xxhash.xxh3_64_intdigest(_STREAM_KEY.pack(seed, request.index & U64, prompt_hash))


def draw(engine_seed: int, key: int, pos: int, tag: int, k: int = 0) -> int:
    """A 64-bit draw for position `pos` of stream `key`, for the purpose `tag` (and rank `k`)."""
    return xxhash.xxh3_64_intdigest(_DRAW.pack(key, pos, tag, k), seed=engine_seed & U64)


def logprob(
    vocab: list[int], engine_seed: int, key: int, pos: int, token: int, k: int, tag: int = TAG_LOGPROB
) -> TokenLogprob:
    """Plausible logprobs of the token said at `pos`, with `k` alternatives.

    The sampled token ranks first with p >= 0.5; each alternative takes a share of the remaining mass, so
    probabilities sum to at most 1 and all alternatives rank below it.
    """
    k = min(k, len(vocab))
    first_draw = draw(engine_seed, key, pos, tag)
    p = 0.5 + 0.45 * ((first_draw & 0xFFFF) / 0xFFFF)
    first = math.log(p)
    taken = {token}
    remaining = 1.0 - p
    alternatives: list[tuple[int, float]] = []
    for rank in range(1, k):
        d = draw(engine_seed, key, pos, tag, rank)
        i = d % len(vocab)
        while vocab[i] in taken:
            i = (i + 1) % len(vocab)
        share = remaining * (0.2 + 0.4 * (((d >> 16) & 0xFFFF) / 0xFFFF))
        remaining -= share
        taken.add(vocab[i])
        alternatives.append((vocab[i], math.log(share)))
    alternatives.sort(key=lambda item: item[1], reverse=True)
    top = [(token, first), *alternatives] if k else []
    return TokenLogprob(token_id=token, logprob=first, top=top)


def prompt_logprobs(
    vocab: list[int], engine_seed: int, key: int, request: GenerateRequest, k: int
) -> list[TokenLogprob | None]:
    """Plausible logprobs of each prompt token after the ones before it (None for the first), rank 1 each."""
    ids = [*request.prompt_token_ids, *request.generated_token_ids]
    out: list[TokenLogprob | None] = [None]
    for pos in range(1, len(ids)):
        lp = logprob(vocab, engine_seed, key, pos, ids[pos], k, TAG_PROMPT_LOGPROB)
        out.append(TokenLogprob(lp.token_id, lp.logprob, lp.top, rank=1))
    return out
