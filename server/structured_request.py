"""Request fields beyond messages and the plain sampling knobs: structured outputs (`response_format`,
vLLM's `structured_outputs` and its older `guided_*` fields), `logit_bias`, `min_tokens`,
`chat_template_kwargs`, and the fields Ferry knows but does not support, each refused with a 400 naming it.
"""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import msgspec

from schemas.kafka import StructuredOutput
from schemas.openai import ChatCompletionRequest, SamplingFields
from schemas.structured import JSONObjectFormat, JSONSchemaFormat, StructuredOutputsRequest
from server.errors import APIError

# Fields declared on the request Structs (so that their "off" value is accepted, as clients send them)
# that Ferry cannot honour: any other value is a 400 naming the field. The values listed mean "off".
UNSUPPORTED: dict[str, tuple[object, ...]] = {
    # OpenAI's
    "audio": (None,),
    "modalities": (None, ["text"]),
    "prediction": (None,),
    "web_search_options": (None,),
    "reasoning_effort": (None,),
    "verbosity": (None,),
    "prompt_cache_retention": (None,),
    # vLLM's
    "use_beam_search": (None, False),
    "length_penalty": (None, 1.0),
    "include_stop_str_in_output": (None, False),
    "spaces_between_special_tokens": (None, True),
    "truncate_prompt_tokens": (None,),
    "allowed_token_ids": (None,),
    "bad_words": (None, []),
    "guided_decoding_backend": (None,),
    "guided_whitespace_pattern": (None,),
    "return_tokens_as_token_ids": (None, False),
    "return_token_ids": (None, False),
    "cache_salt": (None,),
    "vllm_xargs": (None,),
}
CHAT_UNSUPPORTED: dict[str, tuple[object, ...]] = {
    "continue_final_message": (None, False),
    "chat_template": (None,),
    "documents": (None,),
    "add_special_tokens": (None, False),
    "echo": (None, False),
}
COMPLETION_UNSUPPORTED: dict[str, tuple[object, ...]] = {
    "best_of": (None, 1),
}

# What `service_tier` may ask for: Ferry serves every request alike, which is what these mean.
SERVICE_TIERS = (None, "auto", "default")

# chat_template_kwargs that would replace what the request's own fields put into the template.
RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "tools", "add_generation_prompt"})

_TOKEN_ID = re.compile(r"[0-9]{1,10}")


def unsupported(param: str, message: str) -> APIError:
    """The 400 for a field Ferry does not support."""
    return APIError(400, message, param=param, code="unsupported_parameter")


def refuse_unsupported(req: SamplingFields) -> None:
    """Raise a 400 for the first field that asks for something Ferry does not do."""
    own = CHAT_UNSUPPORTED if isinstance(req, ChatCompletionRequest) else COMPLETION_UNSUPPORTED
    for name, off in (UNSUPPORTED | own).items():
        value = getattr(req, name, None)
        # `True == 1` in Python: a boolean is off only where a boolean is.
        if not any(value == o and isinstance(value, bool) == isinstance(o, bool) for o in off):
            raise unsupported(name, f"Unsupported parameter: '{name}' is not supported by this server.")
    if req.service_tier not in SERVICE_TIERS:
        raise unsupported(
            "service_tier", f"Unsupported value: 'service_tier' {req.service_tier!r}; this server serves every "
            "request alike ('auto' or 'default')."
        )  # fmt: skip
    if req.store:
        raise unsupported("store", "Unsupported value: 'store' true; this server does not store completions.")


