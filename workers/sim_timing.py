"""Step timing of the simulated engine: NVIDIA Dynamo's published mocker model.

Kept identical to Dynamo's so routing benchmarks against its mocker compare on equal terms.
"""

from __future__ import annotations


def prefill_ms(new_tokens: int) -> float:
    """Milliseconds to prefill `new_tokens` prompt tokens in one step (0 when there are none)."""
    if new_tokens <= 0:
        return 0.0
    t = float(new_tokens)
    return 4.209989e-7 * t * t + 1.518344e-2 * t + 16.50142


def decode_ms(kv_fraction: float) -> float:
    """Milliseconds for one decode step when the decoding sequences fill `kv_fraction` of the KV cache."""
    p = kv_fraction
    return max(1.0, -25.74 * p * p + 54.01 * p + 5.74)


def step_seconds(
    prefill_tokens: int,
    decode_context_tokens: int,
    decoding_seqs: int,
    kv_capacity_tokens: int,
    speedup: float = 1.0,
) -> float:
    """Wall time of one engine step: (prefill + decode) / speedup, in seconds."""
    total = prefill_ms(prefill_tokens)
    if decoding_seqs > 0:
        total += decode_ms(decode_context_tokens / kv_capacity_tokens)
    return total / speedup / 1000.0
