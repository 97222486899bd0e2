"""Chaos benchmark: requests under worker kills and broker/Redis restarts (see __main__.py)."""
