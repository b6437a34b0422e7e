"""The OpenAI-compatible HTTP server (``python -m dsv41.serve``): ``app.py`` the endpoints,
``schema.py`` request validation and response bodies, ``batcher.py`` the one engine loop thread that
does continuous batching over the engine protocol, ``metrics.py`` the Prometheus metrics."""
