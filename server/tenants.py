"""The tenants file: parsed once at start-up into msgspec Structs, strictly, or start-up stops.

A bad file names what is wrong: TOML syntax errors with the line and column tomllib reports, the rest with
the tenant and the field (`tenants.alpha.weight: Expected float >= 0`).
"""

from __future__ import annotations

import hashlib
import re
import tomllib
from pathlib import Path

import msgspec

from schemas.tenants import Tenant

NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


class TenantsError(ValueError):
    """The tenants file cannot be used; the message says where and why."""


def parse_tenants(text: str, source: str = "tenants file") -> dict[str, Tenant]:
    """Tenants by name from the text of a tenants file; TenantsError names the line or tenant and field."""
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        # tomllib's message ends with "(at line L, column C)".
        raise TenantsError(f"{source}: not valid TOML: {exc}") from None
    extra = sorted(set(raw) - {"tenants"})
    if extra:
        raise TenantsError(f"{source}: {extra[0]}: unknown table or key (only [tenants.<name>] tables)")
    tables = raw.get("tenants")
    if not isinstance(tables, dict) or not tables:
        raise TenantsError(f"{source}: no [tenants.<name>] table")
    tenants: dict[str, Tenant] = {}
    for name, table in tables.items():
        if not NAME.fullmatch(name):
            raise TenantsError(f"{source}: tenants.{name}: a tenant name is 1-64 of A-Z a-z 0-9 _ . -")
        try:
            tenants[name] = msgspec.convert(table, Tenant)
        except msgspec.ValidationError as exc:
            # msgspec says "... - at `$.weight`": name the tenant and the field.
            message, _, where = str(exc).partition(" - at ")
            field = where.strip("`").removeprefix("$")
            raise TenantsError(f"{source}: tenants.{name}{field}: {message}") from None
    owner: dict[str, str] = {}
    for name, tenant in tenants.items():
        for i, key in enumerate(tenant.api_keys):
            if key in owner:
                # The key itself is not shown: error messages end up in logs.
                raise TenantsError(
                    f"{source}: tenants.{name}.api_keys[{i}]: the same key is also in tenant {owner[key]!r}"
                )
            owner[key] = name
    return tenants


def load_tenants(path: str) -> dict[str, Tenant]:
    """Tenants from the file at `path` (TenantsError if it cannot be read or is malformed)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise TenantsError(f"{path}: cannot read the tenants file: {exc}") from None
    return parse_tenants(text, path)


def key_id(key: str) -> str:
    """A short stable id of an API key for usage records and logs (never the key itself)."""
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).hexdigest()[:12]


def configured_tenants(path: str, api_keys: str) -> dict[str, Tenant]:
    """The tenants of `--tenants` (none if unset); with tenants, `--api-keys` must be empty (a key in no tenant
    would be unmetered, which the tenants file exists to prevent)."""
    if not path:
        return {}
    if api_keys.strip():
        raise TenantsError(
            f"{path}: --tenants and --api-keys (FERRY_API_KEYS) are both set; with tenants, every user key "
            "belongs to a tenant: move the keys into the tenants file"
        )
    return load_tenants(path)
