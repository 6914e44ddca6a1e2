"""Logits processors: `xgrammar` (structured output) and `basic` (logit bias, bad words, min tokens, allowed tokens)."""
