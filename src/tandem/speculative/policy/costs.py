"""What each option costs: a table of step times per padded batch size and sampling mode, timed at
start-up from graph replays and refined by every step, and the corrections that keep a cost from
deciding wrongly for long (outliers clipped, no chain dearer than a deeper one, a floor under drafting
options, refreshes of options left unrun).

Each sampling mode (`layers.sampler.step_mode`: greedy, sampled, sampled with top-k, every sampling stage,
each of those under a grammar) keeps tables of its own: on a host-bound engine the same step costs up to
twice as much in one mode as in another, and a constrained drafting step also waits for the host's tree
masks between draft and verify."""

from __future__ import annotations

from tandem.speculative.policy.shape import DraftShape

# The sampling mode of greedy steps without penalties, logprobs or a grammar: its cost tables are keyed by the
# padded batch size alone (`cost_table`). The name is the sampler's for that combination (layers/sampler.py).
GREEDY_MODE = "greedy"
# Start-up timing (several replays of a graph on padded rows) counts as this many online observations.
TRUSTED_OBSERVATIONS = 10
# An online step time counts at most this many times its option's cost so far: a batch's last step and host
# stalls are no option's doing but land on whichever ran. A real rise still shows, 25% times the weight a step.
OUTLIER_RATIO = 1.25
# Except over a start-up timing (a graph replay: device work alone): this many online steps in a row beyond
# OUTLIER_RATIO times it are the host's work, which the replay leaves out, not stalls, and the online time
# replaces it (the replay stays a floor). Clipped, the demo pair's depth 0 and dormant steps at batch 32 on
# an H200 rose from their 0.25 ms replays by 1.25% a step towards the 0.86 ms every step took, and every
# request was admitted dormant meanwhile, where fixed depth decoded 1.4x faster.
REPLAY_DISAGREEMENTS = 2
# A cost is corrected only by running its option, so an option within REFRESH_MARGIN of the choice's rate that
# has not run for REFRESH_EVERY steps of its table runs once, and that step's time weighs REFRESH_WEIGHT in its
# cost. Rare and narrow: a refresh costs its option's extra time, and from depth 0 a catch-up besides.
REFRESH_EVERY = 128
REFRESH_MARGIN = 0.05
REFRESH_WEIGHT = 0.5
# While a cost has fewer than TRUSTED_OBSERVATIONS observations a faster step replaces it (timing noise only
# adds), and an option cheaper per step than the choice is re-run this often whatever its rate: else a cost
# timed in a slow stretch of the host keeps its option from ever running again.
UNTRUSTED_REFRESH_EVERY = 16


def cost_table(padded_batch: int, mode: str):
    """A cost table's key: the padded batch size for greedy steps, (mode, size) for every other sampling mode
    (`layers.sampler.step_mode`)."""
    return padded_batch if mode == GREEDY_MODE else (mode, padded_batch)


def _rows(table) -> int:
    """A cost table's padded batch size."""
    return table if isinstance(table, int) else table[1]


def _mode(table) -> str:
    """A cost table's sampling mode."""
    return GREEDY_MODE if isinstance(table, int) else table[0]


