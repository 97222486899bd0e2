"""`ferry batch submit|status|results|cancel|list`: the batch API from a shell, over HTTP.

The commands talk to a running frontend (`--url`, or `FERRY_URL`; `--api-key` or `FERRY_API_KEY`
when the frontend requires keys) through the same OpenAI Files and Batches routes any client uses.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
from tqdm import tqdm

FINAL = ("completed", "failed", "expired", "cancelled")
USAGE = "ferry batch {submit FILE [--wait] | status ID | results ID -o FILE | cancel ID | list}"


class CliError(Exception):
    """Something to tell the user before exiting with status 1."""


def _client(args: argparse.Namespace) -> httpx.Client:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    return httpx.Client(base_url=args.url.rstrip("/") + "/v1", headers=headers, timeout=args.timeout)


def _check(response: httpx.Response) -> Any:
    if response.status_code >= 400:
        try:
            message = response.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = response.text
        raise CliError(
            f"{response.request.method} {response.request.url.path}: {response.status_code}: {message}"
        )
    return (
        response.json() if response.headers.get("content-type", "").startswith("application/json") else None
    )


def _endpoint_of(path: Path) -> str:
    with path.open("rb") as fh:
        for raw in fh:
            if raw.strip():
                try:
                    return str(json.loads(raw)["url"])
                except (ValueError, KeyError, TypeError):
                    break
    return "/v1/chat/completions"


def _summary(b: dict[str, Any]) -> str:
    c = b.get("request_counts") or {}
    parts = [
        f"{b['id']}  {b['status']}",
        f"{c.get('completed', 0)} completed, {c.get('failed', 0)} failed of {c.get('total', 0)}",
    ]
    if b.get("output_file_id"):
        parts.append(f"output {b['output_file_id']}")
    if b.get("error_file_id"):
        parts.append(f"errors {b['error_file_id']}")
    for e in (b.get("errors") or {}).get("data", []):
        parts.append(f"error: {e['message']}")
    return "\n  ".join(parts)


def wait(client: httpx.Client, batch_id: str, poll_s: float, show: bool = True) -> dict[str, Any]:
    """Follow a batch to its end with a progress bar (items done, rate, ETA); returns the final batch."""
    bar = tqdm(total=0, unit="req", desc=batch_id[:18], disable=not show, dynamic_ncols=True)
    try:
        while True:
            b = _check(client.get(f"/batches/{batch_id}"))
            c = b.get("request_counts") or {}
            total, done = c.get("total", 0), c.get("completed", 0) + c.get("failed", 0)
            if total and bar.total != total:
                bar.total = total
                bar.refresh()
            bar.update(done - bar.n)
            bar.set_postfix_str(f"{b['status']}, {c.get('failed', 0)} failed", refresh=True)
            if b["status"] in FINAL:
                return dict(b)
            time.sleep(poll_s)  # poll period of a command-line client
    finally:
        bar.close()


def submit(args: argparse.Namespace) -> int:
    """Upload FILE, create the batch, and with --wait follow it and download its results."""
    path = Path(args.file)
    if not path.is_file():
        raise CliError(f"no such file: {path}")
    metadata = dict(kv.split("=", 1) for kv in args.metadata) if args.metadata else None
    with _client(args) as client:
        with path.open("rb") as fh:
            f = _check(client.post("/files", files={"file": (path.name, fh)}, data={"purpose": "batch"}))
        body = {
            "input_file_id": f["id"],
            "endpoint": args.endpoint or _endpoint_of(path),
            "completion_window": args.window,
        }
        if metadata:
            body["metadata"] = metadata  # type: ignore[assignment]
        b = _check(client.post("/batches", json=body))
        print(b["id"])
        if not args.wait:
            return 0
        b = wait(client, b["id"], args.poll_s)
        print(_summary(b), file=sys.stderr)
        if args.output and b.get("output_file_id"):
            _download(client, b["output_file_id"], Path(args.output))
        return 0 if b["status"] == "completed" else 1


def _download(client: httpx.Client, file_id: str, out: Path) -> int:
    with client.stream("GET", f"/files/{file_id}/content") as r:
        if r.status_code >= 400:
            r.read()
            _check(r)
        size = 0
        with out.open("wb") as fh:
            for part in r.iter_bytes():
                fh.write(part)
                size += len(part)
    print(f"wrote {out} ({size} bytes)", file=sys.stderr)
    return size


def status(args: argparse.Namespace) -> int:
    """Print a batch (summary, or the whole object with --json)."""
    with _client(args) as client:
        b = _check(client.get(f"/batches/{args.id}"))
    print(json.dumps(b, indent=2) if args.json else _summary(b))
    return 0


def results(args: argparse.Namespace) -> int:
    """Download a finished batch's output file (and its error file with --errors)."""
    with _client(args) as client:
        b = _check(client.get(f"/batches/{args.id}"))
        if b["status"] not in FINAL:
            raise CliError(
                f"batch {args.id} is {b['status']}; results exist once it ends (try --wait on submit)"
            )
        if b.get("output_file_id"):
            _download(client, b["output_file_id"], Path(args.output))
        else:
            Path(args.output).write_bytes(b"")
            print(f"batch {args.id} has no successful results; wrote an empty {args.output}", file=sys.stderr)
        if b.get("error_file_id"):
            if args.errors:
                _download(client, b["error_file_id"], Path(args.errors))
            else:
                failed = (b.get("request_counts") or {}).get("failed", 0)
                print(f"{failed} request(s) failed: get them with --errors FILE", file=sys.stderr)
    return 0


