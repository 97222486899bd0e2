"""A tiny LoRA adapter for the default model, made with peft, that really changes its answers.

peft initialises B to zero (an adapter that changes nothing until trained); here both A and B are
drawn at random with a fixed seed, large enough that greedy decoding takes another path.
"""

from __future__ import annotations

from pathlib import Path

RANK = 8


def make_adapter(model_path: Path, out: Path, seed: int = 0, scale: float = 0.05) -> Path:
    """Write a rank-8 LoRA adapter on q_proj and v_proj of the model in `model_path` to `out`."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    config = LoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    model = get_peft_model(base, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * scale)
    model.save_pretrained(str(out))
    return out
