"""Tensor parallelism on two CPU ranks (gloo) gives the same greedy tokens as one process, for plain
and speculative decoding (chain and tree, overlap on), and speculation takes the same decisions."""

import pytest

from tandem import Engine, SamplingParams
from tests.distributed.conftest import CHAIN, ENGINE, TREE
from tests.models.tiny_checkpoints import prompts

PROMPTS = prompts(8, seed=3)
GREEDY = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)


def _generate(path, **kwargs):
    with Engine(path, **ENGINE, **kwargs) as engine:
        return engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)


@pytest.mark.parametrize("family", ["llama3", "mistral", "qwen3"])
def test_plain_tp2_equals_tp1(tp_models, family):
    want = [o.token_ids for o in _generate(tp_models[family])]
    got = [o.token_ids for o in _generate(tp_models[family], tp_size=2)]
    assert got == want


def test_plain_tp2_equals_tp1_on_a_gguf_file(tmp_path):
    """A GGUF file is dequantized whole on every rank, Q/K rows unpermuted, then sharded like any checkpoint."""
    pytest.importorskip("gguf")
    from tests.gguf_checkpoints.gguf_files import write_family

    path, _, _ = write_family(tmp_path, "llama")
    assert [o.token_ids for o in _generate(path, tp_size=2)] == [o.token_ids for o in _generate(path)]


NO_OVERLAP = dict(disable_overlap_schedule=True)


@pytest.mark.parametrize("kind,shape,extra", [
    ("EAGLE3", CHAIN, {}), ("EAGLE3", TREE, {}), ("EAGLE", TREE, {}), ("MTP", CHAIN, {}),
    ("SELF", CHAIN, {}), ("SELF", TREE, {}), ("SELF", TREE, NO_OVERLAP)],
    ids=["eagle3-chain", "eagle3-tree", "eagle-tree", "mtp-chain", "self-chain", "self-tree", "self-tree-no-overlap"])
def test_speculative_tp2_equals_tp1(tp_models, kind, shape, extra):
    """Overlap is on unless NO_OVERLAP. SELF (the target drafting for itself, replicated on each
    rank) accepts long runs, so the multi-token accept, KV compaction and draft-extend paths all run
    under TP."""
    target = tp_models["llama3"]
    alg, draft = ("STANDALONE", target) if kind == "SELF" else (kind, tp_models[kind])
    spec = dict(speculative_algorithm=alg, speculative_draft_model_path=draft, **shape, **extra)
    plain = [o.token_ids for o in _generate(target)]
    one = _generate(target, speculative_adaptive="off", **spec)
    two = _generate(target, tp_size=2, speculative_adaptive="off", **spec)
    assert [o.token_ids for o in two] == plain
    # Same decisions step by step, not only the same final tokens (a fixed depth: adaptive choices
    # follow each engine's own timings).
    assert [o.spec_accept_lengths for o in two] == [o.spec_accept_lengths for o in one]
    # Adaptive depth: rank 0 chooses for every rank (they would otherwise diverge and hang).
    assert [o.token_ids for o in _generate(target, tp_size=2, **spec)] == plain
    if kind == "SELF":
        assert min(min(o.spec_accept_lengths) for o in two) >= 2


def test_seeded_sampling_tp2_equals_tp1(tp_models):
    """Sampling: rank 0 decides and broadcasts; with a per-request seed the draws match one process."""
    target = tp_models["llama3"]
    spec = dict(speculative_algorithm="STANDALONE", speculative_draft_model_path=target, **CHAIN)
    params = SamplingParams(max_new_tokens=12, temperature=0.9, top_k=50, seed=7, ignore_eos=True)
    outs = []
    for tp in (1, 2):
        with Engine(target, tp_size=tp, **ENGINE, **spec) as engine:
            outs.append([o.token_ids for o in engine.generate(input_ids=PROMPTS[:3], sampling_params=params)])
    assert outs[0] == outs[1]


@pytest.fixture(scope="module")
def tokenizer_target(tmp_path_factory):
    from tests.engine.helpers import make_tokenizer_checkpoint

    path, _, _ = make_tokenizer_checkpoint(str(tmp_path_factory.mktemp("tp_grammar") / "target"), seed=4)
    return path


@pytest.mark.parametrize("spec_on", [False, True], ids=["plain", "self-tree"])
def test_structured_output_tp2_equals_tp1(tokenizer_target, spec_on):
    """Only rank 0 keeps grammar matchers (the other ranks take its tokens): constrained output under
    tensor parallelism equals one process's, plain and speculative (tree masks on rank 0 alone)."""
    import json

    from tandem.bench.json_schemas import schemas

    spec = dict(speculative_algorithm="STANDALONE", speculative_draft_model_path=tokenizer_target, **TREE,
                speculative_adaptive="off") if spec_on else {}
    batch = [[5 + i, 40 + i, 77] for i in range(6)]
    docs = schemas(4, seed=5)
    params = ([SamplingParams(max_new_tokens=200, temperature=0.0, json_schema=s) for s in docs]
              + [SamplingParams(max_new_tokens=24, temperature=0.0, regex=r"[a-f]{3}-\d{2,5}"),
                 SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)])
    outs = []
    for tp in (1, 2):
        with Engine(tokenizer_target, tp_size=tp, **ENGINE, **spec) as engine:
            outs.append(engine.generate(input_ids=batch, sampling_params=params))
    assert [o.token_ids for o in outs[1]] == [o.token_ids for o in outs[0]]
    for out in outs[1][:4]:
        json.loads(out.text)


def test_prefix_cache_hits_under_tp2_equal_one_process(tp_models):
    """The scheduler runs once (rank 0) and every rank takes its page ids with the step, so a hit reuses
    the same pages on both ranks: follow-up prompts that start from cached pages give one process's
    tokens and acceptance, speculation on."""
    target = tp_models["llama3"]
    spec = dict(speculative_algorithm="EAGLE3", speculative_draft_model_path=tp_models["EAGLE3"], **CHAIN,
                speculative_adaptive="off")
    first = [p + [7, 8, 9] for p in PROMPTS[4:]]
    outs = []
    for tp in (1, 2):
        with Engine(target, tp_size=tp, **ENGINE, **spec) as engine:
            turn1 = engine.generate(input_ids=first, sampling_params=GREEDY)
            turn2 = engine.generate(input_ids=[p + o.token_ids + [5] for p, o in zip(first, turn1)],
                                    sampling_params=GREEDY)
            assert all(o.num_cached_tokens > 0 for o in turn2)
            outs.append([(o.token_ids, o.spec_accept_lengths, o.num_cached_tokens) for o in turn1 + turn2])
    assert outs[0] == outs[1]
