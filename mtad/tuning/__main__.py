"""Entry point of ``python -m mtad.tuning``."""

import sys

from mtad.tuning.cli import main

sys.exit(main())
