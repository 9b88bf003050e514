"""Where the repository is, for tests that run its commands or read its files."""

from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
"""The checkout's root: ``tests/support/`` is two levels below it."""
