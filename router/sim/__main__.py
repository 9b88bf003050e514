"""``python -m router.sim``: the same as ``kvroute sim``."""

import sys

from router.sim.cli import main

sys.exit(main(sys.argv[1:]))
