"""``python -m router`` runs the ``kvroute`` command line."""

import sys

from router.cli import main

sys.exit(main())
