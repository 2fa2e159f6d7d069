"""Structured output through the Engine, with speculation on and off.

- Every output of 50 random JSON schemas parses and validates (jsonschema, an independent validator),
  plain and speculative, greedy and sampled.
- Greedy constrained speculation equals constrained plain decoding token for token (EAGLE-3, a
  standalone draft and the target drafting itself, chain and tree, overlap on and off).
- Seeded sampled constrained output is the same with speculation on or off: each emitted token is the
  target's own draw from its *masked* distribution (the sampler test checks that distribution), so
  equality with plain decoding is the lossless check.
"""

import json
import random

import pytest

jsonschema = pytest.importorskip("jsonschema")  # (the GPU machine lacks it)
import torch

from tandem import Engine, SamplingParams
from tandem.bench.json_schemas import schemas
from tests.engine.helpers import instrument_preemptions
from tests.structured.conftest import CHAIN, ENGINE, TREE

SCHEMAS = schemas(50, seed=11)
MAX_NEW = 512


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 259) for _ in range(rng.randint(3, 12))] for _ in range(n)]


def schema_params(temperature: float, **extra) -> list[SamplingParams]:
    return [SamplingParams(max_new_tokens=MAX_NEW, temperature=temperature, seed=500 + i, json_schema=s, **extra)
            for i, s in enumerate(SCHEMAS)]


def spec_engine(models, kind: str, shape: dict, **extra) -> Engine:
    return Engine(models["target"], speculative_algorithm="STANDALONE" if kind == "SELF" else kind,
                  speculative_draft_model_path=models[kind], **shape, **{**ENGINE, **extra})


def assert_valid(outs, what: str) -> None:
    for i, (out, schema) in enumerate(zip(outs, SCHEMAS)):
        assert out.finish_reason == "stop", f"{what}: schema {i} did not finish in {MAX_NEW} tokens: {out.text!r}"
        try:
            jsonschema.validate(json.loads(out.text), schema)
        except (ValueError, jsonschema.ValidationError) as e:
            raise AssertionError(f"{what}: schema {i} {json.dumps(schema)}\noutput {out.text!r}\n{e}") from None


@pytest.fixture(scope="module")
def plain(grammar_models):
    with Engine(grammar_models["target"], **ENGINE) as engine:
        batch = prompts(len(SCHEMAS))
        return {t: engine.generate(input_ids=batch, sampling_params=schema_params(t)) for t in (0.0, 1.0)}


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_every_plain_output_validates(plain, temperature):
    assert_valid(plain[temperature], f"plain T={temperature}")


@pytest.mark.parametrize("kind,shape", [("EAGLE3", TREE), ("SELF", CHAIN)], ids=["eagle3-tree", "self-chain"])
@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_speculative_outputs_validate_and_equal_plain(grammar_models, plain, kind, shape, temperature):
    with spec_engine(grammar_models, kind, shape) as engine:
        outs = engine.generate(input_ids=prompts(len(SCHEMAS)), sampling_params=schema_params(temperature))
        assert_valid(outs, f"{kind} T={temperature}")
        for i, (out, ref) in enumerate(zip(outs, plain[temperature])):
            assert out.token_ids == ref.token_ids, f"{kind} T={temperature}: schema {i} differs from plain"
        if kind == "SELF":  # the target drafting for itself: drafts are accepted under the grammar too
            assert engine.runner.spec.stats.num_accepted_tokens > 0
        assert engine.scheduler.allocator.num_used == 0  # every page is free or cached


SUBSET = list(range(0, 50, 5))


@pytest.mark.parametrize("kind", ["EAGLE3", "STANDALONE"])
@pytest.mark.parametrize("shape", [CHAIN, TREE], ids=["chain", "tree"])
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
def test_greedy_constrained_spec_equals_plain(grammar_models, plain, kind, shape, overlap):
    batch = [prompts(len(SCHEMAS))[i] for i in SUBSET]
    params = [schema_params(0.0)[i] for i in SUBSET]
    with spec_engine(grammar_models, kind, shape, disable_overlap_schedule=not overlap) as engine:
        outs = engine.generate(input_ids=batch, sampling_params=params)
    for j, i in enumerate(SUBSET):
        assert outs[j].token_ids == plain[0.0][i].token_ids, f"{kind}: schema {i} differs from plain"


def test_constrained_beside_unconstrained_rows(grammar_models, plain):
    """A batch that mixes constrained and free requests: the free ones are untouched by the masks (the
    same tokens as alone) and the constrained ones still match plain decoding."""
    batch = prompts(len(SCHEMAS))[:6]
    free = [SamplingParams(max_new_tokens=24, temperature=1.0, seed=9 + i, ignore_eos=True) for i in range(6)]
    with Engine(grammar_models["target"], **ENGINE) as engine:
        alone = engine.generate(input_ids=batch, sampling_params=free)
    with spec_engine(grammar_models, "SELF", TREE) as engine:
        mixed = engine.generate(input_ids=batch + batch, sampling_params=free + schema_params(0.0)[:6])
    for i in range(6):
        assert mixed[i].token_ids == alone[i].token_ids
        assert mixed[6 + i].token_ids == plain[0.0][i].token_ids


