"""What a worker reads from a prepared model directory."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer


@dataclass(frozen=True)
class ModelInfo:
    """Tokenizer and the few config values an engine needs."""

    path: Path
    tokenizer: Tokenizer
    eos_token_id: int | None
    max_position_embeddings: int


def load_model_info(path: str | Path) -> ModelInfo:
    """Load tokenizer.json and config.json from `path`."""
    root = Path(path)
    if not (root / "tokenizer.json").is_file():
        raise FileNotFoundError(f"{root} has no tokenizer.json; run `ferry model prepare` first")
    config = json.loads((root / "config.json").read_text())
    eos = config.get("eos_token_id")
    gen = root / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id", eos)
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    return ModelInfo(
        path=root,
        tokenizer=Tokenizer.from_file(str(root / "tokenizer.json")),
        eos_token_id=eos,
        max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
    )
