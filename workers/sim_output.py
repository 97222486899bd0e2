"""What a simulated sequence says: the token at each output position, and where it ends by itself.

Without a constraint the simulated engine draws pseudo-random tokens and ends with EOS at a drawn
natural length. The sampling fields that need logits are approximated, since the sim has none:

- `logit_bias` >= 100 forces a token: every position draws from the forced tokens only (vLLM's +100
  makes them near-certain), so the sequence runs until it draws EOS (if forced) or hits max_tokens.
  <= -100 bans a token: it is never drawn, and a banned EOS means the sequence runs to max_tokens.
  Biases in between are ignored.
- `min_tokens`: neither EOS nor a stop token id is produced before that many output tokens (vLLM
  masks their logits); stop strings are the Detokenizer's business (workers/detok.py).
- `min_p` is accepted and has no effect.

With a structured-output constraint the sequence says the text of workers/structured in the model's
tokens, then EOS: `min_tokens` does not extend it (vLLM lets EOS through once the grammar allows
nothing else), and a ban on a token the text needs is refused rather than silently broken.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass

from tokenizers import Tokenizer

from schemas.kafka import GenerateRequest, SamplingParams
from workers.detok import Detokenizer
from workers.engine import EngineError
from workers.structured import StructuredUnsupported, structured_text

# An output position -> a 64-bit pseudo-random draw for it.
Draw = Callable[[int], int]
FORCED_BIAS = 100.0
BANNED_BIAS = -100.0
UNSUPPORTED = "unsupported_structured_output"


@dataclass(frozen=True, slots=True)
class TokenSource:
    """What the simulated engine speaks with: the tokenizer, its ordinary tokens (sorted) and EOS."""

    tokenizer: Tokenizer
    vocab: list[int]
    eos: int | None


class DrawnTokens:
    """Pseudo-random tokens from the vocabulary under logit_bias and min_tokens; EOS at the natural length."""

    __slots__ = (
        "_banned",
        "_draw",
        "_early_banned",
        "_early_forced",
        "_eos",
        "_forced",
        "_min_tokens",
        "_natural_len",
        "_vocab",
    )

    def __init__(
        self, source: TokenSource, sampling: SamplingParams, draw: Draw, natural_len: int | None
    ) -> None:
        self._vocab = source.vocab
        self._eos = source.eos
        self._draw = draw
        self._min_tokens = sampling.min_tokens
        bias = sampling.logit_bias
        forced = sorted(t for t, b in bias.items() if b >= FORCED_BIAS)
        banned = frozenset(t for t, b in bias.items() if b <= BANNED_BIAS)
        # Before min_tokens nothing may end the sequence: EOS and stop tokens count as banned.
        enders = {*sampling.stop_token_ids, *(() if source.eos is None else (source.eos,))}
        self._forced = forced
        self._early_forced = [t for t in forced if t not in enders]
        self._banned = banned
        self._early_banned = banned | enders
        if sum(1 for t in self._early_banned if _contains(self._vocab, t)) >= len(self._vocab):
            raise EngineError(
                "invalid_request", "logit_bias and the stop tokens ban every token of the vocabulary"
            )
        if forced or sampling.ignore_eos or source.eos in banned:
            natural_len = None  # only max_tokens (or a drawn EOS) ends it, as with real logits
        elif natural_len is not None:
            natural_len = max(natural_len, self._min_tokens + 1)
        self._natural_len = natural_len

    def next_token(self, pos: int) -> tuple[int, bool]:
        """The token at output position `pos` (counting migrated tokens), and whether it ends the sequence."""
        natural_end = self._natural_len is not None and pos >= self._natural_len - 1
        if natural_end and self._eos is not None:
            return self._eos, True
        early = pos < self._min_tokens
        forced = self._early_forced if early else self._forced
        draw = self._draw(pos)
        if forced:
            return forced[draw % len(forced)], natural_end
        vocab = self._vocab
        i = draw % len(vocab)
        banned = self._early_banned if early else self._banned
        if banned:
            # Deterministic probing: the same position gives the same token on every worker.
            while vocab[i] in banned:
                i = (i + 1) % len(vocab)
        return vocab[i], natural_end


class ScriptedTokens:
    """The tokens of a fixed text, then EOS (unless there is none or it is ignored)."""

    __slots__ = ("_eos", "_tokens")

    def __init__(self, tokens: list[int], eos: int | None) -> None:
        if not tokens and eos is None:
            raise EngineError(
                UNSUPPORTED, "the structured output is empty and the model has no EOS to end it"
            )
        self._tokens = tokens
        self._eos = eos

    def next_token(self, pos: int) -> tuple[int, bool]:
        """The token at output position `pos` (counting migrated tokens), and whether it ends the sequence."""
        tokens = self._tokens
        if pos < len(tokens):
            return tokens[pos], self._eos is None and pos == len(tokens) - 1
        assert self._eos is not None
        return self._eos, True


OutputPlan = DrawnTokens | ScriptedTokens


def output_plan(
    request: GenerateRequest, source: TokenSource, draw: Draw, natural_len: int | None, seed: int
) -> OutputPlan:
    """How `request` is answered; raises a non-retriable EngineError for a constraint the sim cannot honour.

    `seed` picks the structured text; it must be a function of the request (not of the worker) so a
    migrated request continues the same text.
    """
    sampling = request.sampling
    if sampling.structured is None:
        return DrawnTokens(source, sampling, draw, natural_len)
    try:
        text = structured_text(sampling.structured, seed)
    except StructuredUnsupported as e:
        raise EngineError(UNSUPPORTED, str(e)) from e
    tokens = _script(text, source.tokenizer, request)
    prior = len(request.generated_token_ids)
    banned = [t for t in tokens[prior:] if sampling.logit_bias.get(t, 0.0) <= BANNED_BIAS]
    if banned:
        raise EngineError(
            UNSUPPORTED,
            f"structured outputs with logit_bias banning token {banned[0]}, which the output needs, "
            "are not supported by the simulated engine",
        )
    return ScriptedTokens(tokens, None if sampling.ignore_eos else source.eos)


def _script(text: str, tokenizer: Tokenizer, request: GenerateRequest) -> list[int]:
    """All output tokens of `text`, starting with the ones generated before a migration."""
    tokens = tokenizer.encode(text, add_special_tokens=False).ids
    prior = request.generated_token_ids
    if prior and tokens[: len(prior)] != prior:
        # Another tokenization of the same text (or another engine) came first: continue after its text.
        said = tokenizer.decode(prior, skip_special_tokens=False)
        if not text.startswith(said):
            raise EngineError(
                "structured_output_mismatch",
                "the tokens generated before the migration are not a prefix of this engine's structured output",
            )
        tokens = [*prior, *tokenizer.encode(text[len(said) :], add_special_tokens=False).ids]
    # The client sees the detokenized stream; tokenizers that add a leading space (Metaspace) or
    # normalise the text would not say it exactly.
    plain = SamplingParams(skip_special_tokens=request.sampling.skip_special_tokens)
    detok = Detokenizer(tokenizer, plain, None, request.prompt_token_ids)
    said = "".join(detok.step(t, final=i == len(tokens) - 1).text for i, t in enumerate(tokens))
    if said != text:
        raise EngineError(
            UNSUPPORTED,
            "structured outputs are not supported by the simulated engine with this model's tokenizer, "
            f"which renders {text[:40]!r} as {said[:40]!r}",
        )
    return tokens


def _contains(sorted_ids: list[int], token: int) -> bool:
    i = bisect.bisect_left(sorted_ids, token)
    return i < len(sorted_ids) and sorted_ids[i] == token
