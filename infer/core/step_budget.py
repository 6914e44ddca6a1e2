"""The per-step token budget sized to a target step time (`EngineConfig.max_step_ms`).

A step's time is about a + b * tokens (a: the fixed cost of the running batch, b: a token's cost on
this device). After each step with enough tokens to tell, the budget becomes tokens * target / time,
the fixed-point iteration of that line: it settles where a + b * budget is the target, whatever a
and b are, within a few steps, and follows them as contexts grow. It moves by at most 2x a step, up
or down, so one outlier step cannot swing it, and grows only from steps that used it, and stays within [MIN_TOKENS, max_num_batched_tokens]:
a fast device keeps the configured budget (its throughput is unchanged), a slow one chunks long
prompts finely enough that the other requests' tokens keep coming.
"""

from __future__ import annotations

from dataclasses import dataclass

MIN_TOKENS = 16  # the budget's floor: a prompt always advances
FIRST_TOKENS = 256  # before any step was timed: small enough for a slow CPU, a few steps from 4096 on a GPU


@dataclass(slots=True)
class StepBudget:
    target_s: float  # the step time aimed at
    max_tokens: int  # the configured max_num_batched_tokens: never exceeded
    tokens: int = 0  # the budget now

    def __post_init__(self) -> None:
        self.tokens = max(min(FIRST_TOKENS, self.max_tokens), min(MIN_TOKENS, self.max_tokens))

    def observe(self, num_tokens: int, elapsed_s: float) -> int:
        """After a step that computed `num_tokens` in `elapsed_s`: the next step's budget. A step over the
        target shrinks it; one under the target grows it only if it used at least half of it (a step
        short of work, decodes alone, says little of what more tokens would cost)."""
        if num_tokens < MIN_TOKENS or elapsed_s <= 0:
            return self.tokens
        wanted = num_tokens * self.target_s / elapsed_s
        if elapsed_s > self.target_s:
            wanted = max(wanted, self.tokens / 2)
        elif num_tokens * 2 >= self.tokens:
            wanted = min(max(wanted, self.tokens), self.tokens * 2)
        else:
            return self.tokens
        self.tokens = int(min(max(wanted, MIN_TOKENS), self.max_tokens))
        return self.tokens
