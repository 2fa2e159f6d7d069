"""Adaptive speculation: each step, the draft shape that maximises expected tokens per second.

The options are chains of depth d = 0, 1, ..., num_steps (d = 0: plain decoding's step, whose draft extend
is deferred and caught up before the next drafting step, speculative/catch_up.py) and, when the configured
drafting is a tree (topk > 1), that tree. For the batch about to run the policy picks the option with the most
expected tokens per millisecond:

    expected tokens of a request at depth d = 1 + a_1 + a_1 a_2 + ... + a_1 ... a_d

where a_j is the acceptance rate of draft position j given that position j - 1 was accepted: an
exponentially weighted average over recent verify steps (the engine's moves once a step, by that step's
hits over tries), the request's own at a position once it has enough observations of it and the
engine's otherwise, kept apart for greedy and sampled requests (`_ClassRates`). A tree's expected tokens
are the weighted average of its own accept lengths. Time is the measured time of an iteration of that
option at the batch's padded size: timed at start-up when graphs are captured, refined by every step's
measured time. Each sampling mode keeps a cost table of its own (`layers.sampler.step_mode` names a
step's: greedy, sampled, sampled with top-k, every sampling stage, each of those under a grammar): on a
host-bound engine the same step costs up to twice as much in one mode as in another, and options timed in a
cheap mode must not be weighed against a dormant step timed in a dear one. A grammar-constrained drafting
step also waits for the host's tree masks between draft and verify, so it costs more than the same shape
free.

Corrections keep the choice honest. A position never drafted takes the rate of the one before it
(`effective_acceptance`), not the prior, and a batch with more drafting rows than the engine has
observations of position 1 runs the deepest once (`_learning`). A batch of fixed-length requests that
nothing queued will refill is done when its slowest request is, so only the rows that can end last count,
each drafting option charged for the extra steps of the slowest (`_slowest_rows_progress`,
`_straggler_factors`). And costs can only be corrected by running their option, so no chain counts as
dearer than a deeper one, no drafting option counts below its start-up replay plus the host's share of
depth 0's online cost (`_floored_costs`), a competitive option left unrun is re-timed now and then
(`_effective_costs`, `_refresh`), and one slow step (a batch's last, a host stall) moves a cost by at most a
quarter of its weight (OUTLIER_RATIO).

Dormant requests: keeping a draft's state costs even while nothing is drafted (its prefill, and a
catch-up over deferred tokens every CATCH_UP_WINDOW steps: 0.7%, 1.3% and 2.3% of a depth-0 step at batch
32, 64 and 128, 8B shape, H200). So once the engine is sure enough that drafting does not pay at the batch
a new request joins (the running one plus the queued requests with room: even with a_1 at the upper end of
its 95% interval, `optimistic_acceptance`, or at the rates as estimated once settled, and with its draft
prefill to pay back, `prefill_share_ms`), it is admitted *dormant* (`admit`): no draft prefill, no
catch-ups; running requests drop their draft state once the same holds for their batch (`demote`). A
request joining a batch job (fixed-length rows that nothing queued will refill) is judged at the pace of its
slowest row, as earlier batch jobs of its size showed it (`slowest_row_expected`, COHORTS_KEPT). A
batch of dormant rows alone runs plain decoding's step (SpecWorker._launch_dormant); in a
step that drafts for others a dormant row counts as a row that accepts nothing (its drafts come from no
state, harmless to the output: the target's tokens decide; they can be NaN, which the tree builder reads
as -inf). One request in SENTINEL_EVERY or more (`sentinel_spacing`: as many as keep its upkeep within
SENTINEL_BUDGET) keeps its draft, so acceptance stays measured (its probes), and new requests draft again
once it pays.

Nothing here changes what is generated: every option emits the target's own tokens (speculative/verify.py).
Only the steps' cost and the accept lengths depend on the choice. Pure Python: unit-tested with a
hand-made cost table.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from dataclasses import dataclass
from statistics import NormalDist
from typing import NamedTuple

from tandem.speculative.prefill_cost import PrefillCost

logger = logging.getLogger(__name__)

# Start-up timing (several replays of a graph on padded rows) counts as this many online observations.
TRUSTED_OBSERVATIONS = 10
# Dormant admission (see above): one request in this many keeps its draft while others are admitted
# dormant; the engine's acceptance needs this many observations of position 1 before any request is; and
# drafting must lose by this margin (relative tokens per ms) at the running batch size.
# One request in 32 keeps its draft (one in 8 before): a sentinel pays the draft's upkeep for the probes
# it is there for, and on a host-bound engine that upkeep is large (on an H200 the demo pair's batch of
# one ran 17% slower with its sentinel than dormant, at temperature 1), while a batch of dormant rows
# alone runs plain decoding's step. Probes are as frequent either way (one per probe interval of a batch
# size, observing every drafting row); what a rarer sentinel delays is noticing that acceptance rose.
SENTINEL_EVERY = 32
# And fewer where a sentinel costs more: while one runs, its batch takes depth-0 steps (the draft's features
# kept, catch-ups) instead of plain decoding's step, so the whole batch pays the difference. A sentinel
# comes once per so many admissions that this upkeep stays within SENTINEL_BUDGET of the engine's time:
# B x (depth 0's step + its catch-up share - a dormant step) / a dormant step / SENTINEL_BUDGET, at least
# SENTINEL_EVERY (`sentinel_spacing`). With one in 32 the demo pair's batches of 32 on an H200 (each one
# holding a sentinel) never ran a dormant step, and at temperature 1, every row but the sentinel dormant,
# ran 0.96x plain decoding (depth 0 0.78 ms a step against 0.73 dormant; bench/results/
# sampling_demo_h200_session13.json).
SENTINEL_BUDGET = 0.005
DORMANT_MIN_OBSERVATIONS = 8
# How sure the engine must be that drafting does not pay: the rate of position 1 (which gates every deeper
# one) counts at the upper end of its one-sided 95% Wilson interval (z = 1.64) over the observations
# behind it. A fixed 32 observations and a 5% margin before (the fifth session's rule) meant on a CPU, where
# a probe costs 14 ms, that no request ever went dormant, and on an H200 the demo pair at temperature 1
# (a_1 about 0.3) paid the draft's upkeep for its first 32 observations of every batch size.
DORMANT_CONFIDENCE_Z = 1.64
# A request's own evidence: before it has min_request_obs observations of a position, the rate there is its
# class's, moved into the request's own one-sided 95% Wilson interval (the same z) over what it has shown.
# The class's rate alone for those first steps cost a request that accepts nothing eight drafting steps: on
# the demo pair over random-token prompts, some requests accept about 0.7 a position and others nothing, and
# on a CPU, where a chain of three costs 1.8-2.2x a depth-0 step at batch 1, eight such steps were 10-13% of
# a 64-token run. With the interval, four rejections in a row put position 1 at 0.40 at most (z^2 / (n +
# z^2)), and a request that accepts everything gets its deep drafts as soon.
REQUEST_EVIDENCE_Z = DORMANT_CONFIDENCE_Z
# From this many observations of position 1 the estimate is taken as it is (no confidence bound): a batch
# whose best drafting option then loses to a dormant row's step pays the draft's upkeep for nothing. On a
# CPU, where a chain of one costs 1.5x depth 0 at batch 4, the demo pair accepts a_1 = 0.45-0.55, just
# under break-even, while the upper end of its interval stays above it for hundreds of observations: the
# engine sat at depth 0 keeping every draft (its prefill, a catch-up every 32 steps: 5-8% of a run) and
# ran 0.92-0.95x plain decoding.
DORMANT_SETTLED_OBSERVATIONS = 32
# The estimate is taken as it is at a batch size whose choice has been depth 0 for this many steps in a row
# too (probes aside): the policy itself judged drafting not worth it there for that long, and at depth 0
# no observations come to narrow the interval (on a CPU at batch 1, with a probe every 277 steps, rows
# kept their drafts for four 64-token runs in a row).
DORMANT_SETTLED_STEPS = 64
# Such a batch also needs no DORMANT_MIN_OBSERVATIONS: where drafting does not pay even at the prior, the
# choice is depth 0 from the first step and observations come from probes alone. On an H200 with a fast
# host (the demo pair's plain step 0.22 ms, a chain of three 0.58) requests at temperature 1, batch 1,
# chose depth 0 for every step of five 96-token runs, kept their drafts (a draft prefill and catch-ups)
# and ran 0.87x plain decoding: the sampled class had one observation (bench/results/
# sampling_demo_h200_session13_slowest.json).
# A request that joins a batch which will finish together (fixed-length rows, nothing queued to refill it) is
# judged at the pace of the batch's slowest row: at each depth, the 1 / (B + 1) quantile of the expected tokens
# that the last SLOWEST_ROW_REQUESTS_KEPT finished requests of its class showed over their own drafts (B: the
# padded batch; the median for one row), once SLOWEST_ROW_MIN_REQUESTS have (one batch of four). Such a batch
# is done when its slowest row is, and requests differ: on a CPU the demo pair's requests over random-token
# prompts accept a_1 = 0.55-0.65 engine-wide, at which a chain of one pays at batch 4 (23 ms against depth 0's
# 17, 1.6 tokens against 1), but its batches of four drafted chains of one and two at the pace of a row that
# accepted less, 1.37 tokens a step, and ran 0.87-0.95x plain decoding run after run. Each row's own rates
# count only the positions it drafted, so a chance low (or high) one is a sample of what the next batch's
# slowest row will do, the within-request noise included, which the engine-wide rate leaves out. Every
# position counts, not position 1 alone: the engine-wide deeper rates are conditional on position 1's
# acceptance and so come mostly from the rows that accept often. Taken with the slowest row's position 1
# they promised the demo pair's batches of four on a CPU 2.58 tokens a chain of three (margin 1.17 over a
# dormant row); the batches made 1.5 a step and ran 0.85-0.87x plain decoding for the first three of seven
# runs of every invocation, and one invocation in ten kept its drafts for six (0.90x).
SLOWEST_ROW_REQUESTS_KEPT = 64
SLOWEST_ROW_MIN_REQUESTS = 4
# Where batches of the same size finished together before, what their slowest rows made decides instead: at
# each depth, the median over the last COHORTS_KEPT such batches (cohorts: the requests admitted together,
# drafting) of the lowest expected tokens among each one's rows. The quantile above stands for the slowest of
# B independent requests; a batch job that runs the same prompts again is not that: its slowest row is the
# same prompt every time. On a CPU the demo pair's batches of four (`tandem bench`, seven runs of four
# prompts) made 1.38-1.51 tokens a chain of one at their slowest row, run after run, while the 1/5 quantile
# of the finished requests (the batch-1 prompt's eight runs among them) fell on the second-slowest row,
# 1.57-1.65: drafting looked 2-10% better than a dormant row's step, and in one invocation of five to ten
# every run of seven drafted chains of one, at 0.88-0.89x plain decoding.
COHORTS_KEPT = 8
# Cost refreshes: an option not run at a batch size for REFRESH_EVERY of its steps, whose expected rate is
# within REFRESH_MARGIN of the choice's, runs once, and that step's time weighs REFRESH_WEIGHT in its cost.
# A cost is corrected only by running its option: without refreshes a cost that is too high (one slow
# step, a mis-timed one) keeps its option from ever running again, and so from ever being corrected. (On an
# H200 a mis-timed depth 0 kept a chain of one drafting in vain at acceptance 0, batch 32: StepClock in
# speculative/worker.py was the cause; this is the net under it.) Refreshes cost: at 10% and every 64
# steps, chains of one and two were refreshed every run at batch 1, acceptance 0, each with the catch-up it
# forces, about 0.6% of the run; hence 5% and 128 (not yet measured on the H200).
REFRESH_EVERY = 128
REFRESH_MARGIN = 0.05
REFRESH_WEIGHT = 0.5
# Costs timed online (a CPU; a batch size without graphs) start from a few steps, and a slow stretch of the
# machine in those steps is corrected only if the option runs again. So while an option has fewer than
# TRUSTED_OBSERVATIONS observations at a table, a faster step replaces its cost (timing noise only adds:
# a cost set too low makes its option run, and so corrects itself), and one that is cheaper per step than
# the choice is refreshed every UNTRUSTED_REFRESH_EVERY steps whatever its rate (one step of it forgoes at
# most the tokens a dearer step would have added). On a CPU the demo pair's first two depth-0 steps at batch
# 1 once ran in a slow stretch (12.4 ms against 7.5): chains of three drafted every run after that, never
# re-timing depth 0, at 0.93-0.96x plain (bench/results/cpu-demo-session13-sentinel/run-3.json).
UNTRUSTED_REFRESH_EVERY = 16
# A dormant step's cost is corrected only by dormant steps, and none runs at a batch size while its rows
# draft (dropping drafts is for good, so it cannot be re-run the way an option's cost is refreshed). A
# value learned in a slow stretch of the host then decides for as long as that size drafts: on an H200 the
# demo pair's dormant steps at batch 8 ran 0.51 ms in one slow run, and the runs at temperature 1 that
# followed kept their drafts and drafted chains of one at a_1 = 0.16-0.18 (0.5 ms a step, where plain
# decoding's took 0.33 ms: 0.70x plain). After DORMANT_STALE_STEPS of the policy's steps at a batch size
# without a dormant step there, the dormant step counts at no more than its start-up timing (the replay
# of its graph: the device work it does for sure). A batch whose drafting cannot beat that is demoted,
# and its dormant steps then time the cost afresh. Where the device bounds the step (the 8B shape on an
# H200) the start-up timing is close to the online cost and little changes.
DORMANT_STALE_STEPS = REFRESH_EVERY
# A dormant step timed at start-up (its graph replay) but never online counts at that timing scaled by what
# depth 0's online cost is to depth 0's start-up timing: online steps carry the host's work, which a replay
# does not. On an H200 the demo pair's batches of 32 always hold a sentinel, so no dormant step ever ran
# there: its 0.2 ms replay stood against host-bound steps of about 0.6 ms, and greedy requests that accept
# 2.5 tokens a chain of three ran dormant (1.03x plain where fixed depth ran 1.52x). Measured with this rule
# the same case still ran mostly undrafted (1.01x plain, fixed 1.48x): something else keeps it there, not
# yet found; elsewhere the grid and the demo pair at T 1 kept their targets. And a dormant step never
# counts above a depth-0 step (a subset of its work): on a CPU one slow run left a batch-1 dormant step at
# 7.1 ms against depth 0's 6.0, and the next request kept its draft for a whole run (0.91x plain).
# After a depth-0 choice, the same batch (the same requests, no observation since) gets depth 0 again for
# this many steps without the full pass (`repeat_depth0`), unless a probe or refresh falls due. The pass
# took 139 us a step at batch 32 on an H200's host (a tenth of the demo pair's host-bound step), mostly for
# a batch of dormant rows and its one sentinel, whose answer is depth 0 step after step. What the repeat
# leaves out is costs drifting (a moving average, 5% a step) and the rows' remaining tokens falling (which
# only makes drafting worth less).
REPEAT_DEPTH0_STEPS = 8
# An online step time counts at most OUTLIER_RATIO times its option's cost so far. Slow steps that are no
# option's doing land on whichever option ran then: the last step of a batch waits about two steps (9.5 ms
# against 4.75 in the H200's 8B-shape traces) and host stalls hit the demo pair's 0.25 ms steps (one of
# 2.15 ms), mostly at depth 0 (drafts are worth nothing on a batch's last tokens), whose cost on the demo
# pair then read 0.36-0.42 ms at batch 1-8 where its steps took 0.25. A real rise still shows: 25% times
# the weight a step.
OUTLIER_RATIO = 1.25
# The sampling mode of greedy steps without penalties, logprobs or a grammar: its cost tables are keyed by the
# padded batch size alone (`cost_table`). The name is the sampler's for that combination (layers/sampler.py).
GREEDY_MODE = "greedy"


@dataclass
class _RequestRates:
    """One request's acceptance: its a_1..a_D, the observations behind each and the hits among them, by
    position whether its own evidence there excluded its class's rate when last observed (REQUEST_EVIDENCE_Z),
    its drafting steps, and its expected tokens at depth 0..D (None once a new observation made them stale)."""

    rates: list[float]
    seen: list[int]
    hits: list[int]
    outside: list[bool]
    drafting_steps: int = 0
    expected: list[float] | None = None


@dataclass
class _Cohort:
    """Requests admitted together, drafting, into a batch that finishes together: the ones still running, and
    the lowest expected tokens by depth among those finished so far (None before the first)."""

    key: tuple  # (sampled?, padded batch)
    running: set
    slowest: list[float] | None = None


class _ClassRates:
    """The engine-wide acceptance of one sampling class (greedy or sampled requests): a_1..a_D, the
    observations behind each, the tree's mean accept length, and caches of what follows from them.
    Requests without enough history of their own take their class's: on an H200 the demo pair accepts
    2.4-2.6 tokens a chain of three greedy and 1.3 at temperature 1, and with one engine-wide estimate the
    greedy requests that followed sampled traffic drafted nothing (0.84-0.91x plain at batch 8 and 32, where
    fixed depth ran 1.39x at 32)."""

    def __init__(self, num_steps: int, prior: float):
        self.acceptance = [prior] * num_steps  # a_1..a_D
        self.seen = [0] * num_steps  # observations of each position
        self.expected: list[float] | None = None  # expected_by_depth(effective()), None when stale
        self.spread: tuple | None = None  # (expected, spread_by_depth) of it, None when stale
        self.tree_tokens = 1.0 + sum(prior ** j for j in range(1, num_steps + 1))  # mean tree accept length
        self.tree_seen = 0
        self.learning_probe_at = -1  # observations of position 1 when the last learning probe ran

    def effective(self) -> list[float]:
        """a_1..a_D as the choice uses them: a position never observed takes the rate of the one before it
        (acceptance falls slowly with depth), not the prior. With the prior (0.6) a batch of 64 at
        acceptance 0.95 chose chains of one (a_1 learned, a_2 and a_3 never drafted): deeper chains looked
        worse than they were, and at that batch a probe of the deepest came once per 85 steps (its 0.5%
        budget), after the run had ended (0.89x fixed depth on an H200)."""
        out = list(self.acceptance)
        for j in range(1, len(out)):
            if self.seen[j] == 0:
                out[j] = out[j - 1]
        return out


def wilson_interval(hits: int, tries: int, z: float) -> tuple[float, float]:
    """The Wilson score interval of a rate from `hits` of `tries` (z: its one-sided quantile); (0, 1) with
    no tries."""
    if tries == 0:
        return 0.0, 1.0
    a, n = hits / tries, tries
    centre = a + z * z / (2 * n)
    spread = z * math.sqrt(a * (1 - a) / n + z * z / (4 * n * n))
    scale = 1 + z * z / n
    return max(0.0, (centre - spread) / scale), min(1.0, (centre + spread) / scale)


def spread_by_depth(rates: list[float]) -> list[float]:
    """The standard deviation of one step's tokens at depth 0..D. With S_k = a_1 ... a_k (S_0 = 1) the
    chance of at least k + 1 tokens, E[T] = sum S_k and E[T^2] = sum (2k + 1) S_k over k = 0..d."""
    out, run, mean, square = [0.0], 1.0, 1.0, 1.0
    for k, a in enumerate(rates, start=1):
        run *= a
        mean += run
        square += (2 * k + 1) * run
        out.append(math.sqrt(max(0.0, square - mean * mean)))
    return out


def expected_max_of_normals(n: int) -> float:
    """E[max of n standard normals], Blom's approximation (n = 2: 0.59, exact 0.56; n = 64: 2.34, exact
    2.41); 0 for one."""
    return 0.0 if n < 2 else NormalDist().inv_cdf((n - 0.375) / (n + 0.25))


def expected_by_depth(rates: list[float]) -> list[float]:
    """[1, 1 + a_1, 1 + a_1 + a_1 a_2, ...]: the expected tokens of one step at depth 0..D."""
    out, run, tokens = [1.0], 1.0, 1.0
    for a in rates:
        run *= a
        tokens += run
        out.append(tokens)
    return out


class DraftShape(NamedTuple):
    """What one step drafts: a chain of `depth` tokens, or the configured tree. A named tuple: the policy
    keys its tables by shape every step, and a frozen dataclass's generated hash and equality were a third
    of its host time (choose took 49 us at batch 4 on a CI CPU)."""

    depth: int
    tree: bool = False

    @property
    def name(self) -> str:
        return "tree" if self.tree else f"chain{self.depth}"

    @property
    def drafts(self) -> bool:
        """False for depth 0: the target verifies the root alone and the draft extend is deferred
        (speculative/catch_up.py)."""
        return self.tree or self.depth > 0


class DepthPolicy:
    def __init__(self, num_steps: int, tree: bool, decay: float = 0.05, min_request_obs: int = 8,
                 probe_every: int = 32, probe_budget: float = 0.005, prior: float = 0.6, prior_weight: float = 1.0,
                 hysteresis: float = 0.03, dormancy: bool = True):
        """decay: weight of each new observation in the averages; min_request_obs: observations before a
        request's own acceptance replaces the engine's; probe_every, probe_budget: while a shorter option
        than the deepest is chosen, the deepest runs once every probe_every steps of a batch size, or
        less often, so that probes cost at most probe_budget of the time (they keep the acceptance of
        the positions the choice does not draft known; at 1% they were a third of what a depth-0 run
        lost to plain decoding on an H200, 8B shape, batch 1); prior: the acceptance assumed
        before any observation, worth prior_weight observations (one early rejection must not look like
        a rate of 0); hysteresis: how much better (relative) another option must look before the choice
        for a batch size moves (measured costs are noisy); dormancy: whether `admit` may admit requests
        dormant (off under tensor parallelism, whose ranks must agree on every request's draft state)."""
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

    def _class(self, sampled: bool | None) -> _ClassRates:
        """A sampling class's rates; None: the class observed most (the traffic's, for reports)."""
        if sampled is None:
            greedy, other = self.rates_by_class[False], self.rates_by_class[True]
            return other if other.seen[0] > greedy.seen[0] else greedy
        return self.rates_by_class[sampled]

    def _class_of(self, request_id) -> _ClassRates:
        return self.rates_by_class[request_id in self.sampled]

    def _batch_class(self, request_ids) -> _ClassRates:
        """The class of most of a batch's rows (for what is judged batch-wide: learning probes, stragglers)."""
        sampled = len(self.sampled.intersection(request_ids)) if self.sampled else 0
        return self.rates_by_class[2 * sampled > len(request_ids)]

    @property
    def acceptance(self) -> list[float]:
        """The engine's a_1..a_D (of the class observed most)."""
        return self._class(None).acceptance

    @property
    def _seen(self) -> list[int]:
        return self._class(None).seen

    def effective_acceptance(self, sampled: bool | None = None) -> list[float]:
        """A class's a_1..a_D as the choice uses them (`_ClassRates.effective`); None: the class observed most."""
        return self._class(sampled).effective()

    # ---- what the engine tells it ----------------------------------------------------------------------
    def observe_accept(self, request_id: str, shape: DraftShape, accept_len: int) -> None:
        """One verify step of one request: accept_len tokens (accepted drafts + 1) from `shape`."""
        self.observe_step(shape, [request_id], [accept_len])

    def observe_step(self, shape: DraftShape, request_ids, accept_lens) -> None:
        """One verify step: accept_lens[i] tokens (accepted drafts + 1) for request_ids[i], from `shape`.

        The engine's averages move once a step, towards the step's own rate at each position (hits over
        tries; a mean with the prior and the steps before while there are few observations). Moved once
        an observation, a 5% moving average remembered about 20 rows, less than one step of a big batch:
        at batch 128, acceptance 0.95, the rate of position 3 read 0.83 after one step (the last rows of
        that step), which chose chains of two for the rest of a replayed run, that position no longer
        drafted. Dormant rows teach nothing: their drafts come from no state. Each row teaches its own
        sampling class (`_ClassRates`)."""
        rows = [(rid, k) for rid, k in zip(request_ids, accept_lens) if rid not in self.dormant]
        if not rows or not shape.drafts:
            return  # nothing drafted, nothing observed
        self._repeatable.clear()
        by_class: dict[bool, list] = {}
        for row in rows:
            by_class.setdefault(row[0] in self.sampled, []).append(row)
        for sampled, part in by_class.items():
            self._observe_class(self.rates_by_class[sampled], shape, part)

    def _observe_class(self, cls: _ClassRates, shape: DraftShape, rows) -> None:
        """`observe_step` for rows [(request id, accept length)] of one sampling class."""
        if shape.tree:
            mean = sum(k for _, k in rows) / len(rows)
            cls.tree_tokens += self._step_weight(cls.tree_seen, len(rows)) * (mean - cls.tree_tokens)
            cls.tree_seen += len(rows)
            return
        depth, engine, seen = shape.depth, cls.acceptance, cls.seen
        assumed = cls.effective()  # what the choice assumed so far, for positions seen first now
        hits, tries = [0] * depth, [0] * depth
        # A request's own rates start from the engine's, worth prior_weight observations, and are then
        # weighted as the engine's are (a slow moving average from the start kept the prior for dozens of
        # steps, and a request that never accepted a draft kept drafting).
        decay, own_offset = self.decay, 1 + self.prior_weight  # (inlined: this runs per request per step)
        enough, intervals = self.min_request_obs, self._intervals
        for rid, accept_len in rows:
            req = self._requests.get(rid)
            if req is None:
                d = self.num_steps
                req = self._requests[rid] = _RequestRates(list(assumed), [0] * d, [0] * d, [False] * d)
            own, own_seen, own_hits, outside = req.rates, req.seen, req.hits, req.outside
            # Positions 1..accept_len-1 were accepted; position accept_len was tried and rejected (if drafted).
            for j in range(min(accept_len, depth)):
                if own_seen[j] == 0:
                    own[j] = assumed[j]
                hit = j + 1 < accept_len
                tries[j] += 1
                hits[j] += hit
                own_hits[j] += hit
                own[j] += max(decay, 1.0 / (own_seen[j] + own_offset)) * (hit - own[j])
                own_seen[j] += 1
                if own_seen[j] < enough:  # (its own rate does not count yet: does its evidence move its class's?)
                    low, high = intervals[own_seen[j]][own_hits[j]]
                    outside[j] = not low <= assumed[j] <= high
            req.drafting_steps += 1
            req.expected = None
        for j in range(depth):
            if not tries[j]:
                break  # (tries fall with depth: no row reached this position, none the next)
            if seen[j] == 0:
                engine[j] = assumed[j]
            engine[j] += self._step_weight(seen[j], tries[j]) * (hits[j] / tries[j] - engine[j])
            seen[j] += tries[j]
        cls.expected = cls.spread = None

    def _step_weight(self, seen: int, new: int) -> float:
        """The weight of a step's mean over `new` observations, after `seen` before it: the running mean
        with the prior (as prior_weight observations) while that weighs more than the decay."""
        return max(self.decay, new / (seen + new + self.prior_weight))

    def observe_time(self, padded_batch: int, shape: DraftShape, ms: float, weight: float | None = None,
                     mode: str = GREEDY_MODE) -> None:
        """One step's time. `weight` (start-up timing over several graph replays) sets a trusted value.
        Online, the first observation of an option at a batch size is often its warm-up (lazy
        initialisation, first-call allocation): the second replaces it, then a mean of the observations
        so far, then a moving average, each observation at most OUTLIER_RATIO times the cost so far."""
        key = (cost_table(padded_batch, mode), shape)
        old = self.cost_ms.get(key)
        count = self._time_seen.get(key, 0)
        if weight is not None:
            self.cost_ms[key] = self._startup_ms[key] = ms if old is None else old + weight * (ms - old)
            self._time_seen[key] = max(count, TRUSTED_OBSERVATIONS)
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
        self._time_seen[key] = count + 1

    def observe_catch_up(self, padded_batch: int, ms_per_deferred_step: float) -> None:
        """A catch-up's time per deferred step it can hold, for `padded_batch` catching-up rows: added to
        depth 0's cost (before, it was taken off the drafting step that ran it and charged to no option,
        so depth 0 looked cheaper than it is: by 4.5% on a CPU, where the draft costs a fifth of the
        target per token). The caller divides by the queries the catch-up ran (a graph always runs the
        whole window): divided by the lag instead, a catch-up forced by a probe a few steps after the
        last one charged depth 0 its whole cost for a few steps, and once that made a drafting option
        look cheaper, no depth-0 step ran again to correct it (on an H200 at batch 32, chains of one at
        acceptance 0, 0.6 ms a step over depth 0). Kept by padded batch alone: a catch-up runs the draft, the
        same work in every sampling mode."""
        old = self.catch_up_per_step_ms.get(padded_batch)
        new = ms_per_deferred_step
        self.catch_up_per_step_ms[padded_batch] = new if old is None else old + 0.2 * (new - old)

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

    def cost_row(self, padded_batch: int, mode: str = GREEDY_MODE) -> dict[str, float]:
        """The cost table at one padded batch size and sampling mode, by option name, and depth 0's catch-up
        share (ms; for reports)."""
        table = cost_table(padded_batch, mode)
        row = {shape.name: self.cost_ms[(table, shape)] for shape in self.options if (table, shape) in self.cost_ms}
        if padded_batch in self.catch_up_per_step_ms:
            row["catch_up_per_step"] = self.catch_up_per_step_ms[padded_batch]
        return row

    # ---- dormant admission -------------------------------------------------------------------------------
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
        """Admissions per sentinel for a request joining a batch of this table's padded size
        (SENTINEL_BUDGET)."""
        depth0 = self.cost_ms.get((table, self.options[0]))
        if depth0 is None:
            return SENTINEL_EVERY
        rows = _rows(table)
        dormant = self.dormant_step_ms(table, depth0)
        upkeep = depth0 + self.catch_up_per_step_ms.get(rows, 0.0) - dormant
        return max(SENTINEL_EVERY, math.ceil(rows * upkeep / max(dormant, 1e-6) / SENTINEL_BUDGET))

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

    def demote(self, request_ids, padded_batch: int, mode: str = GREEDY_MODE) -> list[str]:
        """The requests of a running batch that should drop their draft state now: every one but the
        sentinels, once drafting cannot pay at this batch (the test `admit` makes). Those admitted while
        drafting still looked worth it otherwise kept paying the draft's upkeep (catch-ups, and a batch of
        dormant rows alone runs plain decoding's cheaper step) for the rest of their run: on an H200 the
        demo pair at temperature 1 went dormant at admission only from its fourth run of a batch size.
        Dropping is for good (a dormant request never gets its draft state back). Each sampling class is
        judged at its own acceptance, at the cost table of the batch's sampling mode `mode`."""
        if not self.dormancy:
            return []
        table = cost_table(padded_batch, mode)
        keeping = [rid for rid in request_ids if rid not in self.dormant and rid not in self.sentinels]
        dropped = []
        for sampled in (False, True):
            rows = [rid for rid in keeping if (rid in self.sampled) == sampled]
            if (rows and self._evidence_enough(table, sampled)
                    and self._drafting_cannot_pay(table, sampled=sampled)):
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

    def observe_draft_prefill(self, tokens: int, ms: float) -> None:
        """One step's draft prefill: `ms` for `tokens` prompt tokens."""
        self._draft_prefill.observe(tokens, ms)

    def _drafting_cannot_pay(self, table, upkeep_ms: float = 0.0, sampled: bool = False,
                             slowest: list[float] | None = None) -> bool:
        """Whether no drafting option beats a dormant row's step at this batch even if position 1's rate
        were as high as its observations allow (`optimistic_acceptance`), or, once position 1 has been
        observed DORMANT_SETTLED_OBSERVATIONS times or the batch has chosen depth 0 for
        DORMANT_SETTLED_STEPS steps, at the rates as estimated. A dormant row's step costs
        what a batch of dormant rows costs (plain decoding's step, `dormant_step_ms`).
        `upkeep_ms`: what keeping the drafts costs per step besides (new requests' draft prefill): drafting
        must then save that much of a dormant step's time to pay. At the acceptance of a sampling class
        (`sampled`); each depth's expected tokens at no more than `slowest`'s where given (the slowest row's,
        SLOWEST_ROW_REQUESTS_KEPT). `table`: the cost table (padded batch and sampling mode, `cost_table`)."""
        if any((table, shape) not in self.cost_ms for shape in self.options):
            return False
        costs = self._floored_costs(table)
        cls = self.rates_by_class[sampled]
        settled = (cls.seen[0] >= DORMANT_SETTLED_OBSERVATIONS
                   or self._undrafted_steps.get((sampled, table), 0) >= DORMANT_SETTLED_STEPS)
        as_estimated = expected_by_depth(cls.effective())
        rates = cls.effective() if settled else self.optimistic_acceptance(sampled)
        expected = expected_by_depth(rates)
        if slowest is not None:
            expected = [min(e, own) for e, own in zip(expected, slowest)]
        # The tree's accept length, scaled as much as optimism scales the deepest chain's.
        tree_tokens = cls.tree_tokens * expected[-1] / as_estimated[-1]
        dormant_step = self.dormant_step_ms(table, costs[self.options[0]])
        best_drafting = max((tree_tokens if shape.tree else expected[shape.depth]) / costs[shape]
                            for shape in self.options if shape.drafts)
        return best_drafting < 1.0 / max(dormant_step - upkeep_ms, 1e-6)

    def observe_dormant_time(self, padded_batch: int, ms: float, weight: float | None = None,
                             mode: str = GREEDY_MODE) -> None:
        """A step of dormant rows alone (plain decoding's step): its time, kept as the options' are (start-up
        timing with `weight`; online, a moving average clipped at OUTLIER_RATIO). Where nothing was timed at
        start-up (a CPU, a batch size without graphs) the first online step is often its warm-up, as an
        option's is (`observe_time`): the second replaces it, then a mean of the steps so far until the
        moving average weighs more. (Taken as it came, one warm-up step on a CPU left a batch-1 dormant
        step at 14.3 ms, where plain decoding's took 12: drafting then looked worth keeping.) In the sampling
        mode's table (`mode`), as the options' costs."""
        table = cost_table(padded_batch, mode)
        old = self.dormant_cost_ms.get(table)
        if weight is not None:
            self._dormant_startup_ms[table] = ms
            self.dormant_cost_ms[table] = ms if old is None else old + weight * (ms - old)
            return
        self._dormant_timed_at[table] = self._steps.get(table, 0)
        count = self._dormant_timed.get(table, 0)  # online steps before this one
        self._dormant_timed[table] = count + 1
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
        """What a step of dormant rows alone costs at this batch as the choice counts it, at no more than a
        depth-0 step's cost there (it does a subset of that step's work: no draft features kept, nothing
        deferred). Its online timing, at no more than its start-up timing once DORMANT_STALE_STEPS of the
        policy's steps passed there since it was last timed online (see DORMANT_STALE_STEPS); never timed
        online, its start-up timing scaled as depth 0's online cost has moved from depth 0's own start-up
        timing (the note after DORMANT_STALE_STEPS); `untimed` where it was never timed at all. `table`: padded
        batch and sampling mode (`cost_table`)."""
        depth0 = self.cost_ms.get((table, self.options[0]))
        ms = self.dormant_cost_ms.get(table)
        startup, timed_at = self._dormant_startup_ms.get(table), self._dormant_timed_at.get(table)
        if ms is None:
            ms = untimed
        elif timed_at is None:  # (start-up timing alone)
            ms = self._scaled_startup_dormant_ms(table)
        elif startup is not None and self._steps.get(table, 0) - timed_at >= DORMANT_STALE_STEPS:
            ms = min(ms, startup)
        return ms if depth0 is None else min(ms, depth0)

    def _scaled_startup_dormant_ms(self, table) -> float:
        """The dormant step's start-up timing times depth 0's online cost over depth 0's start-up timing (the
        note after DORMANT_STALE_STEPS); as it is where depth 0 has no start-up timing."""
        key = (table, self.options[0])
        startup, depth0_startup = self._dormant_startup_ms[table], self._startup_ms.get(key)
        if not depth0_startup:
            return startup
        return startup * self.cost_ms[key] / depth0_startup

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

    # ---- the choice ------------------------------------------------------------------------------------
    def _expected_of(self, request_id) -> list[float]:
        """A request's expected tokens at depth 0..D: at each position its own rate once it has observed
        that position min_request_obs times, before that its class's moved into the request's own Wilson
        interval there (REQUEST_EVIDENCE_Z; cached until its next observation). A
        deep position is observed only when the ones before it were accepted (at acceptance 0.6, a third
        of the steps reach position 3): gated on its drafting steps alone, a request's rate there came
        from two or three observations, and a chance run of rejections made its deep drafts look
        worthless until a probe. Replayed with the H200's batch-8 costs at acceptance 0.6 (where chains
        of three pay), six runs drafted shorter chains on 10.2 of 37 steps on average; 3.0 with this gate and
        the engine's averages moved once a step (observe_step), 1.3 with engine-wide rates only."""
        if request_id in self.dormant:
            return self._accept_nothing
        req = self._requests.get(request_id)
        if req is None or (req.drafting_steps < self.min_request_obs and True not in req.outside):
            cls = self._class_of(request_id)  # (the usual case, and the cheap one: the class's, cached there)
            if cls.expected is None:
                cls.expected = expected_by_depth(cls.effective())
            return cls.expected
        if req.expected is None:
            enough = self.min_request_obs if req.drafting_steps >= self.min_request_obs else math.inf
            rates = []
            for own, n, h, e in zip(req.rates, req.seen, req.hits, self._class_of(request_id).effective()):
                if n >= enough:
                    rates.append(own)
                else:  # too few observations to go by its own rate: its class's, as far as its own allow
                    low, high = self._intervals[n][h]  # (n < min_request_obs here)
                    rates.append(low if e < low else high if e > high else e)
            req.expected = expected_by_depth(rates)
        return req.expected

    def expected_tokens(self, request_ids, shape: DraftShape) -> float:
        """Sum over the batch of each request's expected tokens from one step of `shape`."""
        if shape.tree:
            return sum(1.0 if rid in self.dormant else self._class_of(rid).tree_tokens for rid in request_ids)
        return sum(self._expected_of(rid)[shape.depth] for rid in request_ids)

    def choose(self, request_ids, padded_batch: int, mode: str = GREEDY_MODE, prefill_rows: int = 0,
               catch_up_batch: int | None = None, remaining: list[int] | None = None,
               finish_together: list[bool] | None = None, catch_up_forced: bool = False) -> DraftShape:
        """The option with the most expected tokens per ms at this padded batch size. An option never timed at this
        size is chosen first (it gets timed); a probe of the deepest option now and then keeps the acceptance
        beyond the chosen depth known while shorter options win. `mode`: the step's sampling mode
        (`layers.sampler.step_mode`; each has a cost table of its own). `prefill_rows`: requests whose prompt
        chunks share the step; they count as rows that accept nothing (one token's worth each), because drafting
        lengthens their step too and delays their first token (on an H200 at batch 128, drafting in the prompt-
        processing steps cost 20-45 ms of time to first token). `catch_up_batch`: the padded size of the rows
        that defer at depth 0 (dormant ones do not; 0: none), default the batch's. `remaining`: per request, the
        tokens it may still emit (max_new_tokens less its outputs, an upper bound): a step yields at most that
        many, so drafts past it are counted as worth nothing (they would be accepted and dropped).
        `finish_together`: per request, whether it runs exactly its `remaining` tokens (no EOS or stop can end
        it) in a batch that nothing queued will refill: the batch is then done when the slowest of them is (see
        `_straggler_factors`). `catch_up_forced`: a drafting step now would first run a catch-up that a depth-0
        step would not (rows have deferred extends, short of a full window): while depth 0 is chosen, probes and
        refreshes then wait for the step whose catch-up is due anyway (at most a window of steps), so they cost
        their own extra time only. Each one forced a catch-up of its own before: at batch 32, acceptance 0.3 on
        an H200 a probe and a refresh took 3.3 and 2.5 ms over a depth-0 step, 1.2 ms of each a catch-up."""
        self._close_cohorts()
        table = cost_table(padded_batch, mode)
        untimed = [s for s in self.options if (table, s) not in self.cost_ms]
        if untimed:
            return untimed[-1]
        # The batch's expected tokens at every chain depth in one pass, from cached per-request sums
        # (this runs on the host every step; a loop over requests per option took 47 us at batch 32
        # on a CI CPU, against a demo-pair iteration of 0.74 ms on an H200).
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
            # step of the deepest would more than double what it knows: a learning probe. The prior
            # (0.6) under the straggler charge keeps a batch of 128 at depth 0, and at that batch a
            # regular probe comes once per 290 steps: at acceptance 0.95 a whole 64-token run went
            # undrafted (0.87x fixed depth on an H200). One probe there costs 2% of such a run.
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

    def _slowest_rows_progress(self, per_request, tree_each, remaining, cls: _ClassRates) -> tuple[list[float], float]:
        """For a drained batch of fixed-length rows (nothing queued, no row can end early): the batch is done
        when its slowest row is, so what a step is worth is the progress of the rows that can still end
        last (those within one deepest step's tokens of the most remaining), their mean expected tokens
        over the straggler factor of that many rows: by chain depth 0..D, and the tree's. Tokens of rows
        about to finish are worth nothing here: summed with the others (the throughput view, right while
        new requests take the freed slots), a batch of 64 with 1-13 tokens left chose depth 0, and the
        rows with 13 took 13 more steps (a replay of acceptance 0.95, batch 128: 12 of 28 steps undrafted
        where fixed depth needed 20 steps in all)."""
        most = max(remaining)
        last = [i for i, left in enumerate(remaining) if left > most - (self.num_steps + 1)]
        factors = self._straggler_factors(len(last), most, cls)
        n = len(last)
        columns = zip(*[per_request[i] for i in last])  # (column sums: a generator per depth cost 20 us at batch 32)
        chain = [sum(column) / (n * factor) for column, factor in zip(columns, factors)]
        tree = sum(tree_each[i] for i in last) / (n * factors[-1])
        return chain, tree

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

    def _straggler_factors(self, rows: int, remaining: int, cls: _ClassRates) -> list[float]:
        """By depth 0..D: how much longer than its mean a batch of `rows` requests that each need
        `remaining` more tokens takes to finish, when it finishes with its slowest request. At depth d a
        request needs R / E steps on average (E: expected tokens a step), with a spread of
        sd sqrt(R / E) / E (sd: of one step's tokens); the slowest of n needs about
        R / E (1 + z_n sd / sqrt(R E)), z_n the expected max of n standard normals. Plain decoding
        (depth 0) needs exactly R steps. On an H200 at acceptance 0.3, batch 64, a chain of one took
        51-56 steps for 64 tokens where the mean asks 49 (the formula: 55), which turned a 7% gain per
        step into a loss; at acceptance 0.6, batch 128, 41-45 steps against 40 (formula: 45). From the
        acceptance of the batch's class `cls` (a request's own would cost a pass over the batch per step)."""
        if cls.spread is None:
            rates = cls.effective()
            cls.spread = expected_by_depth(rates), spread_by_depth(rates)
        expected, spread = cls.spread
        z = self._max_of_normals.get(rows)
        if z is None:
            z = self._max_of_normals[rows] = expected_max_of_normals(rows)
        return [1.0 + z * sd / math.sqrt(max(remaining, 1) * e) for e, sd in zip(expected, spread)]

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
        """Each option's cost at this table, a drafting option's at no less than its start-up timing (a graph
        replay: device work alone) plus what depth 0's online cost adds to depth 0's own start-up timing (the
        host's work, which a drafting step does all of and more). Every option must be timed.

        Options that seldom run keep costs from their replays or from another stretch of the host, while depth
        0 and the dormant step are timed all along: on an H200 the demo pair at batch 32 kept a chain of two at
        0.64 ms (its replay 0.50) against a depth-0 step of 0.66 and a dormant step of 0.79, so requests at
        temperature 1 (a_1 = 0.14-0.2) were admitted drafting and ran 0.77-0.91x plain decoding
        (bench/results/sampling_demo_h200_session15_ab_*.json). With the floor that chain counts at 0.95 ms."""
        costs = {shape: self.cost_ms[(table, shape)] for shape in self.options}
        depth0 = self.options[0]
        depth0_startup = self._startup_ms.get((table, depth0))
        if depth0_startup is None:
            return costs  # (nothing replayed at start-up: every cost is an online one)
        host = max(0.0, costs[depth0] - depth0_startup)
        for shape in self.options[1:]:
            startup = self._startup_ms.get((table, shape))
            if startup is not None:
                costs[shape] = max(costs[shape], startup + host)
        return costs

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

    def _probe_interval(self, table, chosen: DraftShape, probe: DraftShape) -> int:
        """Steps between probes: probe_every, or more where one probe step costs more than probe_budget
        of probe_every chosen steps."""
        cost = self.cost_ms[(table, chosen)]
        extra = max(0.0, self.cost_ms[(table, probe)] - cost)
        return max(self.probe_every, math.ceil(extra / (self.probe_budget * cost)))


def _order_statistic_by_depth(expected_rows, at: int) -> list[float]:
    """At each depth, the `at`-th smallest of the rows' expected tokens there."""
    return [sorted(column)[at] for column in zip(*expected_rows)]


def cost_table(padded_batch: int, mode: str):
    """A cost table's key: the padded batch size for greedy steps, (mode, size) for every other sampling mode
    (`layers.sampler.step_mode`)."""
    return padded_batch if mode == GREEDY_MODE else (mode, padded_batch)


def _rows(table) -> int:
    """A cost table's padded batch size."""
    return table if isinstance(table, int) else table[1]
