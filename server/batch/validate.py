"""Checks of batch input files (line by line) and of completion windows, with errors that name the line."""

from __future__ import annotations

import re
from dataclasses import dataclass

import msgspec

from schemas.batch import BATCH_ENDPOINTS, BatchError, InputLine, input_line_decoder

# Stop listing problems after this many; the first ones are what a user fixes first.
MAX_REPORTED = 10

_WINDOW = re.compile(r"^(\d+)(s|m|h|d)$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def window_seconds(window: str) -> int | None:
    """Seconds of a completion window such as `24h`, `30m`, `10s`; None if it is not one."""
    m = _WINDOW.match(window.strip())
    if m is None or int(m.group(1)) <= 0:
        return None
    return int(m.group(1)) * _UNIT_S[m.group(2)]


def allowed_windows(spec: str) -> dict[str, int]:
    """The `--batch-windows` list as window -> seconds (invalid entries are a configuration error)."""
    out: dict[str, int] = {}
    for w in (x.strip() for x in spec.split(",")):
        if not w:
            continue
        s = window_seconds(w)
        if s is None:
            raise ValueError(f"--batch-windows: {w!r} is not a window like 24h, 30m or 10s")
        out[w] = s
    return out


@dataclass(frozen=True)
class ParsedFile:
    """The request lines of a valid batch file, in file order, with their 1-based line numbers."""

    lines: list[tuple[int, InputLine]]
    errors: list[BatchError]


def parse_batch_file(data: bytes, max_requests: int) -> ParsedFile:
    """Every request line of a JSONL batch file, or the errors that make it invalid (blank lines are skipped)."""
    lines: list[tuple[int, InputLine]] = []
    errors: list[BatchError] = []
    seen: dict[str, int] = {}

    def bad(line_no: int, code: str, message: str, param: str | None = None) -> None:
        if len(errors) < MAX_REPORTED:
            errors.append(BatchError(code=code, message=message, param=param, line=line_no))

    for line_no, raw in enumerate(data.split(b"\n"), start=1):
        if not raw.strip():
            continue
        try:
            line = input_line_decoder.decode(raw)
        except msgspec.ValidationError as exc:
            bad(line_no, "invalid_request", f"Line {line_no}: {exc}.")
            continue
        except (msgspec.DecodeError, UnicodeDecodeError) as exc:
            bad(line_no, "invalid_json", f"Line {line_no} is not valid JSON: {exc}.")
            continue
        if not line.custom_id:
            bad(line_no, "invalid_request", f"Line {line_no}: `custom_id` must not be empty.", "custom_id")
        elif line.custom_id in seen:
            bad(
                line_no,
                "duplicate_custom_id",
                f"Line {line_no}: `custom_id` {line.custom_id!r} is already used on line {seen[line.custom_id]}; "
                "each request needs its own.",
                "custom_id",
            )
        else:
            seen[line.custom_id] = line_no
        if line.method != "POST":
            bad(
                line_no,
                "invalid_request",
                f"Line {line_no}: `method` must be POST, not {line.method!r}.",
                "method",
            )
        if line.url not in BATCH_ENDPOINTS:
            bad(
                line_no,
                "invalid_url",
                f"Line {line_no}: `url` must be one of {', '.join(BATCH_ENDPOINTS)}, not {line.url!r}.",
                "url",
            )
        if not bytes(line.body).lstrip().startswith(b"{"):
            bad(line_no, "invalid_request", f"Line {line_no}: `body` must be a JSON object.", "body")
        lines.append((line_no, line))
        if len(lines) > max_requests:
            bad(line_no, "too_many_requests", f"A batch file may hold at most {max_requests} requests.")
            break
    if not lines and not errors:
        errors.append(BatchError(code="empty_file", message="The file holds no request lines."))
    return ParsedFile(lines, errors)
