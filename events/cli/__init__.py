"""The command-line tools of the ``events`` package: ``events dump|tail``, ``record``, ``keys``."""
