"""OpenAI-style errors: one exception type, rendered as `{"error": {...}}` with the right status."""

from __future__ import annotations

import msgspec
from starlette.responses import Response

from schemas.openai import ErrorDetail, ErrorResponse, json_encoder

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable_error",
}


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
        return ErrorResponse(
            ErrorDetail(self.message, _TYPES.get(self.status, "server_error"), self.param, self.code)
        )

    def response(self) -> Response:
        """The error as a complete HTTP response."""
        headers = {}
        if self.retry_after is not None:
            headers["Retry-After"] = str(max(1, round(self.retry_after)))
        return Response(
            json_encoder.encode(self.body()), self.status, headers=headers, media_type="application/json"
        )


def from_validation_error(exc: msgspec.ValidationError | msgspec.DecodeError) -> APIError:
    """A 400 for a body msgspec refused, naming the offending field as OpenAI's `param`."""
    text = str(exc)
    param = None
    if " - at `$." in text:
        text, _, path = text.rpartition(" - at `$.")
        param = path.rstrip("`")
    elif text.startswith("Object missing required field `"):
        param = text.split("`")[1]
    if isinstance(exc, msgspec.ValidationError):
        message = f"{text}" + (f" (at '{param}')" if param else "")
        return APIError(400, message, param=param, code="invalid_value")
    return APIError(400, f"Invalid JSON body: {text}", code="invalid_json")


def model_not_found(model: str) -> APIError:
    """The 404 OpenAI returns for a model it does not serve."""
    return APIError(
        404,
        f"The model `{model}` does not exist or you do not have access to it.",
        param="model",
        code="model_not_found",
    )
