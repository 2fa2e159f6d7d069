"""Batches of dormant requests (admitted without draft state, policy.admit) run plain decoding's step on the
speculative pool (speculative/root_step.py). Against plain decoding itself: greedy tokens equal, seeded
sampled tokens equal (penalties and logprobs included), eager and through the emulated CUDA graphs, overlap
on and off, under the stream-order checker; and a batch that mixes dormant rows with drafting ones, whose
drafting rows finish first, moves to the dormant step once only dormant rows are left."""

import pytest

from tandem import Engine, SamplingParams
from tests.speculative.conftest import CHAIN, ENGINE, TREE
from tests.speculative.scripted_policy import ScriptedChoice
from tests.speculative.test_seeded_speculative import BATCH, params_mix, plain_seeded  # noqa: F401 (fixture)
from tests.speculative.test_spec_greedy import NEW_TOKENS, PROMPTS, reference  # noqa: F401 (fixture)


class DormantEvery(ScriptedChoice):
    """Admits every `every`-th request with its draft and the rest dormant; drafts the deepest option
    whenever the policy is asked (only batches with a drafting row ask it)."""

    def __init__(self, base, every: int = 10**9):
        super().__init__(base)
        self.every, self.admissions = every, 0

    def admit(self, request_id, padded_batch, *_, **__):
        self.admissions += 1
        if self.admissions % self.every == 0:
            self.dormant.discard(request_id)
            return False
        self.dormant.add(request_id)
        return True

    def script(self, **engine_says):
        return self.deepest


def engine(spec_models, shape=CHAIN, every=10**9, **extra):
    e = Engine(spec_models["target"], speculative_algorithm="EAGLE3",
               speculative_draft_model_path=spec_models["EAGLE3"], **shape, **{**ENGINE, **extra})
    e.runner.spec.policy = DormantEvery(e.runner.spec.policy, every)
    return e


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "emulated-graphs"])
def test_dormant_batches_give_plain_greedy_tokens(spec_models, reference, overlap, graphs, monkeypatch):
    from tests.speculative.test_cuda_graph_padding import record_padded_sizes
    from tests.speculative.test_streams import RecordingDeviceModule

    monkeypatch.setenv("TANDEM_STREAM_CHECK", "1")
    extra = dict(disable_overlap_schedule=not overlap, _runner_hooks={"device_module": RecordingDeviceModule()})
    if graphs:
        monkeypatch.setenv("TANDEM_CUDA_GRAPH_EMULATE", "1")
        extra = dict(disable_overlap_schedule=not overlap, cuda_graph_max_bs=16)
    with engine(spec_models, **extra) as e:
        spec = e.runner.spec
        sizes = record_padded_sizes(spec.phases.graphs["dormant:greedy"]) if graphs else None
        params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
        outs = e.generate(input_ids=PROMPTS[:12], sampling_params=params)
        assert [o.token_ids for o in outs] == reference[:12]
        # Every decode step was a dormant one; no draft ever ran for these rows.
        assert spec.stats.num_drafts == 12 * (NEW_TOKENS - 1)  # (the first token comes from the prefill)
        assert spec.stats.steps_by_depth == [spec.stats.dormant_steps] and spec.stats.dormant_steps >= NEW_TOKENS - 1
        assert spec.stats.catch_ups == 0
        assert all(set(o.spec_accept_lengths) == {1} for o in outs)
        if graphs:
            assert sizes, "the dormant-decode graph never replayed"
        assert e.scheduler.allocator.num_free + e.scheduler.allocator.num_cached == e.scheduler.allocator.num_total


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "emulated-graphs"])
def test_dormant_batches_give_plain_seeded_tokens(spec_models, plain_seeded, graphs, monkeypatch):
    """Top-p, top-k, min-p, penalties and greedy rows, seeded: the position-keyed noise makes plain
    decoding's tokens the reference."""
    if graphs:
        monkeypatch.setenv("TANDEM_CUDA_GRAPH_EMULATE", "1")
    with engine(spec_models, TREE, **(dict(cuda_graph_max_bs=16) if graphs else {})) as e:
        outs = e.generate(input_ids=BATCH, sampling_params=params_mix())
        assert [o.token_ids for o in outs] == plain_seeded
        assert e.runner.spec.stats.dormant_steps > 0


def test_dormant_logprobs_are_plain_logprobs(spec_models):
    params = SamplingParams(max_new_tokens=8, temperature=1.0, seed=7, ignore_eos=True, logprobs=3,
                            repetition_penalty=1.2)
    with Engine(spec_models["target"], **ENGINE) as plain:
        want = plain.generate(input_ids=PROMPTS[:3], sampling_params=params)
    with engine(spec_models) as e:
        outs = e.generate(input_ids=PROMPTS[:3], sampling_params=params)
        assert e.runner.spec.stats.dormant_steps > 0
    for out, ref in zip(outs, want):
        assert out.token_ids == ref.token_ids
        for got, exp in zip(out.logprobs, ref.logprobs):
            assert got.token_id == exp.token_id and got.logprob == pytest.approx(exp.logprob, abs=1e-4)
            assert [t for t, _ in got.top] == [t for t, _ in exp.top]


def test_a_mixed_batch_moves_to_the_dormant_step_when_its_drafting_rows_finish(spec_models, reference):
    """Every third request keeps its draft and finishes after 6 tokens; the dormant ones run 20. While a
    drafting row is in the batch every step drafts (the dormant rows' drafts accept nothing); after, the
    dormant step takes over. Greedy tokens stay plain decoding's throughout."""
    with engine(spec_models, every=3) as e:
        spec = e.runner.spec
        params = [SamplingParams(max_new_tokens=6 if (i + 1) % 3 == 0 else NEW_TOKENS, temperature=0.0,
                                 ignore_eos=True) for i in range(9)]
        outs = e.generate(input_ids=PROMPTS[:9], sampling_params=params)
        for i, out in enumerate(outs):
            assert out.token_ids == reference[i][:len(out.token_ids)], f"request {i} differs"
        assert sum(spec.stats.steps_by_depth[1:]) > 0 and spec.stats.dormant_steps > 0
        assert e.scheduler.allocator.num_free + e.scheduler.allocator.num_cached == e.scheduler.allocator.num_total
