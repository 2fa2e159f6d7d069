"""Adaptive speculation: each step, the draft shape that maximises expected tokens per second.

The options are chains of depth d = 0, 1, ..., num_steps (d = 0: plain decoding's step, whose draft extend
is deferred and caught up before the next drafting step, speculative/catch_up.py) and, when the configured
drafting is a tree (topk > 1), that tree. `DepthPolicy` picks the option with the most expected tokens per
millisecond for the batch about to run. By concern:

- shape.py: `DraftShape`, what one step drafts.
- acceptance.py: the acceptance of each draft position, engine-wide per sampling class (greedy, sampled)
  and per request, and the expected tokens by depth that follow.
- costs.py: each option's step time per padded batch size and sampling mode (`cost_table`), and the
  corrections that keep a stale or noisy cost from deciding (outliers, floors, refreshes).
- dormancy.py: requests admitted (or demoted) without draft state where drafting cannot pay, and the
  sentinels that keep acceptance measured.
- cohorts.py: batches that finish together, judged at their slowest row's pace.
- choice.py: `DepthPolicy` itself, the choice each step, its probes and its repeats of depth 0.

Nothing here changes what is generated: every option emits the target's own tokens (speculative/verify.py).
Only the steps' cost and the accept lengths depend on the choice. Pure Python: unit-tested with hand-made
cost tables. docs/speculative.md ("Adaptive depth") gives the rules and their reasons for users.
"""

# What users of the policy import, each from the module that owns it.
from tandem.speculative.policy.acceptance import (REQUEST_EVIDENCE_Z, _ClassRates, _RequestRates, expected_by_depth,
                                                  expected_max_of_normals, spread_by_depth, wilson_interval)
from tandem.speculative.policy.choice import REPEAT_DEPTH0_STEPS, DepthPolicy
from tandem.speculative.policy.cohorts import (COHORTS_KEPT, SLOWEST_ROW_MIN_REQUESTS, SLOWEST_ROW_REQUESTS_KEPT,
                                               _Cohort, _order_statistic_by_depth)
from tandem.speculative.policy.costs import (GREEDY_MODE, OUTLIER_RATIO, REFRESH_EVERY, REFRESH_MARGIN, REFRESH_WEIGHT,
                                             TRUSTED_OBSERVATIONS, UNTRUSTED_REFRESH_EVERY, _rows, cost_table)
from tandem.speculative.policy.dormancy import (DORMANT_CONFIDENCE_Z, DORMANT_MIN_OBSERVATIONS,
                                                DORMANT_POPULATION_MIN_REQUESTS, DORMANT_POPULATION_REQUESTS,
                                                DORMANT_SETTLED_OBSERVATIONS, DORMANT_SETTLED_STEPS,
                                                DORMANT_STALE_STEPS, SENTINEL_BUDGET, SENTINEL_EVERY)
from tandem.speculative.policy.shape import DraftShape
