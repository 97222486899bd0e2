"""`--model` names a model directory, used as it is, or a GGUF file, converted once into one."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from launch import model_prepare
from launch.frontend import main as frontend_main
from launch.model_prepare import REQUIRED_FILES, ModelPrepareError, gguf_source, is_complete
from launch.model_source import resolve_model
from launch.stack import load_stack, resolve_stack_model
from launch.worker import main as worker_main
from schemas.settings import DEFAULT_MODEL_NAME, FrontendSettings, WorkerSettings


def _fake_convert(calls: list[Path], entered: threading.Event | None = None,
                  release: threading.Event | None = None) -> Callable[[Path, Path, bool], dict[str, str]]:  # fmt: skip
    # Placeholder files instead of the real 40-second conversion (tests/unit/test_model_prepare.py says why).
    def convert(gguf: Path, work: Path, progress: bool) -> dict[str, str]:
        calls.append(work)
        if entered is not None and release is not None:
            entered.set()
            assert release.wait(10), "the second process never waited for the lock"
        for name in REQUIRED_FILES:
            (work / name).write_text("{}", encoding="utf-8")
        return {"transformers": "fake", "torch": "fake"}

    return convert


@pytest.fixture
def home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """A fresh $FERRY_HOME."""
    monkeypatch.setenv("FERRY_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("FERRY_SERVED_MODEL_NAME", raising=False)
    return tmp_path / "home"


@pytest.fixture
def gguf(tmp_path: Path) -> Path:
    """A file that starts as a GGUF file does."""
    path = tmp_path / "Tiny-1B.Q8_0.gguf"
    path.write_bytes(b"GGUF\x03\x00\x00\x00")
    return path


def test_a_model_directory_is_used_as_it_is(home: Path, tmp_path: Path) -> None:
    settings = WorkerSettings(model_path=str(tmp_path))
    assert resolve_model(settings) is settings
    assert settings.served_model_name == DEFAULT_MODEL_NAME
    missing = WorkerSettings(model_path=str(tmp_path / "not-prepared-yet"))
    assert resolve_model(missing) is missing  # the engine's loader names `ferry model prepare`


def test_a_gguf_file_is_converted_once(monkeypatch: pytest.MonkeyPatch, home: Path, gguf: Path) -> None:
    calls: list[Path] = []
    monkeypatch.setattr(model_prepare, "_convert", _fake_convert(calls))
    out = home / "models" / "Tiny-1B.Q8_0"

    worker = resolve_model(WorkerSettings(model_path=str(gguf)))
    assert (worker.model_path, worker.served_model_name) == (str(out), "Tiny-1B.Q8_0")
    assert is_complete(out, gguf_source(gguf)) and len(calls) == 1
    frontend = resolve_model(FrontendSettings(model_path=str(gguf)))
    assert (frontend.model_path, frontend.served_model_name) == (str(out), "Tiny-1B.Q8_0")
    assert len(calls) == 1  # the second process reuses the directory
    named = resolve_model(WorkerSettings(model_path=str(gguf), served_model_name="tiny"))
    assert (named.model_path, named.served_model_name) == (str(out), "tiny")


def test_two_processes_starting_together_convert_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, home: Path, gguf: Path
) -> None:
    calls: list[Path] = []
    entered, release = threading.Event(), threading.Event()
    monkeypatch.setattr(model_prepare, "_convert", _fake_convert(calls, entered, release))

    class ReleaseWhenWaiting(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.getMessage().startswith("waiting for another process"):
                release.set()

    handler = ReleaseWhenWaiting()
    logging.getLogger(model_prepare.__name__).addHandler(handler)
    caplog.set_level(logging.INFO, logger=model_prepare.__name__)
    results: list[str] = []
    try:
        first = threading.Thread(
            target=lambda: results.append(resolve_model(WorkerSettings(model_path=str(gguf))).model_path)
        )
        first.start()
        assert entered.wait(30)
        # The first is converting (it holds the lock); the second waits for it, then finds the directory.
        results.append(resolve_model(FrontendSettings(model_path=str(gguf))).model_path)
        first.join(30)
    finally:
        release.set()
        logging.getLogger(model_prepare.__name__).removeHandler(handler)
    assert len(calls) == 1 and results == [str(home / "models" / "Tiny-1B.Q8_0")] * 2


@pytest.mark.parametrize(
    ("name", "content", "error"),
    [
        ("missing.gguf", None, "no GGUF file at {path}"),
        ("fake.gguf", b"<html>not found</html>", "{path} is not a GGUF file"),
        ("model.safetensors", b"\x00" * 8, "--model {path}: not a model directory or a .gguf file"),
    ],
)
def test_a_path_that_is_no_model_is_refused_naming_it(
    home: Path, tmp_path: Path, name: str, content: bytes | None, error: str
) -> None:
    path = tmp_path / name
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(ModelPrepareError) as caught:
        resolve_model(WorkerSettings(model_path=str(path)))
    assert str(caught.value).startswith(error.format(path=path))
    assert not (home / "models").exists()


def test_each_command_stops_with_one_line(
    home: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "missing.gguf"
    assert worker_main(["--model", str(missing)]) == 2
    assert capsys.readouterr().err == f"ferry worker: error: no GGUF file at {missing}\n"
    with pytest.raises(SystemExit, match=f"^ferry frontend: no GGUF file at {missing}$"):
        frontend_main(["--model", str(missing)])
    with pytest.raises(SystemExit, match=f"^ferry up: no GGUF file at {missing}$"):
        resolve_stack_model(load_stack(["--model", str(missing)]))


def test_ferry_up_converts_before_its_children_and_passes_them_the_directory(
    monkeypatch: pytest.MonkeyPatch, home: Path, gguf: Path
) -> None:
    calls: list[Path] = []
    monkeypatch.setattr(model_prepare, "_convert", _fake_convert(calls))
    stack = resolve_stack_model(load_stack(["--model", str(gguf), "--speedup", "20"]))
    out = str(home / "models" / "Tiny-1B.Q8_0")
    assert len(calls) == 1
    for flags in (stack.worker_flags, stack.frontend_flags):
        assert flags[flags.index("--model-path") + 1] == out
        assert flags[flags.index("--served-model-name") + 1] == "Tiny-1B.Q8_0"
        assert str(gguf) not in flags
    assert stack.worker_flags[stack.worker_flags.index("--speedup") + 1] == "20.0"
    assert (stack.frontend.served_model_name, stack.worker.served_model_name) == ("Tiny-1B.Q8_0",) * 2
    plain = load_stack(["--speedup", "20"])
    assert resolve_stack_model(plain) is plain
