"""``python -m attnlib.course``: list, release and grade the book's assignments."""

import sys

from . import main

sys.exit(main())
