"""Leaf utilities every layer may use, importing nothing else of infer: `env` (every environment
variable infer reads) and `log` (structlog's set-up)."""
