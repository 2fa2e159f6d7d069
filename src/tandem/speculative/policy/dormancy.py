"""Dormant requests: admitted without draft state where drafting does not pay.

Keeping a draft's state costs even while nothing is drafted: its prefill, and a catch-up over deferred
tokens every CATCH_UP_WINDOW steps (0.7%, 1.3% and 2.3% of a depth-0 step at batch 32, 64 and 128, 8B
shape, H200). So once the engine is sure enough that drafting does not pay at the batch a new request joins
(even with a_1 at the upper end of its interval, `optimistic_acceptance`, or at the rates as estimated once
settled, and with its draft prefill to pay back, `prefill_share_ms`), the request is admitted dormant
(`admit`): no draft prefill, no catch-ups. Running requests drop their draft state once the same holds for
their batch (`demote`). A batch of dormant rows alone runs plain decoding's step
(SpecWorker._launch_dormant); in a step that drafts for others a dormant row counts as a row that accepts
nothing (its drafts come from no state, harmless to the output: the target's tokens decide). One request
in SENTINEL_EVERY or more (`sentinel_spacing`) keeps its draft, so acceptance stays measured, and new
requests draft again once it pays.
"""

from __future__ import annotations

import math
import sys

from tandem.speculative.policy.acceptance import REQUEST_EVIDENCE_Z, expected_by_depth, wilson_interval
from tandem.speculative.policy.costs import (GREEDY_MODE, OUTLIER_RATIO, REFRESH_EVERY, TRUSTED_OBSERVATIONS, _rows,
                                            cost_table)

# One request in this many, at least, keeps its draft while others are admitted dormant, so acceptance stays
# measured; a rarer sentinel only delays noticing a rise, and each costs its batch the drafts' upkeep. Read
# through the package at every admission (benchmarks and tests set it there).
SENTINEL_EVERY = 32
# And rarer where a sentinel costs more: while one runs its batch takes depth-0 steps instead of plain
# decoding's, so sentinels come as rarely as keeps that upkeep within this share of the time.
SENTINEL_BUDGET = 0.005
# Observations of position 1 a class needs before any of its requests is admitted dormant.
DORMANT_MIN_OBSERVATIONS = 8
# How sure the engine must be that drafting does not pay: position 1's rate (which gates every deeper one)
# counts at the upper end of its one-sided 95% Wilson interval, as a request's own evidence does.
DORMANT_CONFIDENCE_Z = REQUEST_EVIDENCE_Z
# From this many observations of position 1 the rates count as estimated (no confidence bound): near
# break-even the bound stays above it for hundreds of observations while the drafts' upkeep is paid for nothing.
DORMANT_SETTLED_OBSERVATIONS = 32
# Likewise (and without DORMANT_MIN_OBSERVATIONS) at a table whose choice has been depth 0 for this many steps
# in a row, probes aside: at depth 0 only probes observe, so the interval hardly narrows.
DORMANT_SETTLED_STEPS = 64
# A new request is also judged by how the last requests of its class fared, one vote each: the mean of the
# expected tokens by depth of the last DORMANT_POPULATION_REQUESTS finished ones (from their own rates), once
# DORMANT_POPULATION_MIN_REQUESTS have finished. At batch 1 the engine's moving average is the last request's
# alone, so one request the draft cannot follow would otherwise keep every later one dormant (on a CPU with
# the real pair: the five after it, with no sentinel due for SENTINEL_EVERY admissions). Drafting cannot pay
# only when neither says it does; a hard request that drafts anyway soon runs at depth 0 by its own rates.
DORMANT_POPULATION_REQUESTS = 8
DORMANT_POPULATION_MIN_REQUESTS = 3
# A dormant step is timed only by dormant steps, and none runs while its batch drafts: after this many steps
# of a table without one it counts at no more than its start-up timing, so a slow stretch cannot keep it dear.
DORMANT_STALE_STEPS = REFRESH_EVERY


def _column_means(rows) -> list[float]:
    """At each depth, the mean over the rows of their expected tokens there."""
    return [sum(col) / len(rows) for col in zip(*rows)]


def _sentinel_every() -> int:
    """SENTINEL_EVERY as the package holds it now (`tandem.speculative.policy.SENTINEL_EVERY`)."""
    return sys.modules[__package__].SENTINEL_EVERY


