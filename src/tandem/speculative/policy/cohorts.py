"""Batches that finish together: fixed-length rows (no EOS or stop can end them) that nothing queued will
refill. Such a batch is done when its slowest row is, so the choice counts only the rows that can end
last and charges each drafting option the extra steps of the slowest (`_slowest_rows_progress`,
`_straggler_factors`), and a request joining such a batch is judged at its slowest row's pace, as earlier
batch jobs of its size (cohorts) or the last finished requests showed it (`slowest_row_expected`)."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from tandem.speculative.policy.acceptance import (_ClassRates, _RequestRates, expected_by_depth,
                                                  expected_max_of_normals, spread_by_depth)

# The slowest of B rows, before any batch of that size finished together: at each depth the 1 / (B + 1)
# quantile of what the class's last SLOWEST_ROW_REQUESTS_KEPT finished requests made over their own drafts,
# once SLOWEST_ROW_MIN_REQUESTS have (one batch of four). Every position counts, not position 1 alone: the
# engine-wide deeper rates come mostly from the rows that accept often.
SLOWEST_ROW_REQUESTS_KEPT = 64
SLOWEST_ROW_MIN_REQUESTS = 4
# Once batches of that size finished together: the median, over the last this many, of each one's slowest
# row. A batch job that reruns its prompts has the same slowest row each time, not the slowest of B at random.
COHORTS_KEPT = 8


@dataclass
class _Cohort:
    """Requests admitted together, drafting, into a batch that finishes together: the ones still running, and
    the lowest expected tokens by depth among those finished so far (None before the first)."""

    key: tuple  # (sampled?, padded batch)
    running: set
    slowest: list[float] | None = None


def _order_statistic_by_depth(expected_rows, at: int) -> list[float]:
    """At each depth, the `at`-th smallest of the rows' expected tokens there."""
    return [sorted(column)[at] for column in zip(*expected_rows)]


class Cohorts:
    """DepthPolicy's view of batches that finish together. State (set in reset_acceptance): _finished_expected,
    _cohort_slowest, _cohort_of, _open_cohorts; and _max_of_normals (DepthPolicy.__init__)."""

    def slowest_row_expected(self, rows: int, sampled: bool) -> list[float] | None:
        """The expected tokens by depth 0..D of the slowest of `rows` rows: at each depth, the 1 / (rows + 1)
        quantile of what the class's last finished requests showed (SLOWEST_ROW_REQUESTS_KEPT); None with
        fewer than SLOWEST_ROW_MIN_REQUESTS of them. For two rows or more, the median of what the slowest rows
        of earlier cohorts at this batch made, where any finished (COHORTS_KEPT)."""
        recorded = self._cohort_slowest.get((sampled, rows)) if rows > 1 else None
        if recorded:
            return _order_statistic_by_depth(recorded, len(recorded) // 2)
        finished = self._finished_expected[sampled]
        if len(finished) < SLOWEST_ROW_MIN_REQUESTS:
            return None
        return _order_statistic_by_depth(finished, min(len(finished) - 1, len(finished) // (rows + 1)))

    def _own_expected(self, req: _RequestRates, cls: _ClassRates) -> list[float]:
        """A finished request's expected tokens by depth from its own hits over tries at each position; where
        it tried a position fewer than min_request_obs times, its class's rate there counts as prior_weight
        more tries (a deep position is tried only after the ones before it were accepted: a row that accepts
        little tries it rarely)."""
        rates = []
        for hits, tries, assumed in zip(req.hits, req.seen, cls.effective()):
            if tries >= self.min_request_obs:
                rates.append(hits / tries)
            else:
                rates.append((hits + self.prior_weight * assumed) / (tries + self.prior_weight))
        return expected_by_depth(rates)

    def _join_cohort(self, request_id: str, key: tuple) -> None:
        """A drafting request admitted into a batch that finishes together joins the cohort admitted with it
        (the requests admitted since the last step was chosen, `_close_cohorts`)."""
        cohort = self._open_cohorts.get(key)
        if cohort is None:
            cohort = self._open_cohorts[key] = _Cohort(key, set())
        cohort.running.add(request_id)
        self._cohort_of[request_id] = cohort

    def _leave_cohort(self, request_id: str) -> None:
        cohort = self._cohort_of.pop(request_id, None)
        if cohort is not None:
            cohort.running.discard(request_id)

    def _close_cohorts(self) -> None:
        """A step is chosen: later admissions start cohorts of their own."""
        self._open_cohorts.clear()

    def _cohort_finished(self, request_id: str, own: list[float] | None) -> None:
        """A cohort's row finished (or was preempted) with expected tokens `own` (None: too few observations
        to tell): once none runs, the cohort's slowest row is recorded for its batch size."""
        cohort = self._cohort_of.get(request_id)
        if cohort is None:
            return
        self._leave_cohort(request_id)
        if own is not None:
            cohort.slowest = own if cohort.slowest is None else [min(a, b) for a, b in zip(cohort.slowest, own)]
        # (a cohort still open, whose rows all ended before any step, could gain rows yet: not recorded)
        if not cohort.running and cohort.slowest is not None and self._open_cohorts.get(cohort.key) is not cohort:
            self._cohort_slowest.setdefault(cohort.key, deque(maxlen=COHORTS_KEPT)).append(cohort.slowest)

    def _slowest_rows_progress(self, per_request, tree_each, remaining, cls: _ClassRates) -> tuple[list[float], float]:
        """For a drained batch of fixed-length rows (nothing queued, no row can end early): the batch is done
        when its slowest row is, so what a step is worth is the progress of the rows that can still end
        last (those within one deepest step's tokens of the most remaining), their mean expected tokens
        over the straggler factor of that many rows: by chain depth 0..D, and the tree's. Tokens of rows
        about to finish are worth nothing here: summed with the others (the throughput view, right while
        new requests take the freed slots), they make depth 0 look nearly as good while the rows with the
        most left still need a step a token."""
        most = max(remaining)
        last = [i for i, left in enumerate(remaining) if left > most - (self.num_steps + 1)]
        factors = self._straggler_factors(len(last), most, cls)
        n = len(last)
        columns = zip(*[per_request[i] for i in last])  # (column sums: cheaper than a generator per depth)
        chain = [sum(column) / (n * factor) for column, factor in zip(columns, factors)]
        tree = sum(tree_each[i] for i in last) / (n * factors[-1])
        return chain, tree

    def _straggler_factors(self, rows: int, remaining: int, cls: _ClassRates) -> list[float]:
        """By depth 0..D: how much longer than its mean a batch of `rows` requests that each need
        `remaining` more tokens takes to finish, when it finishes with its slowest request. At depth d a
        request needs R / E steps on average (E: expected tokens a step), with a spread of
        sd sqrt(R / E) / E (sd: of one step's tokens); the slowest of n needs about
        R / E (1 + z_n sd / sqrt(R E)), z_n the expected max of n standard normals. Plain decoding
        (depth 0) needs exactly R steps. (On an H200 at acceptance 0.3, batch 64, a chain of one takes
        51-56 steps for 64 tokens where the mean asks 49 and the formula 55.) From the acceptance of the
        batch's class `cls` (a request's own would cost a pass over the batch per step)."""
        if cls.spread is None:
            rates = cls.effective()
            cls.spread = expected_by_depth(rates), spread_by_depth(rates)
        expected, spread = cls.spread
        z = self._max_of_normals.get(rows)
        if z is None:
            z = self._max_of_normals[rows] = expected_max_of_normals(rows)
        return [1.0 + z * sd / math.sqrt(max(remaining, 1) * e) for e, sd in zip(expected, spread)]
