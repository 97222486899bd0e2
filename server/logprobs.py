"""Token logprobs as OpenAI shows them: token strings, chat-style entries and legacy completion lists."""

from __future__ import annotations

from collections.abc import Sequence

from schemas.kafka import TokenLogprob
from schemas.openai import (
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionLogprobs,
    PromptLogprob,
    PromptLogprobs,
    TopLogprob,
)
from server.model_files import ModelFiles


class LogprobFormatter:
    """Token ids to the strings OpenAI shows in logprobs."""

    def __init__(self, model: ModelFiles) -> None:
        self._model = model

    def token(self, token_id: int) -> str:
        """The text of one token as it would appear in the output."""
        return self._model.decode([token_id], skip_special_tokens=False)

    def chat(self, entries: list[TokenLogprob]) -> ChatLogprobs:
        """Chat-style logprobs."""
        content = []
        for e in entries:
            tok = self.token(e.token_id)
            tops = [TopLogprob(self.token(t), lp, list(self.token(t).encode())) for t, lp in e.top]
            content.append(ChatTokenLogprob(tok, e.logprob, list(tok.encode()), tops))
        return ChatLogprobs(content)

    def completion(self, entries: Sequence[TokenLogprob | int], offset: int) -> CompletionLogprobs:
        """Legacy completion-style logprobs, text offsets counted from `offset` by each token's length.

        A bare token id is a token without logprobs (an echoed prompt's first, which nothing precedes). As vLLM
        shows them, each token's alternatives include the token itself, first, whatever its rank."""
        tokens: list[str] = []
        lps: list[float | None] = []
        tops: list[dict[str, float] | None] = []
        offsets: list[int] = []
        for e in entries:
            if isinstance(e, int):
                tok = self.token(e)
                lps.append(None)
                tops.append(None)
            else:
                tok = self.token(e.token_id)
                lps.append(_finite(e.logprob))
                shown = {tok: _finite(e.logprob)}
                shown.update((self.token(t), _finite(lp)) for t, lp in e.top)
                tops.append(shown)
            tokens.append(tok)
            offsets.append(offset)
            offset += len(tok)
        return CompletionLogprobs(tokens, lps, tops, offsets)

    def echoed(
        self,
        first_tokens: list[int] | None,
        index: int,
        prompt: list[TokenLogprob | None] | None,
        length: int,
    ) -> list[TokenLogprob | int]:
        """Prompt `index`'s entries for `completion` when echoed: its first token bare (token 0 for a stream
        recorded before first tokens were), then the logprobs of the others (a moved sequence's prompt
        logprobs may run past the prompt into its output: cut at `length`)."""
        first = first_tokens[index] if first_tokens else 0
        rest = [e for e in (prompt or [])[1:length] if e is not None]
        return [first, *rest]

    def prompt(self, entries: list[TokenLogprob | None]) -> PromptLogprobs:
        """vLLM-style prompt logprobs: per position, the prompt token and its top alternatives by token id."""
        out: PromptLogprobs = []
        for e in entries:
            if e is None:
                out.append(None)
                continue
            # The alternatives in rank order, then the prompt token itself whatever its rank (as vLLM does).
            shown = {str(t): PromptLogprob(lp, rank, self.token(t)) for rank, (t, lp) in enumerate(e.top, 1)}
            shown.setdefault(str(e.token_id), PromptLogprob(e.logprob, e.rank, self.token(e.token_id)))
            out.append(shown)
        return out


def _finite(logprob: float) -> float:
    # JSON has no -inf: vLLM shows an impossible token's logprob as -9999.0.
    return max(logprob, -9999.0)
