"""The choice: each step, the draft shape with the most expected tokens per millisecond.

    expected tokens of a request at depth d = 1 + a_1 + a_1 a_2 + ... + a_1 ... a_d

with a_j the acceptance of position j given position j - 1 was accepted (acceptance.py), and time the
option's measured step time at the batch's padded size and sampling mode (costs.py). A tree's expected
tokens are the mean of its own accept lengths. The deepest option runs now and then (a probe), so the
rates of positions the choice does not draft stay known, and a batch with more drafting rows than its
class has observations of position 1 runs it once (`_learning`).
"""

from __future__ import annotations

import logging
import math
from collections import deque

from tandem.speculative.policy.acceptance import (REQUEST_EVIDENCE_Z, AcceptanceEstimates, _ClassRates,
                                                  _RequestRates, wilson_interval)
from tandem.speculative.policy.cohorts import SLOWEST_ROW_REQUESTS_KEPT, Cohorts, _Cohort
from tandem.speculative.policy.costs import GREEDY_MODE, REFRESH_EVERY, REFRESH_MARGIN, CostTables, cost_table
from tandem.speculative.policy.dormancy import Dormancy
from tandem.speculative.policy.shape import DraftShape
from tandem.speculative.prefill_cost import PrefillCost

logger = logging.getLogger(__name__)

# After a depth-0 choice the same batch (same requests, no observation since) gets depth 0 again for this many
# steps without `choose`'s full pass (`repeat_depth0`): the pass is a tenth of a host-bound step, and what a
# repeat leaves out (costs drifting, rows' remaining tokens falling) moves slowly or makes drafting worth less.
REPEAT_DEPTH0_STEPS = 8


