"""``python -m attnlib.experiments NAME --out FILE [--workers N]``: run one of the book's sweeps."""

import sys

from . import main

sys.exit(main())
