"""Helpers shared by the test modules; no tests live here.

Test modules import from here (``from tests.support.ingest import FakeWorker``), never
from one another; fixtures stay in the ``conftest.py`` files.
"""