class DepthPolicy(AcceptanceEstimates, CostTables, Dormancy, Cohorts):
    """The adaptive policy: what the engine tells it (observe_*, admit, forget) and what it answers (choose,
    repeat_depth0, demote). Each concern's methods live in its module; every table they share is set here."""

    def __init__(self, num_steps: int, tree: bool, decay: float = 0.05, min_request_obs: int = 8,
                 probe_every: int = 32, probe_budget: float = 0.005, prior: float = 0.6, prior_weight: float = 1.0,
                 hysteresis: float = 0.03, dormancy: bool = True):
        """decay: weight of each new observation in the averages; min_request_obs: observations before a
        request's own acceptance replaces the engine's; probe_every, probe_budget: while a shorter option
        than the deepest is chosen, the deepest runs once every probe_every steps of a batch size, or
        less often, so that probes cost at most probe_budget of the time (they keep the acceptance of
        the positions the choice does not draft known, at a dearer step than the choice's); prior: the
        acceptance assumed before any observation, worth prior_weight observations (one early rejection
        must not look like a rate of 0); hysteresis: how much better (relative) another option must look
        before the choice for a batch size moves (measured costs are noisy); dormancy: whether `admit` may
        admit requests dormant (off under tensor parallelism, whose ranks must agree on every request's
        draft state)."""
        self.num_steps = num_steps
        self.options = [DraftShape(d) for d in range(num_steps + 1)] + ([DraftShape(num_steps, True)] if tree else [])
        self.deepest = self.options[-1]
        self.decay = decay
        self.min_request_obs = min_request_obs
        self.probe_every = probe_every
        self.probe_budget = probe_budget
        self.prior_weight = prior_weight
        self.hysteresis = hysteresis
        self.prior = prior
        self.sampled: set[str] = set()  # requests that sample (temperature > 0): their class's rates (`admit`)
        self.reset_acceptance()
        self._requests: dict[str, _RequestRates] = {}
        # A table (`cost_table`: padded batch size and sampling mode) keys every cost and step count below.
        self.cost_ms: dict[tuple, float] = {}  # (table, shape) -> iteration time
        self._time_seen: dict[tuple, int] = {}  # observations behind each cost
        self._startup_ms: dict[tuple, float] = {}  # (table, shape) -> its start-up timing
        # (table, shape), or ("dormant", table): online steps in a row beyond OUTLIER_RATIO x the start-up timing,
        # and the keys whose start-up timing online steps have replaced (`_replay_left_out_host_work`)
        self._over_replay: dict = {}
        self._replay_replaced: set = set()
        self._last_choice: dict = {}  # table (or ("with prompts", table)) -> the last choice there
        # padded batch -> ms of catch-up per deferred step: a depth-0 step's true cost includes it
        self.catch_up_per_step_ms: dict = {}
        self._steps_since_probe: dict = {}  # table -> steps since the deepest option last ran there
        self._steps: dict = {}  # table -> steps chosen at it
        # (batch's class sampled?, table) -> steps in a row whose choice (probes aside) was depth 0: set in
        # reset_acceptance
        self._run_at: dict = {}  # (table, shape) -> the table's step count when the option last ran (or 0)
        self._refreshing: set = set()  # (table, shape) keys whose next observed time is a refresh
        # padded batch -> (request ids, repeats left, step count when a refresh falls due, its _undrafted_steps
        # key, its table) of the last depth-0 choice there (`repeat_depth0`)
        self._repeatable: dict = {}
        self._max_of_normals: dict[int, float] = {}  # rows -> expected_max_of_normals(rows)
        self.dormancy = dormancy
        self.dormant: set[str] = set()  # requests without draft state (see `admit`)
        self.sentinels: set[str] = set()  # requests kept drafting by the sentinel rule (never demoted)
        self.dormant_cost_ms: dict = {}  # table -> a step of dormant rows alone
        self._dormant_startup_ms: dict = {}  # table -> its start-up timing (graph replay)
        self._dormant_timed_at: dict = {}  # table -> its step count at the last online timing
        self._dormant_timed: dict = {}  # table -> online timings so far
        # [tries][hits] -> a request's own interval at REQUEST_EVIDENCE_Z, for tries under min_request_obs (a
        # table: it is read for every request and position a drafting step observes)
        self._intervals = [[wilson_interval(h, n, REQUEST_EVIDENCE_Z) for h in range(n + 1)]
                           for n in range(min_request_obs)]
        self._draft_prefill = PrefillCost()  # what a prompt token adds to the draft's prefill
        self._admitted = 0

    def reset_acceptance(self) -> None:
        """Back to the prior, as at start-up (the cost table stays)."""
        # Engine-wide acceptance by sampling class: False greedy requests, True sampled ones (_ClassRates).
        self.rates_by_class = {False: _ClassRates(self.num_steps, self.prior),
                               True: _ClassRates(self.num_steps, self.prior)}
        self._accept_nothing = [1.0] * (self.num_steps + 1)  # a dormant request's expected tokens by depth
        # sampled? -> the expected tokens by depth 0..D of each of the last finished requests with
        # min_request_obs observations of position 1, from its own rates (`slowest_row_expected`)
        self._finished_expected = {False: deque(maxlen=SLOWEST_ROW_REQUESTS_KEPT),
                                   True: deque(maxlen=SLOWEST_ROW_REQUESTS_KEPT)}
        # (sampled?, padded batch) -> the slowest row's expected tokens by depth of each of the last finished
        # cohorts (COHORTS_KEPT); request id -> its cohort while it runs; (sampled?, padded batch) -> the
        # cohort that admissions join until the next step is chosen
        self._cohort_slowest: dict[tuple, deque] = {}
        self._cohort_of: dict[str, _Cohort] = {}
        self._open_cohorts: dict[tuple, _Cohort] = {}
        # (sampled?, table) -> depth-0 choices in a row: judged at the rates being reset, they must not stand
        # in for observations of the new ones (`_evidence_enough`)
        self._undrafted_steps = {}
        self._repeatable = {}

    def forget(self, request_ids) -> None:
        """Requests that finished or were preempted: their expected tokens by depth are kept
        (`slowest_row_expected`)."""
        for rid in request_ids:
            req = self._requests.pop(rid, None)
            own = None
            if req is not None and req.seen[0] >= self.min_request_obs:
                own = self._own_expected(req, self._class_of(rid))
                self._finished_expected[rid in self.sampled].append(own)
            self._cohort_finished(rid, own)
            self.dormant.discard(rid)
            self.sentinels.discard(rid)
            self.sampled.discard(rid)
            self._repeatable.clear()

    def choose(self, request_ids, padded_batch: int, mode: str = GREEDY_MODE, prefill_rows: int = 0,
               catch_up_batch: int | None = None, remaining: list[int] | None = None,
               finish_together: list[bool] | None = None, catch_up_forced: bool = False) -> DraftShape:
        """The option with the most expected tokens per ms at this padded batch size. An option never timed at this
        size is chosen first (it gets timed); a probe of the deepest option now and then keeps the acceptance
        beyond the chosen depth known while shorter options win. `mode`: the step's sampling mode
        (`layers.sampler.step_mode`; each has a cost table of its own). `prefill_rows`: requests whose prompt
        chunks share the step; they count as rows that accept nothing (one token's worth each), because drafting
        lengthens their step too and delays their first token. `catch_up_batch`: the padded size of the rows
        that defer at depth 0 (dormant ones do not; 0: none), default the batch's. `remaining`: per request, the
        tokens it may still emit (max_new_tokens less its outputs, an upper bound): a step yields at most that
        many, so drafts past it are counted as worth nothing (they would be accepted and dropped).
        `finish_together`: per request, whether it runs exactly its `remaining` tokens (no EOS or stop can end
        it) in a batch that nothing queued will refill: the batch is then done when the slowest of them is (see
        `_straggler_factors`). `catch_up_forced`: a drafting step now would first run a catch-up that a depth-0
        step would not (rows have deferred extends, short of a full window): while depth 0 is chosen, probes and
        refreshes then wait for the step whose catch-up is due anyway (at most a window of steps), so they cost
        their own extra time only, not a catch-up each besides."""
        self._close_cohorts()
        table = cost_table(padded_batch, mode)
        untimed = [s for s in self.options if (table, s) not in self.cost_ms]
        if untimed:
            return untimed[-1]
        # The batch's expected tokens at every chain depth in one pass, from cached per-request sums
        # (this runs on the host every step, and a loop over requests per option would be a visible share
        # of a host-bound step).
        dormant, nothing = self.dormant, self._accept_nothing
        per_request = [nothing if rid in dormant else self._expected_of(rid) for rid in request_ids]
        tree_each = [1.0 if rid in dormant else self._class_of(rid).tree_tokens for rid in request_ids]
        batch_class = self._batch_class(request_ids)
        sampled_batch = batch_class is self.rates_by_class[True]
        if remaining is not None:
            for i, left in enumerate(remaining):
                if left <= self.num_steps:  # near its end: depth past left - 1 adds nothing
                    left = max(left, 1)
                    e = per_request[i]
                    per_request[i] = e[:left] + [e[left - 1]] * (len(e) - left)
                    tree_each[i] = min(tree_each[i], float(left))
        fixed_rows = finish_together is not None and remaining is not None
        if fixed_rows and not prefill_rows and all(finish_together):
            chain_tokens, tree_tokens = self._slowest_rows_progress(per_request, tree_each, remaining, batch_class)
        else:
            chain_tokens = [sum(column) + prefill_rows for column in zip(*per_request)]
            tree_tokens = sum(tree_each) + prefill_rows
            if fixed_rows and sum(finish_together) > 1:
                rows = [i for i, together in enumerate(finish_together) if together]
                factors = self._straggler_factors(len(rows), max(remaining[i] for i in rows), batch_class)
                for d in range(1, self.num_steps + 1):
                    chain_tokens[d] -= (1 - 1 / factors[d]) * sum(per_request[i][d] for i in rows)
                tree_tokens -= (1 - 1 / factors[-1]) * sum(tree_each[i] for i in rows)

        deferring = padded_batch if catch_up_batch is None else catch_up_batch
        deferral_ms = self.catch_up_per_step_ms.get(deferring, 0.0) if catch_up_batch != 0 else 0.0

        costs = self._effective_costs(table, deferral_ms)

        def rate(shape):
            return (tree_tokens if shape.tree else chain_tokens[shape.depth]) / costs[shape]

        best = max(self.options, key=rate)
        # Steps with prompt chunks keep a choice of their own (they alternate with pure decode steps).
        key = ("with prompts", table) if prefill_rows else table
        last = self._last_choice.get(key)
        if last is not None and rate(best) <= rate(last) * (1 + self.hysteresis):
            best = last
        if last != best:
            logger.info("adaptive speculation: batch %s%s%s now drafts %s (acceptance per position %s)",
                        padded_batch, "" if mode == GREEDY_MODE else f" ({mode})",
                        " with prompt chunks" if prefill_rows else "", best.name,
                        ", ".join(f"{a:.2f}" for a in batch_class.acceptance))
            self._last_choice[key] = best
        if prefill_rows:
            return best  # no probe where it would delay first tokens (and no refresh: such steps go untimed)
        undrafted = (sampled_batch, table)
        self._undrafted_steps[undrafted] = 0 if best.drafts else self._undrafted_steps.get(undrafted, 0) + 1
        steps = self._steps_since_probe.get(table, 0) + 1
        wait = catch_up_forced and not best.drafts  # (see above)
        if best != self.deepest and ((steps >= self._probe_interval(table, best, self.deepest) and not wait)
                                     or self._learning(request_ids, batch_class)):
            # The deepest option observes every position at once: one probe can show that a deep
            # draft pays even when the first position alone would not justify a chain of one. And while
            # the engine has observed position 1 fewer times than this batch has drafting rows, one
            # step of the deepest would more than double what it knows: a learning probe (at a big
            # batch the prior can hold depth 0 while regular probes come less than once a run).
            best, steps = self.deepest, 0
        elif not wait:
            best = self._refresh(table, best, rate)
        self._count_step(table, best, steps)
        if best.drafts:
            self._repeatable.pop(padded_batch, None)
        else:  # repeatable until the first option that `_refresh` could pick falls due
            floor, count = rate(best) * (1 - REFRESH_MARGIN), self._steps[table]
            stale_at = min((self._run_at.get((table, s), 0) + REFRESH_EVERY for s in self.options
                            if s != best and rate(s) >= floor), default=count + REPEAT_DEPTH0_STEPS + 1)
            self._repeatable[padded_batch] = (tuple(request_ids), REPEAT_DEPTH0_STEPS, stale_at, undrafted, table)
        return best

    def repeat_depth0(self, request_ids: tuple, padded_batch: int) -> DraftShape | None:
        """Depth 0 without the full pass of `choose` (see REPEAT_DEPTH0_STEPS), or None where `choose` must
        decide: another batch than the last depth-0 choice's at this padded size, an observation, admission
        or finished request since, REPEAT_DEPTH0_STEPS repeats already, or a probe or refresh due. Counts
        the step as `choose` would, in the cost table `choose` used (the same requests step in the same sampling
        mode). For pure decode steps (no prompt chunks)."""
        self._close_cohorts()
        last = self._repeatable.get(padded_batch)
        if last is None or last[1] <= 0 or last[0] != request_ids:
            return None
        ids, left, stale_at, undrafted, table = last
        steps = self._steps_since_probe.get(table, 0) + 1
        depth0 = self.options[0]
        if steps >= self._probe_interval(table, depth0, self.deepest):
            return None  # (choose decides whether the probe waits for a catch-up)
        if self._steps.get(table, 0) >= stale_at:
            return None  # (`_refresh` compares the steps counted before this one)
        self._repeatable[padded_batch] = (ids, left - 1, stale_at, undrafted, table)
        self._undrafted_steps[undrafted] = self._undrafted_steps.get(undrafted, 0) + 1
        self._count_step(table, depth0, steps)
        return depth0

    def _count_step(self, table, shape: DraftShape, steps_since_probe: int) -> None:
        self._steps_since_probe[table] = steps_since_probe
        count = self._steps[table] = self._steps.get(table, 0) + 1
        self._run_at[(table, shape)] = count

    def _learning(self, request_ids, cls: _ClassRates) -> bool:
        """Whether to run a learning probe: the batch's class has observed position 1 fewer times than the
        batch has drafting rows, and has observed it since the last learning probe."""
        seen = cls.seen[0]
        if seen == cls.learning_probe_at or seen >= len(request_ids):
            return False  # (a probe's results come a step later under overlap: one probe, not two)
        if seen >= len(request_ids) - len(self.dormant.intersection(request_ids)):
            return False
        cls.learning_probe_at = seen
        return True

    def _probe_interval(self, table, chosen: DraftShape, probe: DraftShape) -> int:
        """Steps between probes: probe_every, or more where one probe step costs more than probe_budget
        of probe_every chosen steps."""
        cost = self.cost_ms[(table, chosen)]
        extra = max(0.0, self.cost_ms[(table, probe)] - cost)
        return max(self.probe_every, math.ceil(extra / (self.probe_budget * cost)))
