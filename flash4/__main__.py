"""Entry point of ``python -m flash4``; the commands live in :mod:`flash4.cli`."""

import sys

from flash4.cli import main

sys.exit(main())
