"""What the policy knows of acceptance: the rate of each draft position given the one before it was
accepted, engine-wide per sampling class (`_ClassRates`) and per request (`_RequestRates`), and the
expected tokens by depth that follow from them."""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist

from tandem.speculative.policy.shape import DraftShape

# Before a request has min_request_obs observations of a position, its class's rate there is moved into the
# request's own one-sided 95% Wilson interval: four rejections in a row put position 1 at 0.40 at most.
REQUEST_EVIDENCE_Z = 1.64


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


def expected_by_depth(rates: list[float]) -> list[float]:
    """[1, 1 + a_1, 1 + a_1 + a_1 a_2, ...]: the expected tokens of one step at depth 0..D."""
    out, run, tokens = [1.0], 1.0, 1.0
    for a in rates:
        run *= a
        tokens += run
        out.append(tokens)
    return out


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


class _ClassRates:
    """The engine-wide acceptance of one sampling class (greedy or sampled requests): a_1..a_D, the
    observations behind each, the tree's mean accept length, and caches of what follows from them.
    Requests without enough history of their own take their class's. Kept apart because greedy requests
    accept far more than sampled ones (the demo pair on an H200: 2.4-2.6 tokens a chain of three against
    1.3 at temperature 1), and one engine-wide estimate would judge each kind by the other's traffic."""

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
        (acceptance falls slowly with depth), not the prior: at a high a_1 the prior would make the deeper
        chains look worse than they are, and at a big batch the next probe of them may come after the run."""
        out = list(self.acceptance)
        for j in range(1, len(out)):
            if self.seen[j] == 0:
                out[j] = out[j - 1]
        return out


class AcceptanceEstimates:
    """DepthPolicy's acceptance estimates: what verify steps teach, and each request's expected tokens by
    depth. State (set in DepthPolicy.__init__ and reset_acceptance): rates_by_class, _requests, sampled,
    dormant, _intervals, _accept_nothing; an observation clears _repeatable."""

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

    def observe_accept(self, request_id: str, shape: DraftShape, accept_len: int) -> None:
        """One verify step of one request: accept_len tokens (accepted drafts + 1) from `shape`."""
        self.observe_step(shape, [request_id], [accept_len])

    def observe_step(self, shape: DraftShape, request_ids, accept_lens) -> None:
        """One verify step: accept_lens[i] tokens (accepted drafts + 1) for request_ids[i], from `shape`.

        The engine's averages move once a step, towards the step's own rate at each position (hits over
        tries; a mean with the prior and the steps before while there are few observations). Moved once
        an observation, a 5% moving average would remember about 20 rows, less than one step of a big
        batch, and that step's last rows would decide. Dormant rows teach nothing: their drafts come from
        no state. Each row teaches its own sampling class (`_ClassRates`)."""
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
        # weighted as the engine's are (a slow moving average from the start would hold the prior for dozens
        # of steps, and keep a request that never accepts a draft drafting).
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

    def _has_own_rates(self, req: _RequestRates | None) -> bool:
        """Whether `_expected_of` goes by the request's own observations (any of them) rather than its class's."""
        return req is not None and (req.drafting_steps >= self.min_request_obs or True in req.outside)

    def _expected_of(self, request_id) -> list[float]:
        """A request's expected tokens at depth 0..D: at each position its own rate once it has observed
        that position min_request_obs times, before that its class's moved into the request's own Wilson
        interval there (REQUEST_EVIDENCE_Z; cached until its next observation). Counted by position, not by
        drafting steps: a deep position is observed only when the ones before it were accepted (at
        acceptance 0.6, a third of the steps reach position 3), so after a few drafting steps its rate
        rests on two or three observations, and a chance run of rejections would make deep drafts look
        worthless until a probe."""
        if request_id in self.dormant:
            return self._accept_nothing
        req = self._requests.get(request_id)
        if not self._has_own_rates(req):
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