def cancel(args: argparse.Namespace) -> int:
    """Cancel a batch: queued items are skipped, running ones aborted."""
    with _client(args) as client:
        b = _check(client.post(f"/batches/{args.id}/cancel"))
    print(_summary(b))
    return 0


def list_batches(args: argparse.Namespace) -> int:
    """The newest batches, one line each."""
    with _client(args) as client:
        page = _check(client.get("/batches", params={"limit": args.limit}))
    for b in page["data"]:
        c = b.get("request_counts") or {}
        print(
            f"{b['id']}  {b['status']:<11} {c.get('completed', 0) + c.get('failed', 0)}/{c.get('total', 0)}"
        )
    return 0


def parser() -> argparse.ArgumentParser:
    """Flags of every `ferry batch` command."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--url", default=os.environ.get("FERRY_URL", "http://127.0.0.1:8000"),
                        help="the frontend (default: %(default)s; env FERRY_URL)")  # fmt: skip
    # The help names the variable, never its value: --help must not print a key.
    common.add_argument("--api-key", default=os.environ.get("FERRY_API_KEY", ""),
                        help="API key when the frontend requires one (default: none; env FERRY_API_KEY)")  # fmt: skip
    common.add_argument(
        "--timeout", type=float, default=60.0, help="seconds per HTTP request (default: %(default)s)"
    )
    p = argparse.ArgumentParser(prog="ferry batch", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("submit", parents=[common], help="upload a JSONL file and start a batch")
    s.add_argument("file")
    s.add_argument("--endpoint", choices=["/v1/chat/completions", "/v1/completions"],
                   help="default: the url of the file's first line")  # fmt: skip
    s.add_argument(
        "--window", default="24h", help="completion window, one the frontend allows (default: %(default)s)"
    )
    s.add_argument("--metadata", action="append", metavar="KEY=VALUE")
    s.add_argument("--wait", action="store_true", help="follow the batch to its end with a progress bar")
    s.add_argument("-o", "--output", help="with --wait: write the output file here")
    s.add_argument(
        "--poll-s", type=float, default=0.5, help="with --wait: seconds between polls (default: %(default)s)"
    )
    s.set_defaults(fn=submit)
    st = sub.add_parser("status", parents=[common], help="show a batch")
    st.add_argument("id")
    st.add_argument("--json", action="store_true", help="the whole batch object")
    st.set_defaults(fn=status)
    r = sub.add_parser("results", parents=[common], help="download a finished batch's results")
    r.add_argument("id")
    r.add_argument("-o", "--output", required=True)
    r.add_argument("--errors", help="also write the error file here")
    r.set_defaults(fn=results)
    c = sub.add_parser("cancel", parents=[common], help="cancel a batch")
    c.add_argument("id")
    c.set_defaults(fn=cancel)
    ls = sub.add_parser("list", parents=[common], help="the newest batches")
    ls.add_argument("--limit", type=int, default=20, help="how many (default: %(default)s)")
    ls.set_defaults(fn=list_batches)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run one `ferry batch` command."""
    args = parser().parse_args(argv)
    try:
        return int(args.fn(args))
    except CliError as exc:
        print(f"ferry batch: {exc}", file=sys.stderr)
        return 1
    except httpx.HTTPError as exc:
        print(f"ferry batch: cannot reach {args.url}: {exc}", file=sys.stderr)
        return 1
