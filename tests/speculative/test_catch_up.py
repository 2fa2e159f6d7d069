"""Depth-0 steps defer the draft extend; a catch-up runs the draft over the deferred tokens at once
(speculative/catch_up.py). Checked three ways: every catch-up leaves the draft's state (KV, next top-k,
hidden, entry count) equal to the slow reference, one single-token extend per deferred token and per
request; greedy output stays plain greedy output through long runs of depth 0, overflowing the lag
buffer; and a draft that is the target itself accepts every draft right after a catch-up."""

import pytest
import torch

from tandem import Engine, SamplingParams
from tandem.speculative import plan
from tandem.speculative.catch_up import CATCH_UP_WINDOW
from tandem.speculative.drafter import Drafter
from tandem.speculative.policy import DepthPolicy
from tests.speculative.conftest import CHAIN, ENGINE, TREE
from tests.speculative.scripted_policy import ScriptedChoice
from tests.speculative.test_spec_greedy import NEW_TOKENS, PROMPTS, reference  # noqa: F401 (fixture)

ZEROS_RUN = CATCH_UP_WINDOW + 3  # longer than the lag buffer: forces catch-ups between depth-0 steps


class ScriptedPolicy(ScriptedChoice):
    """Depth 0 for `zeros_run` steps, then the deepest option once, and again."""

    def __init__(self, base: DepthPolicy, zeros_run: int = ZEROS_RUN):
        super().__init__(base)
        self.zeros_run = zeros_run

    def script(self, **engine_says):
        return self.deepest if self.turn % (self.zeros_run + 1) == 0 else self.options[0]


def reference_catch_up(drafter: Drafter, slots, page_rows, kv_bound: int) -> None:
    """What the deferred extends would have done: per request, one extend per deferred token."""
    pool = drafter.pool
    for r in range(slots.shape[0]):
        slot, rows = slots[r:r + 1], page_rows[r:r + 1]
        for j in range(int(pool.lag[slot])):
            first = pool.draft_entries[slot].clone()
            metadata = plan.extend_metadata(rows, first, 1, kv_bound, drafter.page_size)
            feats = pool.lag_features[slot, j][:, None] if pool.lag_features is not None else None
            drafter.extend(slot, metadata, pool.lag_tokens[slot, j][:, None], feats,
                           torch.ones(1, dtype=torch.long), first)
        pool.lag[slot] = 0


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


STATE = ("draft_entries", "topk_ids", "topk_logp", "draft_hidden", "lag")


def snapshot(drafter: Drafter) -> dict:
    pool = drafter.pool
    return {"pool": {n: getattr(pool, n).clone() for n in STATE},
            "k": [t.clone() for t in drafter.kv_cache.k], "v": [t.clone() for t in drafter.kv_cache.v]}


def restore(drafter: Drafter, snap: dict) -> None:
    for n, t in snap["pool"].items():
        getattr(drafter.pool, n).copy_(t)
    for dst, src in zip(drafter.kv_cache.k + drafter.kv_cache.v, snap["k"] + snap["v"]):
        dst.copy_(src)


@pytest.mark.parametrize("kind", ["EAGLE", "EAGLE3", "STANDALONE"])
@pytest.mark.parametrize("shape", [CHAIN, TREE], ids=["chain", "tree"])
def test_catch_up_equals_one_extend_per_token_and_keeps_greedy_output(spec_models, reference, kind, shape,
                                                                       monkeypatch):
    checked, windows = [], []
    real_catch_up = Drafter.catch_up

    def checked_catch_up(self, slots, page_rows, kv_bound, sink_slot, window=None):
        before = snapshot(self)
        lags = self.pool.lag[slots].tolist()
        reference_catch_up(self, slots, page_rows, kv_bound)
        want = snapshot(self)
        restore(self, before)
        real_catch_up(self, slots, page_rows, kv_bound, sink_slot, window)
        windows.append(window)
        got = snapshot(self)
        rows = slots[self.pool.lag.new_tensor(lags) > 0]
        for name in STATE:
            a, b = got["pool"][name][rows], want["pool"][name][rows]
            if name == "topk_logp":  # log-probabilities near 0: an absolute bound
                assert (a - b).abs().max() < 1e-3, (name, (a - b).abs().max())
            elif a.is_floating_point():
                # float32; batched attention sums in another order than one query at a time
                assert relative_error(a, b) < 1e-5, (name, relative_error(a, b))
            else:
                assert torch.equal(a, b), name
        for a, b in zip(got["k"] + got["v"], want["k"] + want["v"]):
            # The sink slot takes the padded queries' KV; nobody reads it.
            assert relative_error(a[:sink_slot], b[:sink_slot]) < 1e-5
        checked.append(max(lags))

    monkeypatch.setattr(Drafter, "catch_up", checked_catch_up)
    alg = "STANDALONE" if kind == "SELF" else kind
    with Engine(spec_models["target"], speculative_algorithm=alg, speculative_draft_model_path=spec_models[kind],
                **shape, **ENGINE) as e:
        e.runner.spec.policy = ScriptedPolicy(e.runner.spec.policy)
        params = SamplingParams(max_new_tokens=3 * NEW_TOKENS, temperature=0.0, ignore_eos=True)
        outs = e.generate(input_ids=PROMPTS[:6], sampling_params=params)
        for i, (out, want) in enumerate(zip(outs, reference)):
            assert out.token_ids[:NEW_TOKENS] == want, f"{kind}: prompt {i} differs"
        assert e.scheduler.allocator.num_free + e.scheduler.allocator.num_cached == e.scheduler.allocator.num_total
    # Catch-ups ran, some of them with a full buffer (forced between depth-0 steps), each over as many
    # queries per row as the batch's largest lag (eager steps).
    assert checked and max(checked) == CATCH_UP_WINDOW, checked
    assert windows == checked, (windows, checked)


