"""Ferry's contracts: every message that crosses a process, and every topic and key name."""
