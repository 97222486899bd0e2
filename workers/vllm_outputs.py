"""vLLM's outputs in Ferry's terms: one RequestOutput delta as an EngineOutput, text by Ferry's Detokenizer."""

from __future__ import annotations

import math
from collections.abc import Mapping

from vllm.logprobs import Logprob
from vllm.outputs import RequestOutput

from schemas.kafka import FinishReason, GenerateRequest, TokenLogprob
from workers.detok import Detokenizer
from workers.engine import EngineError, EngineOutput

# How vLLM's finish reasons read in Ferry; "error" is raised as a retriable EngineError instead.
_FINISH: dict[str, FinishReason] = {
    "stop": "stop",
    "repetition": "stop",
    "length": "length",
    "abort": "abort",
}


def engine_output(request: GenerateRequest, detok: Detokenizer, output: RequestOutput) -> EngineOutput | None:
    """The tokens, text, finish and logprobs of one vLLM delta (no usage); None if it carries nothing.

    Ferry's Detokenizer makes the text, so a stop string ends the sequence even if vLLM went on.
    """
    completion = output.outputs[0]
    vllm_finish = completion.finish_reason
    if vllm_finish == "error":
        # A request-level failure inside vLLM (e.g. a KV load); another worker may succeed.
        raise EngineError("engine_error", "vLLM failed the request", retriable=True)
    token_ids = list(completion.token_ids)
    text: list[str] = []
    kept = len(token_ids)
    # A reason this version does not know still ends the stream.
    finish = _FINISH.get(vllm_finish, "stop") if vllm_finish is not None else None
    stop_reason = completion.stop_reason
    for i, token in enumerate(token_ids):
        delta = detok.step(token, final=finish is not None and i == len(token_ids) - 1)
        text.append(delta.text)
        if delta.stopped:
            kept, finish, stop_reason = i + 1, "stop", delta.stop_reason
            break
    if not kept and finish is None:
        return None
    out = EngineOutput(
        token_ids=token_ids[:kept],
        text="".join(text),
        finish_reason=finish,
        stop_reason=stop_reason if finish == "stop" else None,
    )
    k = request.sampling.logprobs
    if k is not None and completion.logprobs:
        # Tokens after a stop string were dropped above, so the lists may differ in length.
        pairs = zip(out.token_ids, completion.logprobs, strict=False)
        out.logprobs = [token_logprob(t, entry, k) for t, entry in pairs]
    if request.sampling.prompt_logprobs is not None and output.prompt_logprobs:
        out.prompt_logprobs = prompt_logprobs(output, request.sampling.prompt_logprobs)
    if finish is not None:
        out.kv_transfer = output.kv_transfer_params
    return out


def prompt_logprobs(output: RequestOutput, k: int) -> list[TokenLogprob | None]:
    """vLLM's prompt logprobs (None for the first token, which nothing precedes), each with its rank."""
    ids = output.prompt_token_ids or []
    out: list[TokenLogprob | None] = []
    for token, entry in zip(ids, output.prompt_logprobs or [], strict=False):
        if entry is None:
            out.append(None)
            continue
        own = entry.get(token)
        lp = token_logprob(token, entry, k)
        out.append(TokenLogprob(lp.token_id, lp.logprob, lp.top, own.rank if own is not None else None))
    return out


def token_logprob(token: int, entry: Mapping[int, Logprob] | None, k: int) -> TokenLogprob:
    """vLLM's logprobs of one position: the sampled token's, and the top k by rank."""
    entry = entry or {}
    # vLLM always includes the sampled token, whatever its rank.
    sampled = entry.get(token)
    ranked = sorted(
        (lp.rank, t, lp.logprob) for t, lp in entry.items() if lp.rank is not None and lp.rank <= k
    )
    return TokenLogprob(
        token_id=token,
        logprob=sampled.logprob if sampled is not None else -math.inf,
        top=[(t, logprob) for _, t, logprob in ranked],
    )


def queued_seconds(output: RequestOutput) -> float:
    """How long vLLM kept the request in its waiting queue (its own request stats; 0 before scheduling)."""
    stats = getattr(output, "metrics", None)
    scheduled = getattr(stats, "scheduled_ts", 0.0)
    queued = getattr(stats, "queued_ts", 0.0)
    return max(scheduled - queued, 0.0) if scheduled and queued else 0.0
