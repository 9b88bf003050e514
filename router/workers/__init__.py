"""Worker membership and liveness.

Registrations, leases and epochs, ownership, lifetime ids, load reports, snapshots.
"""