def _schema_text(schema: Any, param: str) -> str:
    """A JSON Schema (an object, or JSON text of one) checked against its meta-schema, as JSON text."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise APIError(
                400, f"Invalid '{param}': not valid JSON ({e}).", param=param, code="invalid_value"
            ) from None
    if not isinstance(schema, dict):
        raise APIError(
            400, f"Invalid '{param}': a JSON Schema must be an object.", param=param, code="invalid_value"
        )
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        where = "/".join(str(p) for p in e.absolute_path)
        at = f" at '{where}'" if where else ""
        raise APIError(
            400,
            f"Invalid '{param}': not a valid JSON Schema{at}: {e.message}",
            param=param,
            code="invalid_value",
        ) from None
    return msgspec.json.encode(schema).decode()


def _choice(choice: list[str], param: str) -> StructuredOutput:
    if not choice:
        raise APIError(
            400, f"Invalid '{param}': give at least one choice.", param=param, code="invalid_value"
        )
    return StructuredOutput(choice=list(choice))


def _grammar(grammar: str, param: str) -> StructuredOutput:
    if not grammar.strip():
        raise APIError(400, f"Invalid '{param}': the grammar is empty.", param=param, code="invalid_value")
    return StructuredOutput(grammar=grammar)


def _from_structured_outputs(so: StructuredOutputsRequest) -> list[tuple[str, StructuredOutput]]:
    p = "structured_outputs"
    if so.structural_tag is not None:
        raise unsupported(f"{p}.structural_tag", "Unsupported parameter: structural tags are not supported.")
    for option, value in (
        ("disable_any_whitespace", so.disable_any_whitespace),
        ("disable_additional_properties", so.disable_additional_properties),
        ("whitespace_pattern", so.whitespace_pattern),
    ):
        # Not carried to the workers: honouring them would change vLLM's grammar, and the simulated
        # engine writes its own JSON layout.
        if value:
            raise unsupported(f"{p}.{option}", f"Unsupported parameter: '{p}.{option}' is not supported.")
    found: list[tuple[str, StructuredOutput]] = []
    if so.json is not None:
        found.append((f"{p}.json", StructuredOutput(json_schema=_schema_text(so.json, f"{p}.json"))))
    if so.regex is not None:
        found.append((f"{p}.regex", StructuredOutput(regex=so.regex)))
    if so.choice is not None:
        found.append((f"{p}.choice", _choice(so.choice, f"{p}.choice")))
    if so.grammar is not None:
        found.append((f"{p}.grammar", _grammar(so.grammar, f"{p}.grammar")))
    if so.json_object:
        found.append((f"{p}.json_object", StructuredOutput(json_object=True)))
    if not found:
        raise APIError(
            400, "'structured_outputs' needs one constraint: json, regex, choice, grammar or json_object.",
            param=p, code="invalid_value",
        )  # fmt: skip
    return found


def structured_output(req: SamplingFields) -> StructuredOutput | None:
    """The one output constraint the request asks for, None without one; 400 if it asks for several."""
    found: list[tuple[str, StructuredOutput]] = []
    rf = req.response_format
    if isinstance(rf, JSONObjectFormat):
        found.append(("response_format", StructuredOutput(json_object=True)))
    elif isinstance(rf, JSONSchemaFormat):
        param = "response_format.json_schema.schema"
        if rf.json_schema.schema is None:
            raise APIError(
                400, f"Missing required parameter: '{param}'.", param=param, code="missing_required_parameter"
            )
        found.append((param, StructuredOutput(json_schema=_schema_text(rf.json_schema.schema, param))))
    if req.structured_outputs is not None:
        found.extend(_from_structured_outputs(req.structured_outputs))
    if req.guided_json is not None:
        found.append(
            ("guided_json", StructuredOutput(json_schema=_schema_text(req.guided_json, "guided_json")))
        )
    if req.guided_regex is not None:
        found.append(("guided_regex", StructuredOutput(regex=req.guided_regex)))
    if req.guided_choice is not None:
        found.append(("guided_choice", _choice(req.guided_choice, "guided_choice")))
    if req.guided_grammar is not None:
        found.append(("guided_grammar", _grammar(req.guided_grammar, "guided_grammar")))
    if len(found) > 1:
        names = ", ".join(f"'{p}'" for p, _ in found)
        raise APIError(
            400, f"Only one structured-output constraint may be given per request; this one has {names}.",
            param=found[1][0], code="invalid_value",
        )  # fmt: skip
    return found[0][1] if found else None


def logit_bias(req: SamplingFields, vocab_size: int) -> dict[int, float]:
    """`logit_bias` with token ids as ints; 400 for an id outside the vocabulary or a bias outside ±100."""
    out: dict[int, float] = {}
    for key, bias in (req.logit_bias or {}).items():
        if not _TOKEN_ID.fullmatch(key) or int(key) >= vocab_size:
            raise APIError(
                400, f"Invalid 'logit_bias': key '{key}' is not a token id of this model (0 to {vocab_size - 1}).",
                param="logit_bias", code="invalid_value",
            )  # fmt: skip
        if not -100.0 <= bias <= 100.0:
            raise APIError(
                400, f"Invalid 'logit_bias': the bias of token {key} is {bias}; it must be between -100 and 100.",
                param="logit_bias", code="invalid_value",
            )  # fmt: skip
        out[int(key)] = float(bias)
    return out


def check_min_tokens(req: SamplingFields) -> None:
    """400 when `min_tokens` asks for more than the request's own token limit (as vLLM refuses it)."""
    limit = getattr(req, "max_completion_tokens", None) or req.max_tokens
    if limit is not None and req.min_tokens > limit:
        raise APIError(
            400, f"Invalid 'min_tokens': {req.min_tokens} is more than the request's maximum of {limit} tokens.",
            param="min_tokens", code="invalid_value",
        )  # fmt: skip


def template_kwargs(req: ChatCompletionRequest) -> dict[str, Any]:
    """`chat_template_kwargs` for the chat template; 400 for one that would replace a request field."""
    kwargs = dict(req.chat_template_kwargs or {})
    for key in kwargs:
        if key in RESERVED_TEMPLATE_KWARGS:
            raise APIError(
                400, f"Invalid 'chat_template_kwargs': '{key}' is set by the request itself.",
                param=f"chat_template_kwargs.{key}", code="invalid_value",
            )  # fmt: skip
    return kwargs
