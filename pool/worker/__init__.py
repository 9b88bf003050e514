"""The worker process: engine loop, scheduler, model, paged KV cache, HTTP API and CLI."""
