"""API keys: an ASGI middleware that lets a request through only with the right `Authorization: Bearer`.

Everything is closed except a short list of operational paths (health, readiness, metrics, the OpenAPI
document), so a route added later is protected without anyone remembering to. `/v1/admin/*` needs the admin
key. Keys are compared as SHA-256 digests with `hmac.compare_digest` against every configured key, so neither
the time taken nor an early exit tells a caller how much of a key was right or which key it was near.

With tenants (`--tenants`, docs/tenants.md) the user keys are the tenants' keys: a request's tenant and key id
are put in its scope's state (`request.state.tenant`, `request.state.key_id`) for quotas and usage; a key in
no tenant is 401. The admin key belongs to no tenant and is not metered.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable, Mapping

from starlette.types import ASGIApp, Receive, Scope, Send

from schemas.tenants import Tenant
from server.errors import APIError
from server.tenants import key_id

OPEN_PATHS = frozenset({"/health", "/ready", "/metrics", "/discovery/prometheus", "/openapi.json"})
ADMIN_PREFIX = "/v1/admin"
# vLLM's own LoRA paths, served beside /v1/admin/* (server/vllm_routes.py): admin routes too.
ADMIN_PATHS = frozenset({"/v1/load_lora_adapter", "/v1/unload_lora_adapter"})


def parse_keys(value: str) -> list[str]:
    """Keys from a comma-separated setting; blanks are dropped."""
    return [k.strip() for k in value.split(",") if k.strip()]


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).digest()


def _matches(digest: bytes, allowed: Iterable[bytes]) -> bool:
    found = False
    for candidate in allowed:
        # No early exit: the time taken does not depend on which key matched.
        found |= hmac.compare_digest(digest, candidate)
    return found


def _owner(digest: bytes, owners: list[tuple[bytes, str, str]]) -> tuple[str, str] | None:
    """The (tenant, key id) of the key with `digest`, comparing against every key (no early exit)."""
    found = None
    for candidate, tenant, kid in owners:
        if hmac.compare_digest(digest, candidate):
            found = (tenant, kid)
    return found


def _bearer(scope: Scope) -> str | None:
    """The token of an `Authorization: Bearer <token>` header, None without one."""
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").strip().partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
            return None
    return None


def _missing_key() -> APIError:
    # OpenAI's wording and shape for a request without a key (its `code` is null).
    return APIError(
        401,
        "You didn't provide an API key. You need to provide your API key in an Authorization header using "
        "Bearer auth (i.e. Authorization: Bearer YOUR_KEY).",
    )


def _wrong_key() -> APIError:
    # Unlike OpenAI, no part of the key is echoed: error bodies end up in client logs.
    return APIError(401, "Incorrect API key provided.", code="invalid_api_key")


def _not_admin() -> APIError:
    return APIError(
        401,
        "You have insufficient permissions for this operation: admin routes need the admin key.",
        code="insufficient_permissions",
    )


class APIKeyAuth:
    """Pure ASGI middleware (streams pass through untouched) enforcing API and admin keys."""

    def __init__(
        self,
        app: ASGIApp,
        api_keys: Iterable[str] = (),
        admin_key: str = "",
        tenants: Mapping[str, Tenant] | None = None,
    ) -> None:
        self.app = app
        self._owners = [
            (_digest(k), name, key_id(k)) for name, t in (tenants or {}).items() for k in t.api_keys
        ]
        self._user = [_digest(k) for k in api_keys] + [d for d, _, _ in self._owners]
        self._admin = [_digest(admin_key)] if admin_key else []
        self.enabled = bool(self._user or self._admin)

    def check(self, path: str, token: str | None) -> APIError | None:
        """The error for a request to `path` carrying `token`, or None if it may pass."""
        if not self.enabled or path in OPEN_PATHS:
            return None
        admin_route = path == ADMIN_PREFIX or path.startswith(ADMIN_PREFIX + "/") or path in ADMIN_PATHS
        if not admin_route and not self._user:
            return None  # only an admin key is set: it guards the admin routes alone
        if token is None:
            return _missing_key()
        digest = _digest(token)
        is_admin = _matches(digest, self._admin)
        if admin_route:
            if is_admin:
                return None
            return _not_admin() if _matches(digest, self._user) else _wrong_key()
        # An admin may do whatever a user may.
        return None if is_admin or _matches(digest, self._user) else _wrong_key()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Refuse an unauthorized HTTP request with an OpenAI-style 401 before any route runs."""
        if scope["type"] == "http":
            token = _bearer(scope)
            error = self.check(scope["path"], token)
            if error is not None:
                await error.response()(scope, receive, send)
                return
            if self._owners and token is not None:
                owner = _owner(_digest(token), self._owners)
                if owner is not None:
                    state = scope.setdefault("state", {})
                    state["tenant"], state["key_id"] = owner
        await self.app(scope, receive, send)
