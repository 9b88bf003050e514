"""The command-line tools of the ``events`` package (``events dump|tail``, ``record``, ``keys``)
and the flag helpers every kvroute command uses (:mod:`events.cli.flags`)."""
