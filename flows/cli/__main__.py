"""``python -m flows.cli`` is ``embedpipe``."""

import sys

from flows.cli import main

sys.exit(main())