def test_preempted_constrained_requests_resume_their_grammar(grammar_models, plain):
    """A pool too small for the batch preempts requests; a recompute rebuilds each matcher from the
    re-fed outputs, so the outputs still equal plain decoding's."""
    with spec_engine(grammar_models, "SELF", CHAIN, max_total_tokens=240) as engine:
        preempted = instrument_preemptions(engine)
        outs = engine.generate(input_ids=prompts(len(SCHEMAS))[:16], sampling_params=schema_params(1.0)[:16])
        assert preempted, "the pool was meant to be too small for the batch"
    for i in range(16):
        assert outs[i].token_ids == plain[1.0][i].token_ids, f"schema {i}"


REGEX = r"(cat|dog)-[0-9]{2,4}(\.[a-z]{1,3})?"
EBNF = 'root ::= "(" item ("," item)* ")"\nitem ::= [a-c] | "n" [0-9]'


@pytest.mark.parametrize("spec_on", [False, True], ids=["plain", "spec"])
def test_regex_and_ebnf(grammar_models, spec_on):
    import re

    engine = spec_engine(grammar_models, "SELF", TREE) if spec_on else Engine(grammar_models["target"], **ENGINE)
    with engine:
        params = ([SamplingParams(max_new_tokens=40, temperature=1.0, seed=i, regex=REGEX) for i in range(6)]
                  + [SamplingParams(max_new_tokens=60, temperature=1.0, seed=i, grammar=EBNF) for i in range(6)])
        outs = engine.generate(input_ids=prompts(12, seed=3), sampling_params=params)
    for out in outs[:6]:
        assert out.finish_reason == "stop" and re.fullmatch(REGEX, out.text), out.text
    for out in outs[6:]:
        assert out.finish_reason == "stop" and re.fullmatch(r"\(([a-c]|n[0-9])(,([a-c]|n[0-9]))*\)", out.text), out.text


def test_bad_grammars_are_refused_and_leave_the_engine_usable(grammar_models):
    with Engine(grammar_models["target"], **ENGINE) as engine:
        for bad, field in [(dict(json_schema={"type": "nonsense"}), "json_schema"), (dict(regex="(ab"), "regex"),
                           (dict(grammar="root ::= missing_rule"), "grammar"), (dict(json_schema="{not json"),
                                                                                 "json_schema")]:
            with pytest.raises(ValueError, match=field) as err:
                engine.add_request([5, 6, 7], SamplingParams(max_new_tokens=4, **bad))
            assert ".cc:" not in str(err.value)  # the reason, without the library's log prefix
        with pytest.raises(ValueError, match="at most one"):
            SamplingParams(regex="a", grammar='root ::= "a"')
        assert not engine.has_unfinished()
        out = engine.generate(input_ids=[[5, 6, 7]], sampling_params=SamplingParams(max_new_tokens=8, regex="[ab]{3}"))
        assert out[0].text in {a + b + c for a in "ab" for b in "ab" for c in "ab"}
        assert engine.scheduler.allocator.num_used == 0  # every page is free or cached


def test_negative_control_root_only_masks_break_the_constraint(grammar_models, plain, monkeypatch):
    """The bug this design avoids: a grammar mask on the bonus (root) position only. With the target
    drafting for itself, drafts the grammar forbids are then accepted, and outputs leave plain
    decoding's (and the schema). If this passes unmodified, the tests above could not catch it."""
    from tandem.structured.matchers import GrammarRows

    def root_only(self, request_ids, tokens, parents):
        b, n = tokens.shape
        out = torch.full((b * n, self.words), -1, dtype=torch.int32)
        out[::n] = self.root_masks(request_ids)
        return out

    monkeypatch.setattr(GrammarRows, "tree_masks", root_only)
    with spec_engine(grammar_models, "SELF", CHAIN) as engine:
        outs = engine.generate(input_ids=prompts(len(SCHEMAS)), sampling_params=schema_params(0.0))
    assert any(o.token_ids != r.token_ids for o, r in zip(outs, plain[0.0]))


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_every_depth_under_constraints_through_emulated_graphs(grammar_models, plain, monkeypatch, temperature):
    """Constrained batches at every depth the policy can choose (cycled), CUDA graphs emulated on the
    CPU: depth-0 steps replay the constrained whole-iteration graph with the root's mask as an input,
    drafting steps two half-iteration graphs with the host's tree masks between. Outputs equal plain
    decoding."""
    from tests.speculative.test_adaptive import CyclingPolicy
    from tests.speculative.test_cuda_graph_padding import record_padded_sizes

    monkeypatch.setenv("TANDEM_CUDA_GRAPH_EMULATE", "1")
    with spec_engine(grammar_models, "SELF", TREE, cuda_graph_max_bs=16) as engine:
        engine.runner.spec.policy = CyclingPolicy(engine.runner.spec.policy)
        sizes = {name: record_padded_sizes(g) for name, g in engine.runner.spec.phases.graphs.items()}
        outs = engine.generate(input_ids=prompts(len(SCHEMAS))[:12], sampling_params=schema_params(temperature)[:12])
    for i, out in enumerate(outs):
        assert out.token_ids == plain[temperature][i].token_ids, f"schema {i}"
    kind = "greedy" if temperature == 0 else "sampled"
    assert sizes[f"iteration:{kind}+grammar:chain0"], "no constrained depth-0 step replayed its graph"
    for shape in ("chain1", "chain4", "tree"):  # drafting steps: the draft graph, then verify-and-commit's
        assert sizes[f"draft:{shape}"] and sizes[f"verify_commit:{kind}+grammar:{shape}"], shape
