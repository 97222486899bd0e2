"""What `--model` names, made a model directory before a process loads it: a GGUF file is converted once.

`ferry worker`, `ferry frontend` and `ferry up` call `resolve_model` before anything starts. A model directory
is used as it is. A GGUF file is converted by `ferry model prepare`'s code into
$FERRY_HOME/models/<file name without .gguf> on first use and that directory is reused after; the build holds
a lock and renames a finished directory into place, so processes started side by side convert it once.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import TypeVar

from launch.model_prepare import (
    ModelPrepareError,
    check_gguf,
    gguf_model_dir,
    gguf_source,
    is_complete,
    prepare_model,
)
from schemas.settings import CommonSettings

log = logging.getLogger("ferry.model")

S = TypeVar("S", bound=CommonSettings)


def resolve_model(settings: S) -> S:
    """`settings` with a GGUF `--model` replaced by the directory it is converted into (converting it if no
    complete one exists); the served name was already derived from the file. Raises ModelPrepareError naming
    the path for a file that is not a GGUF file, or a `.gguf` path with nothing there."""
    path = Path(settings.model_path).expanduser()
    if path.is_dir():
        return settings
    if path.suffix.lower() != ".gguf":
        if path.exists():
            raise ModelPrepareError(f"--model {path}: not a model directory or a .gguf file")
        return settings  # a directory still to be made: the loaders say so, naming `ferry model prepare`
    check_gguf(path)
    out = gguf_model_dir(path)
    if is_complete(out, gguf_source(path)):
        log.info("--model %s: serving %s, converted from it earlier", path, out)
    else:
        log.info(
            "--model %s is a GGUF file: converting it into the model directory %s, once (later starts reuse "
            "it); about a minute for a 100 MB file on two CPU cores",
            path,
            out,
        )
        prepare_model(out, gguf=path)
    return dataclasses.replace(settings, model_path=str(out))
