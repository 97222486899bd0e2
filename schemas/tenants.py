"""Tenants: who shares a Ferry deployment, with which keys, weights and quotas (the `--tenants` TOML file)."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

# Scheduling classes, highest first: a higher class is admitted before a lower one when workers are busy.
Priority = Literal["high", "normal", "low"]

NonNegative = Annotated[int, msgspec.Meta(ge=0)]


class Tenant(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """One `[tenants.<name>]` table; a limit of 0 means none."""

    api_keys: Annotated[list[Annotated[str, msgspec.Meta(min_length=1)]], msgspec.Meta(min_length=1)]
    weight: Annotated[float, msgspec.Meta(gt=0)] = 1.0
    requests_per_minute: NonNegative = 0
    tokens_per_minute: NonNegative = 0
    max_concurrent: NonNegative = 0
    priority: Priority = "normal"


class UsageRecord(msgspec.Struct, frozen=True, kw_only=True):
    """One finished request's usage, as published to the usage topic (cost attribution)."""

    at: float  # unix time the request ended
    tenant: str
    key_id: str  # a short digest of the API key, never the key
    model: str
    requests: int = 1
    errors: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
