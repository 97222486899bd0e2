"""OpenAI-style errors: one exception type, rendered as `{"error": {...}}` with the right status."""

from __future__ import annotations

import msgspec
from starlette.responses import Response

from schemas.kafka import ErrorInfo
from schemas.openai import ErrorDetail, ErrorResponse, FieldError, json_encoder

# OpenAI calls every client error but rate limiting `invalid_request_error`, a bad or missing API key too.
_TYPES = {
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable_error",
}


def error_type(status: int) -> str:
    """OpenAI's `type` for an HTTP status."""
    if status in _TYPES:
        return _TYPES[status]
    return "invalid_request_error" if 400 <= status < 500 else "server_error"


class APIError(Exception):
    """An error the client should see, with its HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.retry_after = retry_after

    def body(self) -> ErrorResponse:
        """The error as an OpenAI error body."""
        return ErrorResponse(ErrorDetail(self.message, error_type(self.status), self.param, self.code))

    def response(self) -> Response:
        """The error as a complete HTTP response."""
        headers = {}
        if self.retry_after is not None:
            headers["Retry-After"] = str(max(1, round(self.retry_after)))
        return Response(
            json_encoder.encode(self.body()), self.status, headers=headers, media_type="application/json"
        )


def broker_unavailable() -> APIError:
    """The 503 a client gets while the broker does not take what the frontend writes (Retry-After: 2 s)."""
    return APIError(503, "The message broker is unavailable; try again shortly.", code="broker_unavailable", retry_after=2)


def from_validation_error(
    exc: msgspec.ValidationError | msgspec.DecodeError | UnicodeDecodeError,
) -> APIError:
    """A 400 for a body msgspec refused, naming the offending field as OpenAI's `param`."""
    if isinstance(exc, UnicodeDecodeError):
        return APIError(400, "The request body is not valid UTF-8 JSON.", code="invalid_json")
    text = str(exc)
    if isinstance(exc, msgspec.DecodeError) and not isinstance(exc, msgspec.ValidationError):
        return APIError(
            400, f"We could not parse the JSON body of your request: {text}.", code="invalid_json"
        )
    path = ""
    if " - at `$" in text:
        text, _, at = text.rpartition(" - at `$")
        path = at.rstrip("`").lstrip(".")
    cause = exc.__cause__
    if isinstance(cause, FieldError):
        # A rule checked in __post_init__: msgspec names the Struct, the rule names the field in it.
        param = f"{path}.{cause.field}" if path else cause.field
        return APIError(400, f"Invalid '{param}': {cause}", param=param, code=cause.code)
    if text.startswith("Object contains unknown field `"):
        # Request Structs forbid unknown fields: a field Ferry does not know is never silently ignored.
        field = text.split("`")[1]
        param = f"{path}.{field}" if path else field
        return APIError(
            400,
            f"Unrecognized request argument supplied: '{param}'.",
            param=param,
            code="unsupported_parameter",
        )
    if text.startswith("Object missing required field `"):
        field = text.split("`")[1]
        param = f"{path}.{field}" if path else field
        return APIError(
            400, f"Missing required parameter: '{param}'.", param=param, code="missing_required_parameter"
        )
    code = "invalid_type" if text.startswith("Expected `") and ", got `" in text else "invalid_value"
    if not path:
        # The body as a whole has the wrong shape (an array, a string, null).
        return APIError(400, f"Invalid request body: {text}.", code=code)
    return APIError(400, f"Invalid '{path}': {text}.", param=path, code=code)


def model_not_found(model: str) -> APIError:
    """The 404 OpenAI returns for a model it does not serve."""
    return APIError(
        404,
        f"The model `{model}` does not exist or you do not have access to it.",
        param="model",
        code="model_not_found",
    )


# Worker error codes that mean the request itself cannot be served (a constraint the engine refused):
# the client's error, whichever worker ran it (workers/vllm_params.py, workers/sim_output.py).
CLIENT_ERROR_CODES = frozenset(
    {
        "context_length_exceeded",
        "invalid_request",
        "invalid_structured_output",
        "unsupported_structured_output",
    }
)


def error_status(error: ErrorInfo) -> APIError:
    """The HTTP error for a sequence that failed before anything was streamed."""
    if error.code in CLIENT_ERROR_CODES:
        return APIError(400, error.message, code=error.code)
    if error.retriable:
        return APIError(503, error.message, code=error.code, retry_after=1)
    return APIError(500, error.message, code=error.code)
