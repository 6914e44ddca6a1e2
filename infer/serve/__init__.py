"""Serving on top of the engine: `AsyncEngine` (the engine stepped by its own thread, each request a
stream of per-step deltas), the OpenAI-compatible app (`app`, `protocol`) and its Prometheus metrics.
The app needs the `serve` extra (`pip install 'infer[serve]'`); the async engine does not."""
