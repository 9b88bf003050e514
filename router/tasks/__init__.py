"""Asyncio building blocks shared by the router's folders."""
