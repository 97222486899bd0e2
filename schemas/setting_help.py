"""The metadata of a setting's field: its help text, and a computed default described for --help and the docs."""

from __future__ import annotations


def _help(text: str, default: str | None = None) -> dict[str, str]:
    # `default` describes a default that is computed (an id, a path under $FERRY_HOME) for --help and the docs.
    return {"help": text} if default is None else {"help": text, "default": default}
