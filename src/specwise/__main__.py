"""`python -m specwise …`: the same command line as the `specwise` script."""

import sys

from specwise.cli import main

sys.exit(main())