class CostTables:
    """DepthPolicy's cost tables. A table (`cost_table`: padded batch size and sampling mode) keys every cost.
    State (set in DepthPolicy.__init__): cost_ms, _time_seen, _startup_ms, catch_up_per_step_ms, _refreshing,
    and the choice's step counts _steps and _run_at."""

    def observe_time(self, padded_batch: int, shape: DraftShape, ms: float, weight: float | None = None,
                     mode: str = GREEDY_MODE) -> None:
        """One step's time. `weight` (start-up timing over several graph replays) sets a trusted value.
        Online, the first observation of an option at a batch size is often its warm-up (lazy
        initialisation, first-call allocation): the second replaces it, then a mean of the observations
        so far, then a moving average, each observation at most OUTLIER_RATIO times the cost so far. Over a
        start-up timing, REPLAY_DISAGREEMENTS steps in a row beyond that replace it instead."""
        key = (cost_table(padded_batch, mode), shape)
        old = self.cost_ms.get(key)
        count = self._time_seen.get(key, 0)
        if weight is not None:
            self.cost_ms[key] = self._startup_ms[key] = ms if old is None else old + weight * (ms - old)
            self._time_seen[key] = max(count, TRUSTED_OBSERVATIONS)
            return
        self._time_seen[key] = count + 1
        if self._replay_left_out_host_work(key, self._startup_ms.get(key), ms):
            self.cost_ms[key] = ms
            self._refreshing.discard(key)
            return
        if count >= 2:
            ms = min(ms, OUTLIER_RATIO * old)
        w = max(self.decay, 1.0 / max(count, 1))
        if count < TRUSTED_OBSERVATIONS and old is not None and ms < old:
            w = 1.0  # (see UNTRUSTED_REFRESH_EVERY)
        if key in self._refreshing:
            self._refreshing.discard(key)
            w = max(w, REFRESH_WEIGHT)
        self.cost_ms[key] = ms if old is None else old + w * (ms - old)

    def _replay_left_out_host_work(self, key, startup_ms: float | None, ms: float) -> bool:
        """Whether this online step and the REPLAY_DISAGREEMENTS - 1 before it (of the option or dormant step
        `key`) took more than OUTLIER_RATIO times its start-up timing, whose online time then replaces it
        (once: from then on online steps are clipped against online steps). False without a start-up timing."""
        if startup_ms is None or key in self._replay_replaced:
            return False
        if ms <= OUTLIER_RATIO * startup_ms:
            self._over_replay.pop(key, None)
            return False
        n = self._over_replay[key] = self._over_replay.get(key, 0) + 1
        if n < REPLAY_DISAGREEMENTS:
            return False
        self._replay_replaced.add(key)
        return True

    def observe_catch_up(self, padded_batch: int, ms_per_deferred_step: float) -> None:
        """A catch-up's time per deferred step it can hold, for `padded_batch` catching-up rows: added to
        depth 0's cost, since it does depth 0's deferred work (charged to the drafting step that runs it, it
        would make depth 0 look cheaper than it is). The caller divides by the queries the catch-up ran (a
        graph always runs the whole window), not by the lag: a catch-up forced a few steps after the last
        would charge depth 0 its whole cost for those few steps, and a drafting option that then looks
        cheaper keeps depth 0 from running again to correct it. Kept by padded batch alone: a catch-up
        runs the draft, the same work in every sampling mode."""
        old = self.catch_up_per_step_ms.get(padded_batch)
        new = ms_per_deferred_step
        self.catch_up_per_step_ms[padded_batch] = new if old is None else old + 0.2 * (new - old)

    def cost_row(self, padded_batch: int, mode: str = GREEDY_MODE) -> dict[str, float]:
        """The cost table at one padded batch size and sampling mode, by option name, and depth 0's catch-up
        share (ms; for reports)."""
        table = cost_table(padded_batch, mode)
        row = {shape.name: self.cost_ms[(table, shape)] for shape in self.options if (table, shape) in self.cost_ms}
        if padded_batch in self.catch_up_per_step_ms:
            row["catch_up_per_step"] = self.catch_up_per_step_ms[padded_batch]
        return row

    def _effective_costs(self, table, deferral_ms: float) -> dict[DraftShape, float]:
        """Each option's cost at this table, depth 0's with its catch-up share, and no chain dearer than a
        deeper one: a chain of d does a subset of the work of a chain of d + 1 (and depth 0's deferred
        extends are the chain of one's own, batched), so a table that says otherwise holds a stale or
        noisy cost, which must not decide (at acceptance 0 every chain yields what depth 0 yields)."""
        costs = self._floored_costs(table)
        chains = self.options  # (options[d] is the chain of depth d)
        costs[chains[0]] += deferral_ms
        for d in range(self.num_steps - 1, -1, -1):
            costs[chains[d]] = min(costs[chains[d]], costs[chains[d + 1]])
        return costs

    def _floored_costs(self, table) -> dict[DraftShape, float]:
        """Each option's cost at this table at no less than its start-up timing (a graph replay: device work
        alone) and the host-bound step's (`host_bound_ms`); depth 0's as `depth0_ms`. Every option must be timed.

        With overlap a step takes about the longer of its device work and its host work, and every step does
        at least the dormant step's host work: online, an option costs no less than the dormant step does.
        Options that seldom run keep costs from their replays or from another stretch of the host, while depth
        0 or the dormant step is timed all along: on a host-bound engine such a cost reads cheaper than the
        option is. (The sum of replay and host share overstates it: a chain of three at batch 32 on the demo
        pair, replayed in 0.61 ms against a dormant step's 0.74 ms online, 0.55 of it host, ran in 0.87 ms,
        not 1.15, and the sum kept every request dormant where drafting decoded 1.6x faster.)"""
        costs = {shape: self.cost_ms[(table, shape)] for shape in self.options}
        host_bound = self.host_bound_ms(table)
        for shape in self.options[1:]:
            startup = self._startup_ms.get((table, shape))
            if startup is not None:
                costs[shape] = max(costs[shape], startup, host_bound)
        costs[self.options[0]] = self.depth0_ms(table)
        return costs

    def depth0_ms(self, table) -> float:
        """Depth 0's cost at this table, at no less than the host-bound step's (`host_bound_ms`) unless depth 0
        ran here since the dormant step was last timed online. Depth 0 does all of the dormant step's work, so
        each bounds the other (`dormant_step_ms` caps the dormant step at depth 0), and where they disagree
        the one timed last is believed. Where every row is dormant depth 0 does not run, and its replay (or
        online steps from a faster stretch, which the outlier clip lets rise only slowly) would price it, and
        the dormant step capped at it, below what any step takes now: the demo pair at batch 32 on an H200
        weighed a dormant step at depth 0's 0.25 ms replay against its own 0.86 ms online, and ran every
        request dormant where fixed depth decoded 1.4x faster."""
        key = (table, self.options[0])
        ms = self.cost_ms[key]
        if key in self._startup_ms and self._dormant_timed_last(table):
            ms = max(ms, self.host_bound_ms(table))
        return ms

    def _dormant_timed_last(self, table) -> bool:
        """Whether the dormant step's online timing at this table is newer than depth 0's (or depth 0 never
        ran online there)."""
        key = (table, self.options[0])
        if self._time_seen.get(key, 0) <= TRUSTED_OBSERVATIONS:
            return True
        timed_at = self._dormant_timed_at.get(table)
        return timed_at is not None and timed_at >= self._run_at.get(key, 0)

    def host_bound_ms(self, table) -> float:
        """What the dormant step (plain decoding's) takes online at this table, or is expected to
        (`_dormant_own_ms`): a step's host work, below which no online step of the table runs. 0 where the
        dormant step was not replayed at start-up (a CPU: no floors there)."""
        return self._dormant_own_ms(table, 0.0) if table in self._dormant_startup_ms else 0.0

    def _host_share(self, table) -> float | None:
        """What online steps at this table took beyond their replays: the dormant step's online time over its
        start-up timing, as learned, else depth 0's where it ran online (it does the dormant step's work and
        more); None where neither ran online. As learned even once it is stale here (DORMANT_STALE_STEPS):
        that rule keeps a slow stretch from pricing this table's dormant step for good, but forgetting the
        share would leave another table's first burst at device time alone (the demo pair's batch 8 on an
        H200, after two runs drafting: every request of the first burst of 32 admitted dormant)."""
        startup = self._dormant_startup_ms.get(table)
        if startup is not None and self._dormant_timed.get(table, 0) >= 2:  # (its warm-up, then a real step)
            return self.dormant_cost_ms[table] - startup
        key = (table, self.options[0])
        depth0_startup = self._startup_ms.get(key)
        if depth0_startup is not None and self._time_seen.get(key, 0) > TRUSTED_OBSERVATIONS + 1:
            return self.cost_ms[key] - depth0_startup
        return None

    def host_share_elsewhere(self, table) -> float:
        """For a table where neither depth 0 nor the dormant step has run online (a batch size's first burst):
        the host share (`_host_share`) at the nearest smaller padded batch of the same sampling mode that has
        one; 0 where none has. The host's work a step (launches, scheduling, the results' copy) grows with the
        batch, so a smaller batch's share is a lower bound; without it a first burst weighs its draft
        prefill's online time against a dormant step at device time alone, and admits every request dormant."""
        shares = {}
        for other in self._dormant_startup_ms:
            if _mode(other) == _mode(table) and _rows(other) < _rows(table):
                share = self._host_share(other)
                if share is not None:
                    shares[_rows(other)] = share
        return max(0.0, shares[max(shares)]) if shares else 0.0

    def _refresh(self, table, best: DraftShape, rate) -> DraftShape:
        """The option to run in place of `best` to re-time it: the best-rated one within REFRESH_MARGIN
        of `best` that has not run at this table for REFRESH_EVERY steps (see REFRESH_EVERY), or one
        cheaper than `best` timed fewer than TRUSTED_OBSERVATIONS times that has not run for
        UNTRUSTED_REFRESH_EVERY steps (see there); else best."""
        steps, floor = self._steps.get(table, 0), rate(best) * (1 - REFRESH_MARGIN)
        cost, seen = self.cost_ms, self._time_seen
        best_cost = cost[(table, best)]

        def due(s):
            idle = steps - self._run_at.get((table, s), 0)
            if rate(s) >= floor and idle >= REFRESH_EVERY:
                return True
            return (cost[(table, s)] < best_cost and seen.get((table, s), 0) < TRUSTED_OBSERVATIONS
                    and idle >= UNTRUSTED_REFRESH_EVERY)

        stale = [s for s in self.options if s != best and due(s)]
        if not stale:
            return best
        shape = max(stale, key=rate)
        self._refreshing.add((table, shape))
        return shape
