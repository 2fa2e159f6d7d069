"""GGUF checkpoints against transformers' own GGUF loading (`from_pretrained(dir, gguf_file=...)`), on
tiny files of each Llama family holding every tensor type we dequantize, in float32."""

import os

import pytest
import torch

from tandem import Engine, SamplingParams
from tests.gguf_checkpoints.gguf_files import ALL_TYPES, FAMILIES, write_family
from tests.models.test_hf_parity import _prefill_logits
from tests.models.tiny_checkpoints import prompts

ENGINE = dict(device="cpu", dtype="float32", page_size=4, max_total_tokens=4096)


def _transformers_gguf(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                dtype=torch.float32).eval()


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_file(request, tmp_path_factory):
    # Each family rotates the types over its matrices differently, so every type lands on several roles.
    offset = 3 * sorted(FAMILIES).index(request.param)
    path, model, written = write_family(tmp_path_factory.mktemp(request.param), request.param, type_offset=offset)
    engine = Engine(path, **ENGINE)
    yield request.param, path, written, engine, _transformers_gguf(path)
    engine.shutdown()


def test_every_family_file_holds_every_type(family_file):
    _, _, written, _, _ = family_file
    assert set(written.values()) == set(ALL_TYPES)


def test_logits_match_transformers_gguf(family_file):
    family, _, _, engine, hf = family_file
    token_lists = prompts(6, vocab=320)
    for ids, got in zip(token_lists, _prefill_logits(engine, token_lists)):
        with torch.no_grad():
            want = hf(torch.tensor([ids])).logits[0]
        rel = (got - want).abs().max() / want.abs().max()
        assert rel <= 1e-4, f"{family}: relative logits error {rel:.2e} for a prompt of {len(ids)} tokens"


def test_greedy_matches_transformers_gguf(family_file):
    family, _, _, engine, hf = family_file
    hf.generation_config.eos_token_id = None
    for ids in prompts(3, seed=1, vocab=320):
        out = engine.generate(input_ids=[ids], sampling_params=SamplingParams(max_new_tokens=16, temperature=0.0,
                                                                            ignore_eos=True))[0]
        want = hf.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False, pad_token_id=0,
                           attention_mask=torch.ones(1, len(ids), dtype=torch.long))[0, len(ids):].tolist()
        assert out.token_ids == want, family


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_f32_file_equals_the_checkpoint_it_was_written_from(tmp_path, family):
    """Independent of transformers' GGUF reader: an F32 file gives the original model's logits, so the
    Q/K rows come back in their order (llama permutes them; qwen2 does not)."""
    path, model, _ = write_family(tmp_path, family, types=("F32",))
    ids = prompts(4, seed=2, vocab=320)
    with Engine(path, **ENGINE) as engine:
        got = _prefill_logits(engine, ids)
    for x, g in zip(ids, got):
        with torch.no_grad():
            want = model(torch.tensor([x])).logits[0]
        assert (g - want).abs().max() / want.abs().max() <= 1e-5


def test_dequantized_into_the_engine_dtype(tmp_path):
    path, _, _ = write_family(tmp_path, "llama", types=("Q8_0", "Q4_K"))
    with Engine(path, device="cpu", dtype="bfloat16", page_size=4, max_total_tokens=512) as engine:
        dtypes = {p.dtype for p in engine.runner.model.parameters()}
        out = engine.generate(input_ids=[[5, 6, 7]], sampling_params=SamplingParams(max_new_tokens=4, ignore_eos=True))
    assert dtypes == {torch.bfloat16}
    assert len(out[0].token_ids) == 4
