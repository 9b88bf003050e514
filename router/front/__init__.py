"""The router's HTTP front: the service behind it, its config, the proxy, chat, metrics."""
