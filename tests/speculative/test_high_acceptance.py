"""A draft that agrees with the target most of the time (an EAGLE-3 head trained on the target's own
outputs): long accepted runs, tree KV compaction on real paths, and still token-for-token equality."""

import pytest

from tandem import Engine, SamplingParams
from tests.models.tiny_checkpoints import prompts
from tests.speculative.conftest import CHAIN, ENGINE, TREE
from tests.train.fixtures import trained_eagle3_head  # noqa: F401  (session fixture)

NEW = 32
PROMPTS = prompts(10, seed=31) + prompts(10, seed=32) + prompts(10, seed=33) + prompts(2, seed=34)


@pytest.mark.parametrize("shape", [CHAIN, TREE], ids=["chain", "tree"])
def test_trained_head_equality_and_acceptance(trained_eagle3_head, shape):
    head = trained_eagle3_head
    params = SamplingParams(max_new_tokens=NEW, temperature=0.0, ignore_eos=True)
    with Engine(head.target, **ENGINE) as plain:
        want = [o.token_ids for o in plain.generate(input_ids=PROMPTS, sampling_params=params)]
    # The configured depth throughout: this is about the head's acceptance and the tree's compaction on
    # long accepted paths (the adaptive policy, timing a CPU, may well choose to draft less).
    with Engine(head.target, speculative_algorithm="EAGLE3", speculative_draft_model_path=head.draft,
                speculative_adaptive="off", **shape, **ENGINE) as engine:
        for batch in (1, 3, 16):
            engine.scheduler.config = engine.scheduler.config.__class__(
                engine.max_model_len, batch, engine.scheduler.config.max_num_batched_tokens)
            outs = engine.generate(input_ids=PROMPTS, sampling_params=params)
            assert [o.token_ids for o in outs] == want, f"batch {batch}"
        stats = engine.runner.spec.stats
        assert stats.mean_accept_length > 2.0, stats  # chain: ~2.8; tree: at least as high
        assert stats.accepted_per_position[0] > stats.accepted_per_position[-1] > 0
        assert engine.scheduler.allocator.num_used == 0  # every page is free or cached
