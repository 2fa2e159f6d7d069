"""The front end's incremental detokenizer: pieces join to the full decode, split characters and
possible stop-string beginnings are held back."""

from __future__ import annotations

import random

import pytest

from tandem.demo import byte_level_tokenizer
from tandem.server.detokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def tok():
    return byte_level_tokenizer()


def stream(detok, ids, step=1):
    pieces = []
    for i in range(0, len(ids), step):
        chunk = ids[i:i + step]
        pieces.append(detok.push(chunk, final=i + step >= len(ids)))
    return pieces


def test_multibyte_character_split_across_tokens(tok):
    ids = tok.encode("a中b😀c")  # byte-level: 3 and 4 tokens for the two characters
    assert len(ids) == 10
    pieces = stream(IncrementalDetokenizer(tok), ids)
    assert "".join(pieces) == "a中b😀c"
    assert all("\ufffd" not in p for p in pieces)
    assert "中" in pieces and "😀" in pieces  # shown whole, as soon as complete


@pytest.mark.parametrize("step", [1, 3])
def test_random_bytes_join_to_full_decode(tok, step):
    rng = random.Random(0)
    for _ in range(20):
        ids = [rng.randrange(len(tok)) for _ in range(rng.randrange(1, 40))]
        detok = IncrementalDetokenizer(tok)
        assert "".join(stream(detok, ids, step)) == tok.decode(ids, skip_special_tokens=True)
        assert detok.text == tok.decode(ids, skip_special_tokens=True)


def test_stop_string_is_held_back_then_cut(tok):
    ids = tok.encode("hello wor")
    detok = IncrementalDetokenizer(tok, stop=["world"])
    shown = "".join(detok.push([t]) for t in ids)
    assert shown == "hello "  # "wor" could begin "world"
    assert detok.push(tok.encode("ld!")) == ""
    assert detok.stopped and detok.text == "hello "


def test_held_back_prefix_released_when_it_is_not_a_stop(tok):
    detok = IncrementalDetokenizer(tok, stop=["world"])
    assert detok.push(tok.encode("a wo")) == "a "
    assert detok.push(tok.encode("x")) == "wox"
    assert detok.push(tok.encode(" wor"), final=True) == " wor"  # the end flushes everything
