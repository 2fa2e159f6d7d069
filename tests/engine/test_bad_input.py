"""Bad input is refused with an error that says what is wrong, and leaves a live engine as it was;
bad checkpoints are refused at load time naming the offending tensor or architecture."""

import re

import pytest

from tandem import Engine, SamplingParams
from tandem.models.hf_config import SUPPORTED_ARCHITECTURES
from tests.engine.helpers import checkpoint_dir, copy_checkpoint, cpu_engine, edit_config, edit_tensors, hf_greedy

CONTEXT = 64
VOCAB = 320
GOOD_PROMPT = [11, 22, 33, 44, 55]
GOOD_NEW = 8


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return checkpoint_dir(tmp_path_factory, "llama3")


@pytest.fixture(scope="module")
def engine(ckpt):
    return cpu_engine(ckpt[0], context_length=CONTEXT, max_total_tokens=1024)


@pytest.fixture(scope="module")
def good_tokens(ckpt):
    return hf_greedy(ckpt[1], GOOD_PROMPT, GOOD_NEW)


def assert_still_healthy(engine, good_tokens):
    alloc = engine.scheduler.allocator
    assert not engine.has_unfinished(), "a refused request was left queued"
    assert alloc.num_free + alloc.num_cached == alloc.num_total
    out = engine.generate(input_ids=[GOOD_PROMPT], sampling_params=SamplingParams(
        max_new_tokens=GOOD_NEW, temperature=0.0, ignore_eos=True))
    assert len(out) == 1 and out[0].token_ids == good_tokens
    assert alloc.num_free + alloc.num_cached == alloc.num_total


# ---- prompts ------------------------------------------------------------------------------------

@pytest.mark.parametrize("length", [CONTEXT, 100])
def test_prompt_longer_than_context(engine, good_tokens, length):
    greedy = SamplingParams(max_new_tokens=4, temperature=0.0)
    with pytest.raises(ValueError) as e:
        # The good prompt in front must not be queued either.
        engine.generate(input_ids=[GOOD_PROMPT, list(range(3, 3 + length))], sampling_params=greedy)
    numbers = re.findall(r"\d+", str(e.value))
    assert str(length) in numbers and str(CONTEXT) in numbers, str(e.value)
    assert_still_healthy(engine, good_tokens)


@pytest.mark.parametrize("input_ids, match", [
    ([[]], "empty"),
    ([[5, VOCAB]], str(VOCAB)),
    ([[5, -1]], "-1"),
    ([[5, 10**9]], str(10**9)),
])
def test_bad_prompt_token_ids(engine, good_tokens, input_ids, match):
    with pytest.raises(ValueError, match=re.escape(match)):
        engine.generate(input_ids=[GOOD_PROMPT] + input_ids, sampling_params=SamplingParams(max_new_tokens=2))
    assert_still_healthy(engine, good_tokens)


def test_text_prompt_without_tokenizer(engine, good_tokens):
    with pytest.raises(ValueError, match="tokenizer"):
        engine.generate("hello")
    with pytest.raises(ValueError):
        engine.generate(input_ids=[GOOD_PROMPT], sampling_params=[SamplingParams()] * 2)  # 2 params, 1 prompt
    assert_still_healthy(engine, good_tokens)


# ---- sampling parameters ------------------------------------------------------------------------

BAD_PARAMS = [
    ("temperature", -0.5), ("temperature", float("nan")),
    ("top_p", 0.0), ("top_p", 1.5),
    ("top_k", -2),
    ("min_p", 2.0),
    ("max_new_tokens", 0),
    ("logprobs", -1), ("logprobs", 21), ("logprobs", 1.5),
]


@pytest.mark.parametrize("field, value", BAD_PARAMS)
def test_bad_sampling_params_rejected_at_construction(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


@pytest.mark.parametrize("field, value", BAD_PARAMS)
def test_bad_sampling_params_leave_engine_clean(engine, good_tokens, field, value):
    # Made valid, then broken (as a caller mutating a shared object would), and placed after a good
    # request in the same call: the engine validates it and must not leave the first one queued.
    bad = SamplingParams(max_new_tokens=4)
    setattr(bad, field, value)
    good = SamplingParams(max_new_tokens=4, temperature=0.0)
    with pytest.raises(ValueError, match=field):
        engine.generate(input_ids=[GOOD_PROMPT, [7, 8, 9]], sampling_params=[good, bad])
    assert_still_healthy(engine, good_tokens)


def test_unknown_engine_argument(ckpt):
    with pytest.raises(TypeError, match="max_total_tokenz"):
        Engine(ckpt[0], device="cpu", max_total_tokenz=64)


# ---- bad checkpoints ----------------------------------------------------------------------------

def test_unknown_architecture_lists_the_supported_ones(ckpt, tmp_path):
    path = copy_checkpoint(ckpt[0], str(tmp_path / "gpt2"))
    edit_config(path, architectures=["GPT2LMHeadModel"], model_type="gpt2")
    with pytest.raises(ValueError) as e:
        cpu_engine(path)
    msg = str(e.value)
    assert "GPT2LMHeadModel" in msg
    for arch in SUPPORTED_ARCHITECTURES:
        assert arch in msg, msg


# A plain tensor, one packed into qkv_proj and one into gate_up_proj.
TENSORS = ["model.layers.1.mlp.down_proj.weight", "model.layers.0.self_attn.k_proj.weight",
           "model.layers.2.mlp.up_proj.weight", "model.norm.weight"]


@pytest.mark.parametrize("name", TENSORS)
def test_missing_tensor_is_named(ckpt, tmp_path, name):
    path = copy_checkpoint(ckpt[0], str(tmp_path / "ckpt"))
    edit_tensors(path, lambda t: t.pop(name))
    with pytest.raises(ValueError) as e:
        cpu_engine(path)
    assert "missing" in str(e.value) and repr(name) in str(e.value), str(e.value)


@pytest.mark.parametrize("name", TENSORS)
def test_misshaped_tensor_names_it_and_both_shapes(ckpt, tmp_path, name):
    path = copy_checkpoint(ckpt[0], str(tmp_path / "ckpt"))
    shapes = {}

    def shrink(t):
        good = t[name]
        bad = good[:-1].clone()  # one row (or element) short
        t[name] = bad
        shapes.update(good=tuple(good.shape), bad=tuple(bad.shape))

    edit_tensors(path, shrink)
    with pytest.raises(ValueError) as e:
        cpu_engine(path)
    msg = str(e.value)
    assert name in msg and str(shapes["good"]) in msg and str(shapes["bad"]) in msg, msg


def test_unexpected_tensor_is_named(ckpt, tmp_path):
    path = copy_checkpoint(ckpt[0], str(tmp_path / "ckpt"))
    extra = "model.layers.0.self_attn.extra_proj.weight"
    edit_tensors(path, lambda t: t.update({extra: t["model.layers.0.self_attn.o_proj.weight"].clone()}))
    with pytest.raises(ValueError, match=re.escape(extra)):
        cpu_engine(path)


def test_untouched_copy_loads(ckpt, tmp_path, good_tokens):
    # The surgery helpers themselves do not break a checkpoint: a round trip still loads and matches.
    path = copy_checkpoint(ckpt[0], str(tmp_path / "ckpt"))
    edit_tensors(path, lambda t: None)
    engine = cpu_engine(path, max_total_tokens=256)
    assert_still_healthy(engine, good_tokens)
