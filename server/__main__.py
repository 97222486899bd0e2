"""`python -m server ...` is the `ferry` command."""

import sys

from server.cli import main

sys.exit(main())
