"""Poolers (`infer.api.pooling`): an embedding request's prompt hidden states turned into one vector."""
