"""Redis plumbing, no domain logic.

Connections, the key layout, Lua scripts, RESP packing and an embedded redis-server.
"""
