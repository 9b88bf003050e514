"""Events to index: each worker's KV event stream folded into the prefix index.

Per-worker ingest, the recovery rules, the engine-hash bridge, lease handoffs, ingest metrics.
"""
