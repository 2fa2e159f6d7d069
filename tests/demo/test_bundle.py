"""The bundled demo pair (src/tandem/demo_models, docs/demo_pair.md): it loads, fits the size limit,
speculates losslessly and keeps its measured acceptance on held-out prompts."""

from __future__ import annotations

import json
import os

import pytest
from safetensors import safe_open

from tandem import Engine, SamplingParams, demo_model_paths
from tandem.demo import DEMO_DIR
from tandem.train.demo_measure import engine_kwargs, spec_kwargs
from tandem.train.demo_recipe import BUNDLE_LIMIT_BYTES, bundle_bytes

TARGET, HEAD = demo_model_paths()
with open(os.path.join(DEMO_DIR, "eval_prompts.json")) as f:
    HELDOUT_PROMPTS = json.load(f)["prompts"]  # cut from asyncio/email/json files, which no model saw

# Chain of 3 drafts / tree of topk 4, 5 steps, 8 tokens; greedy, 8 held-out prompts, 64 new tokens,
# CPU float32. Measured: chain 2.88, tree 3.83 (docs/demo_pair.md; the floors leave room for float noise).
FLOORS = {"chain": 2.6, "tree": 3.4}
FLOOR_PROMPTS, FLOOR_NEW_TOKENS = HELDOUT_PROMPTS[:8], 64


def greedy(prompts, max_new_tokens, **spec) -> list:
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)
    with Engine(TARGET, **engine_kwargs("cpu", prompts, max_new_tokens), **spec) as engine:
        return engine.generate(input_ids=prompts, sampling_params=params)


def test_bundle_fits_the_size_limit():
    assert bundle_bytes(DEMO_DIR) <= BUNDLE_LIMIT_BYTES


def test_bundle_is_stored_in_float16_and_runs_in_float32_on_cpu():
    for path in (TARGET, HEAD):
        with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
            dtypes = {f.get_slice(name).get_dtype() for name in f.keys() if name != "t2d" and name != "d2t"}
        assert dtypes == {"F16"}, path
    with Engine(TARGET, device="cpu", context_length=64, max_total_tokens=256,
                **spec_kwargs(HEAD, "chain")) as engine:
        assert engine.runner.dtype.is_floating_point and str(engine.runner.dtype) == "torch.float32"
        draft_dtypes = {p.dtype for p in engine.runner.spec.drafter.model.parameters()}
        assert {str(d) for d in draft_dtypes if d.is_floating_point} == {"torch.float32"}


def test_engine_without_model_path_runs_the_pair():
    with Engine(device="cpu", context_length=128, max_total_tokens=512) as engine:
        assert (engine.args.model_path, engine.args.speculative_draft_model_path) == (TARGET, HEAD)
        assert engine.args.speculative_algorithm == "EAGLE3"
        out = engine.generate(["def fibonacci(n):"], SamplingParams(max_new_tokens=16, temperature=0.0))[0]
    assert len(out.token_ids) > 0 and out.spec_accept_lengths


def test_chat_template_renders_and_generates():
    from tandem.tokenizer import load_tokenizer

    tok = load_tokenizer(TARGET)
    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "Sort a list."}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<s><|system|>\nYou write Python.<|end|>\n<|user|>\nSort a list.<|end|>\n<|assistant|>\n"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids[0] == tok.bos_token_id and tok.convert_tokens_to_ids("<|assistant|>") in ids
    out = greedy([ids], 8)[0]
    assert len(out.token_ids) > 0


@pytest.fixture(scope="module")
def plain_outputs():
    return [o.token_ids for o in greedy(HELDOUT_PROMPTS[:4], 48)]


@pytest.mark.parametrize("drafting", ["chain", "tree"])
def test_greedy_speculative_output_equals_plain(drafting, plain_outputs):
    outs = greedy(HELDOUT_PROMPTS[:4], 48, **spec_kwargs(HEAD, drafting))
    assert [o.token_ids for o in outs] == plain_outputs
    assert all(o.spec_accept_lengths for o in outs)


@pytest.mark.parametrize("drafting", ["chain", "tree"])
def test_acceptance_on_heldout_prompts_stays_above_floor(drafting):
    outs = greedy(FLOOR_PROMPTS, FLOOR_NEW_TOKENS, **spec_kwargs(HEAD, drafting))
    lengths = [n for o in outs for n in o.spec_accept_lengths]
    assert sum(lengths) / len(lengths) >= FLOORS[drafting]
