"""`python -m dflashops ...` is the `dflashops` console script."""

import sys

from dflashops.cli.main import main

sys.exit(main())
