"""The worker process: inbox consumer, engines, KV-event bridge, heartbeat and drain."""
