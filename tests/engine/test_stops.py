"""Why and where a request stops: EOS, stop token ids, max_new_tokens, the context length, stop
strings. The unconstrained reference is transformers' greedy generate."""

import json
import os

import pytest

from tandem import SamplingParams
from tests.engine.helpers import checkpoint_dir, copy_checkpoint, cpu_engine, hf_greedy, make_tokenizer_checkpoint
from tests.models.tiny_checkpoints import prompts

PROMPT = prompts(10)[3]  # 12 tokens
FULL_LEN = 32
CONFIG_EOS = 2  # tiny_checkpoints' eos_token_id


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return checkpoint_dir(tmp_path_factory, "llama3")


@pytest.fixture(scope="module")
def engine(ckpt):
    return cpu_engine(ckpt[0], max_total_tokens=4096)


@pytest.fixture(scope="module")
def full(ckpt):
    """Transformers' greedy continuation of PROMPT, and a token of it to stop at."""
    tokens = hf_greedy(ckpt[1], PROMPT, FULL_LEN)
    last = tokens.index(CONFIG_EOS) if CONFIG_EOS in tokens else len(tokens)
    # A token that first shows up well inside the output (and before any real EOS).
    k = next(i for i in range(5, last) if tokens[i] not in tokens[:i] and tokens[i] != CONFIG_EOS)
    return tokens, k


def test_stop_token_id_ends_output_at_it(engine, full):
    tokens, k = full
    out = engine.generate(input_ids=[PROMPT], sampling_params=SamplingParams(
        max_new_tokens=FULL_LEN, temperature=0.0, ignore_eos=True, stop_token_ids=[tokens[k]]))[0]
    assert out.token_ids == tokens[: k + 1]  # the stop token itself is kept, nothing after it
    assert out.finish_reason == "stop"


def test_eos_from_generation_config_stops_unless_ignore_eos(ckpt, full, tmp_path):
    tokens, k = full
    path = copy_checkpoint(ckpt[0], str(tmp_path / "eos"))
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [CONFIG_EOS, tokens[k]]}, f)
    engine = cpu_engine(path, max_total_tokens=1024)
    assert tokens[k] in engine.eos_token_ids
    params = dict(max_new_tokens=FULL_LEN, temperature=0.0)
    out = engine.generate(input_ids=[PROMPT], sampling_params=SamplingParams(**params))[0]
    assert out.token_ids == tokens[: k + 1]
    assert out.finish_reason == "stop"
    out = engine.generate(input_ids=[PROMPT], sampling_params=SamplingParams(**params, ignore_eos=True))[0]
    assert out.token_ids == tokens
    assert out.finish_reason == "length"


def test_max_new_tokens_gives_length(engine, full):
    tokens, _ = full
    for n in (1, 5):
        out = engine.generate(input_ids=[PROMPT], sampling_params=SamplingParams(
            max_new_tokens=n, temperature=0.0, ignore_eos=True))[0]
        assert out.token_ids == tokens[:n]
        assert out.finish_reason == "length"


def test_context_length_gives_length(ckpt, full):
    tokens, _ = full
    context = 20
    engine = cpu_engine(ckpt[0], context_length=context, max_total_tokens=1024)
    params = SamplingParams(max_new_tokens=100, temperature=0.0, ignore_eos=True)
    short = [7, 8, 9]
    outs = engine.generate(input_ids=[PROMPT, PROMPT + tokens[:7], short], sampling_params=params)
    for prompt, out in zip([PROMPT, PROMPT + tokens[:7], short], outs):
        assert out.finish_reason == "length"
        assert len(prompt) + len(out.token_ids) == context
    assert outs[0].token_ids == tokens[: context - len(PROMPT)]
    assert outs[1].token_ids == tokens[7: context - len(PROMPT)]  # a 19-token prompt gets one token
    assert engine.scheduler.allocator.num_used == 0  # every page is free or cached


# ---- stop strings (needs a tokenizer) ------------------------------------------------------------

TEXT_PROMPT = "The quick brown fox"
TEXT_LEN = 64


@pytest.fixture(scope="module")
def tok_ckpt(tmp_path_factory):
    return make_tokenizer_checkpoint(str(tmp_path_factory.mktemp("bytes_llama")))


@pytest.fixture(scope="module")
def tok_engine(tok_ckpt):
    engine = cpu_engine(tok_ckpt[0], max_total_tokens=2048)
    assert engine.tokenizer is not None
    return engine


@pytest.fixture(scope="module")
def text_full(tok_ckpt):
    _, model, tokenizer = tok_ckpt
    tokens = hf_greedy(model, tokenizer.encode(TEXT_PROMPT), TEXT_LEN)
    return tokens, tokenizer.decode(tokens, skip_special_tokens=True)


def _printable(tokenizer, t):
    s = tokenizer.decode([t])
    return len(s) == 1 and s.isascii() and s.isprintable() and not s.isspace()


def _cut_at(tokenizer, tokens, stop):
    """Independent reference: the shortest prefix whose text contains a stop string, and that text cut."""
    for m in range(1, len(tokens) + 1):
        text = tokenizer.decode(tokens[:m], skip_special_tokens=True)
        hits = [text.find(s) for s in stop if s in text]
        if hits:
            return tokens[:m], text[: min(hits)]
    return None


def test_stop_string_cuts_text_and_tokens(tok_ckpt, tok_engine, text_full):
    _, _, tokenizer = tok_ckpt
    tokens, text = text_full
    # A two-character stop string made of two consecutive printable output tokens, so it is
    # completed by the second one.
    i = next(i for i in range(4, len(tokens) - 1)
             if _printable(tokenizer, tokens[i]) and _printable(tokenizer, tokens[i + 1]))
    stop = tokenizer.decode(tokens[i: i + 2])
    assert stop in text
    want_tokens, want_text = _cut_at(tokenizer, tokens, [stop])
    assert len(want_tokens) > 1 and text.startswith(want_text) and stop not in want_text
    params = SamplingParams(max_new_tokens=TEXT_LEN, temperature=0.0, ignore_eos=True, stop=stop)
    out = tok_engine.generate(TEXT_PROMPT, params)[0]
    assert out.finish_reason == "stop"
    assert out.text == want_text
    assert out.token_ids == want_tokens
    assert text.startswith(out.text + stop)  # cut right before the first occurrence

    # Several stop strings: the earliest occurrence wins, whichever is listed first.
    later = tokenizer.decode(tokens[len(want_tokens) + 3: len(want_tokens) + 5])
    if later and later not in want_text:
        out2 = tok_engine.generate(TEXT_PROMPT, SamplingParams(
            max_new_tokens=TEXT_LEN, temperature=0.0, ignore_eos=True, stop=[later, stop]))[0]
        assert (out2.token_ids, out2.text) == _cut_at(tokenizer, tokens, [later, stop])


def test_absent_stop_string_changes_nothing(tok_ckpt, tok_engine, text_full):
    tokens, text = text_full
    stop = "\x00never\x00"
    assert stop not in text
    out = tok_engine.generate([TEXT_PROMPT], SamplingParams(
        max_new_tokens=TEXT_LEN, temperature=0.0, ignore_eos=True, stop=[stop]))[0]
    assert out.token_ids == tokens
    assert out.text == text
    assert out.finish_reason == "length"
    alloc = tok_engine.scheduler.allocator
    assert alloc.num_free + alloc.num_cached == alloc.num_total
