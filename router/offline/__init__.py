"""Debugging from event logs: rebuild the index at a moment (replay) and explain a decision."""
