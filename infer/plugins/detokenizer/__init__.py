"""Detokenizers: `sequential` (decodes on the engine's thread) and `parallel` (one batched decode
in a worker thread that overlaps the next forward pass); `streams` holds the state machine both run."""
