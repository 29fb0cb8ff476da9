"""Entry point of ``python -m mtad.bench``."""

import sys

from mtad.bench.cli import main

sys.exit(main())
