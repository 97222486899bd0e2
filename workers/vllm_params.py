"""Sampling fields vLLM takes in its own form (structured outputs, logit_bias, min_p, min_tokens), and
vLLM's refusals of a request as typed Engine errors.

vLLM validates a constraint when the request is added (it compiles the grammar with its backend; the
default `auto` picks xgrammar and falls back to guidance or outlines) and refuses with
VLLMValidationError, or a ValueError for a few inputs its backends cannot take: neither can succeed
on another worker, so both become non-retriable errors the frontend answers with 400.
"""

from __future__ import annotations

import json
from typing import Any

from vllm.exceptions import VLLMClientError
from vllm.sampling_params import StructuredOutputsParams

from schemas.kafka import GenerateRequest
from workers.engine import EngineError

INVALID_REQUEST = "invalid_request"
INVALID_STRUCTURED_OUTPUT = "invalid_structured_output"
NOT_RESUMABLE = "structured_output_not_resumable"


def structured_outputs(request: GenerateRequest) -> StructuredOutputsParams | None:
    """vLLM's form of the request's constraint; raises a non-retriable EngineError if vLLM rejects its
    shape, or if the request was migrated: vLLM's grammar would start again after the tokens generated
    elsewhere (they reach it as prompt), so the whole output could not be valid."""
    constraint = request.sampling.structured
    if constraint is None:
        return None
    if request.generated_token_ids:
        raise EngineError(
            NOT_RESUMABLE, "a structured output cannot be continued on the vLLM engine after a migration"
        )
    try:
        return StructuredOutputsParams(
            json=_schema(constraint.json_schema) if constraint.json_schema is not None else None,
            json_object=True if constraint.json_object else None,
            regex=constraint.regex,
            choice=list(constraint.choice) if constraint.choice is not None else None,
            grammar=constraint.grammar,
        )
    except (VLLMClientError, ValueError) as e:
        raise EngineError(INVALID_STRUCTURED_OUTPUT, f"structured_outputs: {e}") from e


def logit_fields(request: GenerateRequest) -> dict[str, Any]:
    """logit_bias, min_p and min_tokens for vLLM's SamplingParams.

    min_tokens counts the whole output, so a migrated request needs only the rest of it from vLLM,
    which sees the tokens generated elsewhere as prompt. (Ferry's Detokenizer counts them itself.)
    """
    s = request.sampling
    min_tokens = max(0, s.min_tokens - len(request.generated_token_ids))
    return {
        "logit_bias": dict(s.logit_bias) or None,
        "min_p": s.min_p,
        "min_tokens": min(min_tokens, request.max_tokens),
    }


def refusal(request: GenerateRequest, error: Exception) -> EngineError | None:
    """The EngineError for vLLM refusing `request` at add_request, or None if `error` is no refusal."""
    if not isinstance(error, VLLMClientError | ValueError | TypeError):
        return None
    code = INVALID_STRUCTURED_OUTPUT if request.sampling.structured is not None else INVALID_REQUEST
    return EngineError(code, str(error) or type(error).__name__)


def _schema(text: str) -> dict[str, Any] | str:
    # vLLM takes a dict (its OpenAI server passes one); anything else goes as text for vLLM to judge.
    try:
        schema = json.loads(text)
    except json.JSONDecodeError:
        return text
    return schema if isinstance(schema, dict) else text
