"""`python -m server` is the `serve` command."""

import sys

from server.cli import main

sys.exit(main())
