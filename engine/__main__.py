"""`python -m engine`: the same as `hicache-engine`."""

import sys

from engine.cli import main

sys.exit(main())
