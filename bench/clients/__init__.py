"""vLLM's `vllm bench serve` and NVIDIA aiperf against Ferry and vLLM's own server (bench/clients/run.py)."""
