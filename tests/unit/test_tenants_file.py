"""The tenants file parser: good files, and malformed ones stopping start-up with the line or tenant and field."""

from __future__ import annotations

from pathlib import Path

import pytest

from server.tenants import TenantsError, configured_tenants, load_tenants, parse_tenants
from server.tenants_quota import _reset_text

GOOD = """
[tenants.alpha]
api_keys = ["ka1", "ka2"]
weight = 2
requests_per_minute = 60
tokens_per_minute = 10000
max_concurrent = 4
priority = "high"

[tenants.beta]
api_keys = ["kb"]
"""


def test_a_good_file_is_parsed_with_defaults() -> None:
    tenants = parse_tenants(GOOD)
    assert set(tenants) == {"alpha", "beta"}
    a, b = tenants["alpha"], tenants["beta"]
    assert a.api_keys == ["ka1", "ka2"] and a.weight == 2.0 and a.priority == "high"
    assert (a.requests_per_minute, a.tokens_per_minute, a.max_concurrent) == (60, 10000, 4)
    assert (b.weight, b.requests_per_minute, b.tokens_per_minute, b.max_concurrent, b.priority) == (
        1.0, 0, 0, 0, "normal",
    )  # fmt: skip


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('[tenants.a]\napi_keys = ["k"\n', "not valid TOML"),
        ('[tenants.a]\napi_keys = ["k"]\nweight = 1,\n', "line 3"),
        ('[tenants.a]\napi_keys = ["k"]\nweight = 0\n', "tenants.a.weight: Expected `float` > 0.0"),
        ('[tenants.a]\napi_keys = ["k"]\nwieght = 1\n', "tenants.a: Object contains unknown field `wieght`"),
        (
            '[tenants.a]\napi_keys = ["k"]\nmax_concurrent = -1\n',
            "tenants.a.max_concurrent: Expected `int` >= 0",
        ),
        ('[tenants.a]\napi_keys = ["k"]\nrequests_per_minute = "10"\n', "tenants.a.requests_per_minute"),
        ('[tenants.a]\napi_keys = ["k"]\npriority = "urgent"\n', "tenants.a.priority"),
        ("[tenants.a]\napi_keys = []\n", "tenants.a.api_keys: Expected `array` of length >= 1"),
        ('[tenants.a]\napi_keys = [""]\n', "tenants.a.api_keys[0]"),
        ("[tenants.a]\nweight = 1\n", "tenants.a: Object missing required field `api_keys`"),
        (
            '[tenants.a]\napi_keys = ["k"]\n[tenants.b]\napi_keys = ["k"]\n',
            "tenants.b.api_keys[0]: the same key",
        ),
        ('[tenants."a b"]\napi_keys = ["k"]\n', "tenants.a b: a tenant name"),
        ("tenants = 1\n", "no [tenants.<name>] table"),
        ("", "no [tenants.<name>] table"),
        ('[other]\nx = 1\n[tenants.a]\napi_keys = ["k"]\n', "other: unknown table"),
        ("[tenants]\na = 1\n", "tenants.a: Expected `object`"),
    ],
)
def test_a_malformed_file_names_what_is_wrong(text: str, expected: str) -> None:
    with pytest.raises(TenantsError) as info:
        parse_tenants(text, "t.toml")
    assert str(info.value).startswith("t.toml: ") and expected in str(info.value), str(info.value)
    assert '"k"' not in str(info.value)


def test_loading_a_file_and_combining_with_api_keys(tmp_path: Path) -> None:
    path = tmp_path / "tenants.toml"
    path.write_text(GOOD)
    assert set(load_tenants(str(path))) == {"alpha", "beta"}
    assert configured_tenants("", "k1,k2") == {}
    with pytest.raises(TenantsError, match="--tenants and --api-keys"):
        configured_tenants(str(path), "k1")
    with pytest.raises(TenantsError, match="cannot read"):
        load_tenants(str(tmp_path / "missing.toml"))


def test_reset_times_are_written_as_openai_does() -> None:
    assert _reset_text(1000) == "1s" and _reset_text(500) == "0.5s" and _reset_text(360_000) == "6m0s"
