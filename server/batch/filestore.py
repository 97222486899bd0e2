"""Where file contents live: a small interface and its local-directory implementation."""

from __future__ import annotations

import asyncio
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Protocol

_SAFE_ID = re.compile(r"^[A-Za-z0-9_-]{1,128}$")


class FileStore(Protocol):
    """Stores whole files by id; metadata lives in Redis (kvstore/batch_store.py)."""

    async def write(self, file_id: str, parts: Iterable[bytes]) -> int:
        """Store (or replace) a file atomically; returns its size in bytes."""
        ...

    async def read(self, file_id: str) -> bytes:
        """The whole content; FileNotFoundError if there is none."""
        ...

    async def delete(self, file_id: str) -> None:
        """Remove a file; no error if it is already gone."""
        ...


class LocalFileStore:
    """Files as `<root>/<id>` on a local disk, written through a temporary file and a rename."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def _path(self, file_id: str) -> Path:
        # Ids are ours, but a path must never leave the root whatever a caller passes.
        if not _SAFE_ID.match(file_id):
            raise FileNotFoundError(file_id)
        return self.root / file_id

    def _write(self, file_id: str, parts: Iterable[bytes]) -> int:
        self.root.mkdir(parents=True, exist_ok=True)
        final = self._path(file_id)
        tmp = final.with_name(f".{file_id}.{os.getpid()}.tmp")
        size = 0
        with open(tmp, "wb") as fh:
            for part in parts:
                fh.write(part)
                size += len(part)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, final)
        return size

    async def write(self, file_id: str, parts: Iterable[bytes]) -> int:
        """Store (or replace) a file atomically; returns its size in bytes."""
        return await asyncio.to_thread(self._write, file_id, list(parts))

    async def read(self, file_id: str) -> bytes:
        """The whole content; FileNotFoundError if there is none."""
        return await asyncio.to_thread(self._path(file_id).read_bytes)

    async def delete(self, file_id: str) -> None:
        """Remove a file; no error if it is already gone."""
        try:
            await asyncio.to_thread(self._path(file_id).unlink)
        except FileNotFoundError:
            pass
