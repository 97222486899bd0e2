"""`python -m workers` runs one worker."""

import sys

from workers.main import main

sys.exit(main())
