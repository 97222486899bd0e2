"""Ferry with one vLLM worker against vLLM's own OpenAI server, same model and engine settings."""
