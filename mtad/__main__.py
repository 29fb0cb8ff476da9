"""Entry point of ``python -m mtad``."""

import sys

from mtad.cli import main

sys.exit(main())
