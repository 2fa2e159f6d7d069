"""Structured output on the GPU: the Triton sampling kernel under a grammar mask (no forbidden token,
the masked distribution by chi-square), and constrained engines with CUDA graphs on (constrained steps
leave the whole-iteration graph and run the graphed phases with the host's tree masks between): every
output of 50 random schemas validates, and speculative output equals plain output, greedy and seeded."""

import json

import pytest
import torch

pytest.importorskip("xgrammar", reason="structured output needs xgrammar")
pytest.importorskip("jsonschema", reason="the outputs are validated with jsonschema")

from tandem import Engine, SamplingParams  # noqa: E402
from tandem.layers.sampler import SamplingFeatures, choose_tokens  # noqa: E402
from tests.structured.conftest import CHAIN, TREE, grammar_models  # noqa: F401, E402 (fixture)
from tests.structured.test_structured_engine import SCHEMAS, prompts, schema_params  # noqa: E402
from tests.unit.test_sampler import chi2_999, chi_square, metadata, ref_probs  # noqa: E402

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

ENGINE = dict(device="cuda", dtype="float32", page_size=16, max_total_tokens=65536)


def test_triton_sampling_under_a_mask():
    gen = torch.Generator().manual_seed(2)
    vocab, draws = 4096, 40000
    logits = torch.randn(1, vocab, generator=gen) * 1.5
    allowed = torch.rand(1, vocab, generator=gen) < 0.002
    allowed[0, :3] = True
    p = SamplingParams(temperature=0.9, top_p=0.95, seed=3)
    meta = metadata([p] * draws, positions=list(range(draws)), seeds=[3] * draws)
    for name in ("temperature", "top_k", "top_p", "min_p", "seed", "position"):
        setattr(meta, name, getattr(meta, name).cuda())
    meta.allowed = allowed.expand(draws, -1).cuda()
    tokens = choose_tokens(logits.expand(draws, -1).cuda(), meta, SamplingFeatures(sampled=True, constrained=True)).cpu()
    assert allowed[0, tokens].all()
    masked = [v if allowed[0, t] else float("-inf") for t, v in enumerate(logits[0].tolist())]
    target, _ = ref_probs(masked, p)
    stat, dof = chi_square(tokens, torch.tensor(target))
    assert stat < chi2_999(dof), (stat, dof)


def validate(text: str, schema: dict) -> None:
    value = json.loads(text)
    try:
        import jsonschema
    except ImportError:  # the GPU machine may lack it: parsing is still checked
        return
    jsonschema.validate(value, schema)


@pytest.fixture(scope="module")
def plain_gpu(grammar_models):  # noqa: F811
    with Engine(grammar_models["target"], **ENGINE) as engine:
        return {t: engine.generate(input_ids=prompts(len(SCHEMAS)), sampling_params=schema_params(t)) for t in (0.0, 1.0)}


@pytest.mark.parametrize("kind,shape", [("SELF", TREE), ("EAGLE3", CHAIN)], ids=["self-tree", "eagle3-chain"])
@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "seeded"])
def test_constrained_speculation_with_graphs(grammar_models, plain_gpu, kind, shape, temperature):  # noqa: F811
    with Engine(grammar_models["target"], speculative_algorithm="STANDALONE" if kind == "SELF" else kind,
                speculative_draft_model_path=grammar_models[kind], **shape, **ENGINE) as engine:
        assert engine.runner.spec.phases.graphs, "CUDA graphs were meant to be on"
        outs = engine.generate(input_ids=prompts(len(SCHEMAS)), sampling_params=schema_params(temperature))
    for i, (out, ref, schema) in enumerate(zip(outs, plain_gpu[temperature], SCHEMAS)):
        assert ref.finish_reason == "stop", (i, ref.text)
        validate(ref.text, schema)
        assert out.token_ids == ref.token_ids, f"schema {i}: speculative output differs from plain"
