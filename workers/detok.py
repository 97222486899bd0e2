"""Incremental detokenization of one sequence, with stop strings, stop token ids and EOS.

Text is produced with `tokenizers`' DecodeStream, so characters split across tokens come out
whole. While stop strings are set, a tail that could still grow into one is held back: streamed
text never has to be retracted, and the stop string itself is never emitted (as in vLLM/OpenAI).
With `min_tokens`, a stop string counts only if it ends in the text of a later token, as in vLLM;
EOS and stop token ids still end the sequence wherever they appear: engines keep them from being
produced before `min_tokens` (vLLM masks their logits).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import NamedTuple

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from schemas.kafka import SamplingParams

logger = logging.getLogger(__name__)

_INVALID_PREFIX = "Invalid prefix encountered"
# Prompt tokens decoded before the output, so the first output token gets its leading space
# right (vLLM primes its DecodeStream the same way).
_PRIME_MIN_TOKENS = 4
_PRIME_MAX_TOKENS = 24


class DetokOutput(NamedTuple):
    """Text produced by one token, and whether that token ended the sequence (a tuple: one per token, cheap to make)."""

    text: str
    stopped: bool = False
    # The stop string, or the stop token id; None for EOS or while running.
    stop_reason: str | int | None = None


class Detokenizer:
    """Turns one sequence's output token ids into text deltas that never need retracting."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        sampling: SamplingParams,
        eos_token_id: int | None = None,
        prompt_token_ids: Sequence[int] = (),
        prior_output_ids: Sequence[int] = (),
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special = sampling.skip_special_tokens
        self._stops = list(dict.fromkeys(s for s in sampling.stop if s))
        self._stop_token_ids = frozenset(sampling.stop_token_ids)
        self._eos = None if sampling.ignore_eos else eos_token_id
        self._stream = DecodeStream(skip_special_tokens=self._skip_special)
        # Decoded but not yet emitted text: never longer than the longest stop string plus
        # one token's text, so stop-string checks cost O(1) per token.
        self._pending = ""
        self.finished = False
        # min_tokens: output tokens so far (migrated ones too), and the length of the head of
        # _pending that came from the first min_tokens tokens, where no stop string may end.
        self._min_tokens = sampling.min_tokens
        self._count = len(prior_output_ids)
        self._stop_from = 0
        self._prime(prompt_token_ids)
        if prior_output_ids:
            self._resume(prior_output_ids)

    def step(self, token_id: int, final: bool = False) -> DetokOutput:
        """Add one output token; `final` means no token follows, so held-back text is flushed."""
        if self.finished:
            raise RuntimeError("the sequence has already finished")
        if token_id == self._eos or token_id in self._stop_token_ids:
            self.finished = True
            reason = None if token_id == self._eos else token_id
            return DetokOutput(self._flush(), stopped=True, stop_reason=reason)
        self._count += 1
        piece = self._decode(token_id)
        if not self._stops:
            # Nothing to look for and nothing held back: the token's text goes out as it is (most requests).
            if final:
                self.finished = True
            return DetokOutput(piece or "")
        if piece and self._count <= self._min_tokens:
            self._pending += piece
            self._stop_from = len(self._pending)
        elif piece:
            self._pending += piece
            hit = self._find_stop()
            if hit is not None:
                index, stop = hit
                self._pending = self._pending[:index]
                self.finished = True
                return DetokOutput(self._flush(), stopped=True, stop_reason=stop)
        if final:
            self.finished = True
            return DetokOutput(self._flush())
        return DetokOutput(self._emit(len(self._pending) - self._holdback(self._pending)))

    def _prime(self, prompt_token_ids: Sequence[int]) -> None:
        suffix = list(prompt_token_ids[-_PRIME_MAX_TOKENS:])
        # Start at a token boundary that decodes cleanly, or the first output would carry the
        # tail of a split character from the prompt.
        for n in range(_PRIME_MIN_TOKENS, len(suffix) + 1):
            if "\ufffd" not in self._tokenizer.decode(suffix[-n:], skip_special_tokens=self._skip_special):
                suffix = suffix[-n:]
                break
        for token_id in suffix:
            self._decode(token_id)

    def _resume(self, prior_output_ids: Iterable[int]) -> None:
        # A migrated sequence: the previous worker emitted this text up to the same held-back
        # tail, so hold that tail again and the client's text continues without a gap.
        text = "".join(piece for t in prior_output_ids if (piece := self._decode(t)))
        hold = self._holdback(text)
        self._pending = text[len(text) - hold :] if hold else ""
        # The previous worker found no stop string in it (or none could end there yet).
        self._stop_from = len(self._pending)

    def _decode(self, token_id: int) -> str | None:
        try:
            return self._stream.step(self._tokenizer, token_id)
        except Exception as e:
            if not str(e).startswith(_INVALID_PREFIX):
                raise
            # Rare non-monotonic UTF-8 output breaks DecodeStream's state; vLLM recovers the same way.
            logger.warning("detokenizer reset after an invalid prefix")
            self._stream = DecodeStream(skip_special_tokens=self._skip_special)
            return self._stream.step(self._tokenizer, token_id)

    def _find_stop(self) -> tuple[int, str] | None:
        best: tuple[int, str] | None = None
        for stop in self._stops:
            index = self._pending.find(stop, max(0, self._stop_from - len(stop) + 1))
            if index >= 0 and (best is None or index < best[0]):
                best = (index, stop)
        return best

    def _holdback(self, text: str) -> int:
        """Length of the longest tail of `text` that is a proper prefix of a stop string."""
        longest = 0
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:n]):
                    longest = n
                    break
        return longest

    def _emit(self, upto: int) -> str:
        out, self._pending = self._pending[:upto], self._pending[upto:]
        self._stop_from = max(0, self._stop_from - upto)
        return out

    def _flush(self) -> str:
        return self._emit(len(self._pending))
