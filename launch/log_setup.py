"""Logging of every Ferry process: one line format, and libraries that log each request kept to warnings."""

from __future__ import annotations

import logging

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

# httpx logs every request at INFO (a planner scrapes each frontend's /metrics every interval: a line every
# few seconds); aiokafka every connection and rebalance. At --log-level debug they speak again.
CHATTY = ("httpx", "httpcore", "aiokafka")


def setup_logging(level: str | int) -> None:
    """Log at `level` (a name such as "info", or a number) in Ferry's format, the chatty libraries at warning."""
    logging.basicConfig(level=level.upper() if isinstance(level, str) else level, format=FORMAT)
    if logging.getLogger().level > logging.DEBUG:
        for name in CHATTY:
            logging.getLogger(name).setLevel(logging.WARNING)
