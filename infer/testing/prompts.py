"""Prompts the SmolLM2 tests share: plain text, code, a story, facts and one chat-templated turn."""

SMOLLM2_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "Water boils at",
    "<|im_start|>user\nWhat is 12 times 7?<|im_end|>\n<|im_start|>assistant\n",
    "The quick brown fox",
    "In 1969, the first humans to walk on the Moon were",
]
