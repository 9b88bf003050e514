"""Worker load: what each worker is busy with, as the router sees it.

The load model, load shared by router replicas through Redis, per-request accounting.
"""
