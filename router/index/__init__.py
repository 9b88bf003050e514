"""The global prefix index: the ``PrefixIndex`` seam, its stores, batched writes and lookups."""
