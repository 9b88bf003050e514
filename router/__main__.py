"""``python -m router`` runs the ``kvroute`` command line."""

import sys

from router.cli.main import main

sys.exit(main())
