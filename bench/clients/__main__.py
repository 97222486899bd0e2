"""`python -m bench.clients`: see bench/clients/run.py."""

from __future__ import annotations

import sys

from bench.clients.run import main

if __name__ == "__main__":
    sys.exit(main())
