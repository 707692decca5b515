"""`python -m tecc` is the `tecc` command."""

import sys

from .cli import main

sys.exit(main())
