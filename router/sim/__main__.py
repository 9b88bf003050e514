"""``python -m router.sim``: the same as ``kvroute sim``."""

import sys

from router.cli.sim import main

sys.exit(main(sys.argv[1:]))
