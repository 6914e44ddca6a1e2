"""The per-step token budget sized to a target step time (`EngineConfig.max_step_ms`).

A step's time is about a + b * tokens (a: what the step costs whatever its size, the running batch's
decodes and a chunked prompt's context; b: a token's cost on this device). After each step with
enough tokens to tell, the budget becomes tokens * target / time, the fixed-point iteration of that
line: it settles where a + b * budget is the target, whatever a and b are, within a few steps, and
follows them as contexts grow. It moves by at most 2x a step, up or down, so one outlier step cannot
swing it, grows only from steps that used it, and stays within [MIN_TOKENS, max_num_batched_tokens]:
a fast device keeps the configured budget (its throughput is unchanged), a slow one chunks long
prompts finely enough that the other requests' tokens keep coming.

Where a alone reaches the target (a long prompt's late chunks on a slow device, whose every step
reads its whole context), no budget meets it, and chunking finer only multiplies the prompt's time:
at 16 tokens a step an 8,000-token prompt took 4.5x as long as unchunked on one CPU core. So the
budget never shrinks below a / b, the tokens that cost as much as the rest of the step: such a step
takes about 2a, half of it useful work. b is measured from two steps in a row of different sizes
(the slope between them: their contexts differ little), a from each step as its time less b * tokens.
A budget that drifts down a few percent a step never makes such a pair, so after PROBE_AFTER steps
over the target without one, the next step probes at twice the budget (one step of up to ~1.5x its
time) and the one after returns.
"""

from __future__ import annotations

from dataclasses import dataclass

MIN_TOKENS = 16  # the budget's floor: a prompt always advances
FIRST_TOKENS = 256  # before any step was timed: small enough for a slow CPU, a few steps from 4096 on a GPU
MIN_SPREAD = 0.2  # two steps tell a token's cost when their sizes differ by this fraction of the larger
PROBE_AFTER = 16  # steps over the target without a measure of b before a step probes at twice the budget


@dataclass(slots=True)
class StepBudget:
    target_s: float  # the step time aimed at
    max_tokens: int  # the configured max_num_batched_tokens: never exceeded
    tokens: int = 0  # the budget now
    token_s: float | None = None  # b: what a token adds to a step; None until two steps told it
    fixed_s: float = 0.0  # a: the last step's time less its tokens' share (b * tokens)
    last: tuple[int, float] | None = None  # the last step observed: (tokens, seconds)
    num_unfitted: int = 0  # steps over the target since b was last measured

    def __post_init__(self) -> None:
        self.tokens = max(min(FIRST_TOKENS, self.max_tokens), min(MIN_TOKENS, self.max_tokens))

    def observe(self, num_tokens: int, elapsed_s: float) -> int:
        """After a step that computed `num_tokens` in `elapsed_s`: the next step's budget. A step over the
        target shrinks it, to no less than `floor()`; one under the target grows it only if it used at
        least half of it (a step short of work, decodes alone, says little of what more tokens would cost)."""
        if num_tokens < MIN_TOKENS or elapsed_s <= 0:
            return self.tokens
        self._fit(num_tokens, elapsed_s)
        wanted = num_tokens * self.target_s / elapsed_s
        if elapsed_s > self.target_s and self.num_unfitted >= PROBE_AFTER:
            wanted, self.num_unfitted = self.tokens * 2, 0
        elif elapsed_s > self.target_s:
            self.num_unfitted += 1
            wanted = max(wanted, self.tokens / 2, min(self.floor(), self.tokens * 2))
        elif num_tokens * 2 >= self.tokens:
            wanted = min(max(wanted, self.tokens), self.tokens * 2)
        else:
            return self.tokens
        self.tokens = int(min(max(wanted, MIN_TOKENS), self.max_tokens))
        return self.tokens

    def floor(self) -> float:
        """The fewest tokens worth a step: a / b, those that cost what the rest of the step costs."""
        if self.token_s is None:
            return MIN_TOKENS
        return max(self.fixed_s / self.token_s, MIN_TOKENS)

    def _fit(self, num_tokens: int, elapsed_s: float) -> None:
        if self.last is not None:
            last_tokens, last_s = self.last
            if abs(num_tokens - last_tokens) >= MIN_SPREAD * max(num_tokens, last_tokens):
                slope = (elapsed_s - last_s) / (num_tokens - last_tokens)
                if slope > 0:  # else noise outweighed the difference: no news
                    self.token_s = slope if self.token_s is None else (self.token_s + slope) / 2
                    self.num_unfitted = 0
        self.last = (num_tokens, elapsed_s)
        if self.token_s is not None:
            self.fixed_s = max(elapsed_s - self.token_s * num_tokens, 0.0)
