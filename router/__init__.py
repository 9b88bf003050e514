"""kvroute router: the global prefix index, cache-aware routing and the HTTP front."""

from router.errors import RouterError

__all__ = ["RouterError"]
