"""Reasoning parsers (`infer serve --reasoning-parser NAME`): a chat's reasoning split from its answer."""