class Dormancy:
    """DepthPolicy's dormant admission and demotion, and the cost of a dormant step. State (set in
    DepthPolicy.__init__): dormancy, dormant, sentinels, dormant_cost_ms, _dormant_startup_ms,
    _dormant_timed_at, _dormant_timed, _draft_prefill, _admitted."""

    def admit(self, request_id: str, padded_batch: int, prompt_tokens: int = 0, max_new_tokens: int = 0,
              sampled: bool = False, finish_together: bool = False, mode: str = GREEDY_MODE) -> bool:
        """Called when a request's prompt starts (again, after a preemption): True if it is admitted
        dormant, without draft state, because at `padded_batch` (the running batch's padded size) drafting
        does not pay (`_drafting_cannot_pay`, at the acceptance of its sampling class: `sampled`,
        temperature > 0) once the draft's prefill of `prompt_tokens` is paid for out of what drafting saves
        over `max_new_tokens` (`prefill_share_ms`); one in `sentinel_spacing` keeps its draft all the
        same. `finish_together`: the request runs exactly max_new_tokens in a batch that nothing queued
        will refill, so the batch goes at its slowest row's pace (`slowest_row_expected`). `mode`: the sampling
        mode whose cost table judges it (the request's own: a batch of such requests steps in that mode)."""
        self.dormant.discard(request_id)
        self.sentinels.discard(request_id)
        self._leave_cohort(request_id)
        self._repeatable.clear()
        if sampled:
            self.sampled.add(request_id)
        else:
            self.sampled.discard(request_id)
        if finish_together and self.dormancy:
            # (every drafting admission: the first batch's rows are drafted before any judgment can be made)
            self._join_cohort(request_id, (sampled, padded_batch))
        table = cost_table(padded_batch, mode)
        if not self.dormancy or not self._evidence_enough(table, sampled):
            return False
        self._admitted += 1  # (since the last sentinel)
        if self._admitted >= self.sentinel_spacing(table):
            self._admitted = 0
            self.sentinels.add(request_id)
            return False
        upkeep = self.prefill_share_ms(padded_batch, prompt_tokens, max_new_tokens)
        slowest = self.slowest_row_expected(padded_batch, sampled) if finish_together else None
        if not self._drafting_cannot_pay(table, upkeep, sampled, slowest):
            return False
        self._leave_cohort(request_id)  # (a dormant row drafts nothing: its pace is plain decoding's)
        self.dormant.add(request_id)
        return True

    def sentinel_spacing(self, table) -> int:
        """Admissions per sentinel for a request joining a batch of this table's padded size: B x (depth 0's
        step + its catch-up share - a dormant step) / a dormant step / SENTINEL_BUDGET, at least SENTINEL_EVERY."""
        every = _sentinel_every()
        depth0 = self.cost_ms.get((table, self.options[0]))
        if depth0 is None:
            return every
        rows = _rows(table)
        dormant = self.dormant_step_ms(table, depth0)
        upkeep = depth0 + self.catch_up_per_step_ms.get(rows, 0.0) - dormant
        return max(every, math.ceil(rows * upkeep / max(dormant, 1e-6) / SENTINEL_BUDGET))

    def demote(self, request_ids, padded_batch: int, mode: str = GREEDY_MODE) -> list[str]:
        """The requests of a running batch that should drop their draft state now: every one but the
        sentinels, once drafting cannot pay at this batch (the test `admit` makes). Requests admitted while
        drafting still looked worth it would otherwise pay the draft's upkeep (catch-ups, and a batch of
        dormant rows alone runs plain decoding's cheaper step) for the rest of their run. Dropping is for
        good (a dormant request never gets its draft state back). Each sampling class is judged at its own
        acceptance, at the cost table of the batch's sampling mode `mode`."""
        if not self.dormancy:
            return []
        table = cost_table(padded_batch, mode)
        keeping = [rid for rid in request_ids if rid not in self.dormant and rid not in self.sentinels]
        dropped = []
        for sampled in (False, True):
            rows = [rid for rid in keeping if (rid in self.sampled) == sampled]
            if (rows and self._evidence_enough(table, sampled)
                    and self._drafting_cannot_pay(table, sampled=sampled, rows=rows)):
                dropped += rows
        if dropped:
            self.dormant.update(dropped)
            self._repeatable.clear()
        return dropped

    def _evidence_enough(self, table, sampled: bool) -> bool:
        """Whether dormancy may be judged for a sampling class at this batch: DORMANT_MIN_OBSERVATIONS of
        position 1, or DORMANT_SETTLED_STEPS depth-0 choices in a row there."""
        return (self.rates_by_class[sampled].seen[0] >= DORMANT_MIN_OBSERVATIONS
                or self._undrafted_steps.get((sampled, table), 0) >= DORMANT_SETTLED_STEPS)

    def _drafting_cannot_pay(self, table, upkeep_ms: float = 0.0, sampled: bool = False,
                             slowest: list[float] | None = None, rows=None) -> bool:
        """Whether no drafting option beats a dormant row's step at this batch even if position 1's rate
        were as high as its observations allow (`optimistic_acceptance`), or, once position 1 has been
        observed DORMANT_SETTLED_OBSERVATIONS times or the batch has chosen depth 0 for
        DORMANT_SETTLED_STEPS steps, at the rates as estimated. A dormant row's step costs
        what a batch of dormant rows costs (plain decoding's step, `dormant_step_ms`).
        `upkeep_ms`: what keeping the drafts costs per step besides (new requests' draft prefill): drafting
        must then save that much of a dormant step's time to pay. At the acceptance of a sampling class
        (`sampled`); each depth's expected tokens at no more than `slowest`'s where given (the slowest row's,
        SLOWEST_ROW_REQUESTS_KEPT). `table`: the cost table (padded batch and sampling mode, `cost_table`).
        `rows`: running requests to judge at their mean expected tokens, each at its own rates where it has
        observations enough (`_expected_of`, as the choice weighs it), else at the class's as above.
        Demotion judged at the class's rates alone kept a request drafting that its own steps showed could
        not pay: the demo pair at batch 1 on a modelled fast-host H200 (bench/policy_clock.py) drafted at
        0.88-0.91x plain decoding's speed where fixed depth ran 0.89x, because the class's rates come mostly
        from the late, repetitive part of each answer; judged by its own, it ran dormant at 0.93-0.99x."""
        if any((table, shape) not in self.cost_ms for shape in self.options):
            return False
        costs = self._floored_costs(table)
        cls = self.rates_by_class[sampled]
        settled = (cls.seen[0] >= DORMANT_SETTLED_OBSERVATIONS
                   or self._undrafted_steps.get((sampled, table), 0) >= DORMANT_SETTLED_STEPS)
        as_estimated = expected_by_depth(cls.effective())
        rates = cls.effective() if settled else self.optimistic_acceptance(sampled)
        expected = expected_by_depth(rates)
        population = self.population_expected(sampled)
        if population is not None:
            expected = [max(e, p) for e, p in zip(expected, population)]
        if rows:
            # (a row without evidence of its own counts at the class's, as judged above)
            per_row = [self._expected_of(rid) if self._has_own_rates(self._requests.get(rid)) else expected
                       for rid in rows]
            expected = _column_means(per_row)
        if slowest is not None:
            expected = [min(e, own) for e, own in zip(expected, slowest)]
        # The tree's accept length, scaled as much as optimism scales the deepest chain's.
        tree_tokens = cls.tree_tokens * expected[-1] / as_estimated[-1]
        dormant_step = self.dormant_step_ms(table, costs[self.options[0]])
        best_drafting = max((tree_tokens if shape.tree else expected[shape.depth]) / costs[shape]
                            for shape in self.options if shape.drafts)
        return best_drafting < 1.0 / max(dormant_step - upkeep_ms, 1e-6)

    def population_expected(self, sampled: bool) -> list[float] | None:
        """The mean over the class's last DORMANT_POPULATION_REQUESTS finished requests of their own expected
        tokens by depth 0..D, each request one vote; None until DORMANT_POPULATION_MIN_REQUESTS finished."""
        finished = list(self._finished_expected[sampled])[-DORMANT_POPULATION_REQUESTS:]
        if len(finished) < DORMANT_POPULATION_MIN_REQUESTS:
            return None
        return _column_means(finished)

    def optimistic_acceptance(self, sampled: bool | None = None) -> list[float]:
        """The engine's a_1..a_D with a_1 at the upper end of its one-sided Wilson interval (z =
        DORMANT_CONFIDENCE_Z) over the observations of position 1; the deeper rates as they are (a
        deep position is observed only after position 1 was accepted, so its own interval is wide
        exactly when position 1 is rarely accepted, and would keep every request drafting). Of a sampling
        class (None: the class observed most)."""
        cls = self._class(sampled)
        rates, n = cls.effective(), cls.seen[0]
        if n == 0:
            return [1.0] + rates[1:]
        # (the engine's a_1 is a moving average, not a count: its interval is that of a_1 n hits of n)
        return [wilson_interval(rates[0] * n, n, DORMANT_CONFIDENCE_Z)[1]] + rates[1:]

    def prefill_share_ms(self, padded_batch: int, prompt_tokens: int, max_new_tokens: int) -> float:
        """What the draft's prefill of new requests costs per step of their batch: each of its
        `padded_batch` rows prefills about `prompt_tokens` (what a token adds to a prefill call,
        `draft_prefill_ms_per_token`), paid back over `max_new_tokens` steps at most (an upper bound on
        their length: the share is a lower bound). 0 before any prefill was timed."""
        per_token = self.draft_prefill_ms_per_token
        if not prompt_tokens or max_new_tokens <= 0 or per_token is None:
            return 0.0
        return padded_batch * prompt_tokens * per_token / max_new_tokens

    @property
    def draft_prefill_ms_per_token(self) -> float | None:
        """What one more prompt token adds to the draft's prefill (speculative/prefill_cost.py)."""
        return self._draft_prefill.ms_per_token()

    def observe_draft_prefill_startup(self, calls: list[tuple[int, float]]) -> None:
        """Start-up timing of draft prefill calls, (tokens, ms) at two sizes or more."""
        self._draft_prefill.observe_startup(calls)

    def observe_draft_prefill(self, tokens: int, ms: float) -> None:
        """One step's draft prefill: `ms` for `tokens` prompt tokens."""
        self._draft_prefill.observe(tokens, ms)

    def observe_dormant_time(self, padded_batch: int, ms: float, weight: float | None = None,
                             mode: str = GREEDY_MODE) -> None:
        """A step of dormant rows alone (plain decoding's step): its time, kept as the options' are (start-up
        timing with `weight`; online, a moving average clipped at OUTLIER_RATIO). Where nothing was timed at
        start-up (a CPU, a batch size without graphs) the first online step is often its warm-up, as an
        option's is (`observe_time`): the second replaces it, then a mean of the steps so far until the
        moving average weighs more (a warm-up step taken as it came makes the dormant step look dearer than
        plain decoding's, and drafting worth keeping). Online steps well beyond the start-up timing replace it,
        as an option's do (`_replay_left_out_host_work`). In the sampling mode's table (`mode`), as the options'
        costs."""
        table = cost_table(padded_batch, mode)
        old = self.dormant_cost_ms.get(table)
        if weight is not None:
            self._dormant_startup_ms[table] = ms
            self.dormant_cost_ms[table] = ms if old is None else old + weight * (ms - old)
            return
        self._dormant_timed_at[table] = self._steps.get(table, 0)
        count = self._dormant_timed.get(table, 0)  # online steps before this one
        self._dormant_timed[table] = count + 1
        if self._replay_left_out_host_work(("dormant", table), self._dormant_startup_ms.get(table), ms):
            self.dormant_cost_ms[table] = ms
            return
        if table in self._dormant_startup_ms:
            if count == 0:  # (the moving average starts from what the choice counted so far)
                old = self._scaled_startup_dormant_ms(table)
            w = self.decay
        elif old is None or count < 2:  # (its warm-up, then the step that replaces it)
            self.dormant_cost_ms[table] = ms
            return
        else:
            w = max(self.decay, 1.0 / count)
        self.dormant_cost_ms[table] = old + w * (min(ms, OUTLIER_RATIO * old) - old)

    def dormant_step_ms(self, table, untimed: float) -> float:
        """What a step of dormant rows alone costs at this batch as the choice counts it (`_dormant_own_ms`),
        at no more than a depth-0 step's cost there (`depth0_ms`: it does a subset of that step's work, no
        draft features kept, nothing deferred); `untimed` where it was never timed at all. `table`: padded
        batch and sampling mode (`cost_table`)."""
        ms = self._dormant_own_ms(table, untimed)
        return min(ms, self.depth0_ms(table)) if (table, self.options[0]) in self.cost_ms else ms

    def _dormant_own_ms(self, table, untimed: float) -> float:
        """The dormant step's own timing: online, at no more than its start-up timing once DORMANT_STALE_STEPS
        of the policy's steps passed there since it was last timed online; never timed online, its start-up
        timing scaled as depth 0's online cost has moved from depth 0's own (`_scaled_startup_dormant_ms`);
        `untimed` where it was never timed at all."""
        ms = self.dormant_cost_ms.get(table)
        startup, timed_at = self._dormant_startup_ms.get(table), self._dormant_timed_at.get(table)
        if ms is None:
            return untimed
        if timed_at is None:  # (start-up timing alone)
            return self._scaled_startup_dormant_ms(table)
        if startup is not None and self._steps.get(table, 0) - timed_at >= DORMANT_STALE_STEPS:
            return min(ms, startup)
        return ms

    def _scaled_startup_dormant_ms(self, table) -> float:
        """The dormant step's start-up timing times depth 0's online cost over depth 0's start-up timing: online
        steps carry the host's work, which a graph replay does not. Where depth 0 has not run online here either,
        its start-up timing plus the host's share at another batch size (`host_share_elsewhere`); as it is where
        depth 0 has no start-up timing."""
        key = (table, self.options[0])
        startup, depth0_startup = self._dormant_startup_ms[table], self._startup_ms.get(key)
        if not depth0_startup:
            return startup
        if self._time_seen.get(key, 0) <= TRUSTED_OBSERVATIONS:
            return startup + self.host_share_elsewhere(table)
        return startup * self.cost_ms[key] / depth0_startup