def test_target_as_its_own_draft_accepts_everything_after_a_catch_up(spec_models, reference):
    """A deferred extend replayed wrongly (a wrong position, token or feature) would make the self-draft
    propose tokens the target rejects; replayed rightly, every step that drafts accepts all it drafted."""
    with Engine(spec_models["target"], speculative_algorithm="STANDALONE", speculative_draft_model_path=spec_models["SELF"],
                **CHAIN, **ENGINE) as e:
        e.runner.spec.policy = ScriptedPolicy(e.runner.spec.policy, zeros_run=5)  # a catch-up before each draft
        params = SamplingParams(max_new_tokens=3 * NEW_TOKENS, temperature=0.0, ignore_eos=True)
        outs = e.generate(input_ids=PROMPTS[:4], sampling_params=params)
    for out, want in zip(outs, reference):
        assert out.token_ids[:NEW_TOKENS] == want
        drafting = [k for k in out.spec_accept_lengths if k > 1]
        deep = CHAIN["speculative_num_steps"] + 1
        # Every step that drafted was a full-depth step (the script), and accepted all of it, except the
        # last one, which can be cut short by max_new_tokens.
        assert drafting and all(k == deep for k in drafting[:-1]), out.spec_accept_lengths
        assert len(drafting) >= 3


class ProbeWhenFree(ScriptedChoice):
    """Depth 0, with a probe of the deepest due after every five depth-0 steps, run only at a step where it
    forces no catch-up of its own (`catch_up_forced` False), as the real policy's probes do."""

    def __init__(self, base: DepthPolicy):
        super().__init__(base)
        self.since_probe = 0

    def script(self, catch_up_forced=False, **engine_says):
        self.since_probe += 1
        if self.since_probe > 5 and not catch_up_forced:
            self.since_probe = 0
            return self.deepest
        return self.options[0]


def test_probes_at_depth_0_wait_for_a_full_lag_buffer(spec_models, reference, monkeypatch):
    """The engine says a drafting step is forced to catch up while a row's lag buffer holds some deferred
    extends but is not full: a probe that waits for that runs its catch-up over a full buffer (one a
    depth-0 step would have run anyway), never over a partial one."""
    lags_at_catch_up = []
    real_catch_up = Drafter.catch_up

    def recording_catch_up(self, slots, page_rows, kv_bound, sink_slot, window=None):
        lags_at_catch_up.append(int(self.pool.lag[slots].max()))
        return real_catch_up(self, slots, page_rows, kv_bound, sink_slot, window)

    monkeypatch.setattr(Drafter, "catch_up", recording_catch_up)
    with Engine(spec_models["target"], speculative_algorithm="EAGLE3",
                speculative_draft_model_path=spec_models["EAGLE3"], **CHAIN, **ENGINE) as e:
        policy = e.runner.spec.policy = ProbeWhenFree(e.runner.spec.policy)
        params = SamplingParams(max_new_tokens=3 * CATCH_UP_WINDOW, temperature=0.0, ignore_eos=True)
        (out,) = e.generate(input_ids=PROMPTS[:1], sampling_params=params)
        steps = e.runner.spec.stats.steps_by_depth
    assert out.token_ids[:NEW_TOKENS] == reference[0]
    assert steps[-1] >= 2 and policy.since_probe <= CATCH_UP_WINDOW, steps  # probes ran, once per window
    assert lags_at_catch_up and set(lags_at_catch_up) == {CATCH_UP_WINDOW}, lags_at_catch_up
