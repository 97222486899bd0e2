"""Entry point of `python -m bench.soak`."""

import sys

from bench.soak.run import main

sys.exit(main())
