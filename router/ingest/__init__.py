"""Events to index: each worker's KV event stream folded into the prefix index.

Per-worker ingest, the recovery rules, the engine-hash bridge (and the bridged index that
puts each worker's bridge in front of any index store), lease handoffs, ingest metrics.
"""
