"""`python -m launch ...` is the `ferry` command."""

import sys

from launch.cli import main

# The guard keeps a spawned child (vLLM starts some) from running the command again on import.
if __name__ == "__main__":
    sys.exit(main())
