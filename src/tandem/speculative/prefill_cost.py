"""What one more prompt token adds to the draft's prefill: the slope of a line through its timed calls.

Adaptive admission (speculative/policy/ `prefill_share_ms`) charges a new request its draft's prefill,
per prompt token. A prefill call costs a fixed part (launching its kernels: on an H200 the demo pair's
one-layer draft is host-bound, about as long for 128 tokens as for 1,024) and a part per token. Charged at
the mean time per token, a batch of 32 would be charged the fixed part of batch-1 calls 32 times over, a
share larger than the step it is weighed against. The fixed part is paid per call, and calls batch many prompts:
only the slope (what one more token adds) belongs to one request. Where the calls seen so far are too alike
in size to tell the two apart, the mean time per token stands in (an upper bound on the slope).

On a GPU, calls of two sizes timed at start-up (`observe_startup`) give the fixed part; each online call
then tells the per-token part by itself, whatever its size. Without it, an engine that had seen calls of one
size only (single requests) charged a burst of 32 at the mean rate, admitted it dormant, and with no draft
prefill left to time never learned otherwise (the demo pair on an H200: 1.03 ms a step charged against a
0.64 ms step; bench/results/admission-trace-demo-h200-4af6683.json).
"""

from __future__ import annotations

# Weight of each new call in the moving averages the line is fitted to.
DECAY = 0.2
# Sizes must spread by this much (standard deviation over mean tokens) before the slope is trusted.
MIN_SPREAD = 0.1


class PrefillCost:
    def __init__(self):
        self._calls = 0
        self._mean_t = self._mean_ms = self._mean_tt = self._mean_tms = 0.0
        self.fixed_ms: float | None = None  # a call's fixed part, from start-up timing
        self._per_token: float | None = None  # with fixed_ms: a moving average of (ms - fixed) / tokens

    def observe_startup(self, calls: list[tuple[int, float]]) -> None:
        """(tokens, ms) of calls of at least two sizes: the line through the smallest and the largest gives
        the fixed part of a call, kept from then on, and a first per-token part."""
        (t0, ms0), (t1, ms1) = min(calls), max(calls)
        if t1 <= t0:
            return
        slope = max(0.0, (ms1 - ms0) / (t1 - t0))
        self.fixed_ms = max(0.0, ms0 - slope * t0)
        self._per_token = slope

    def observe(self, tokens: int, ms: float) -> None:
        """One call: `ms` for `tokens` prompt tokens. The first is often a warm-up (first-call allocation,
        kernel selection): the second replaces it."""
        if tokens <= 0:
            return
        self._calls += 1
        w = 1.0 if self._calls <= 2 else DECAY
        t = float(tokens)
        self._mean_t += w * (t - self._mean_t)
        self._mean_ms += w * (ms - self._mean_ms)
        self._mean_tt += w * (t * t - self._mean_tt)
        self._mean_tms += w * (t * ms - self._mean_tms)
        if self.fixed_ms is not None:
            rate = max(0.0, ms - self.fixed_ms) / t
            self._per_token += DECAY * (rate - self._per_token)

    def ms_per_token(self) -> float | None:
        """The slope: with a start-up timing, the per-token part beyond its fixed part; else within [0, mean ms
        per token] of the calls seen; None before any call."""
        if self._per_token is not None:
            return self._per_token
        if not self._calls:
            return None
        mean_rate = self._mean_ms / self._mean_t
        var_t = self._mean_tt - self._mean_t ** 2
        if var_t <= (MIN_SPREAD * self._mean_t) ** 2:
            return mean_rate
        slope = (self._mean_tms - self._mean_t * self._mean_ms) / var_t
        return min(max(slope, 0.0), mean_rate)
