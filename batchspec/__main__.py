"""`python -m batchspec ...`: the same as the `batchspec` command."""

import sys

from .cli import main

sys.exit(main())
