"""The tokenizer built from a GGUF file's metadata: the same ids as the tokenizer the vocabulary came
from, llama.cpp's pre-tokenizers by name, SentencePiece pieces worked by hand, the chat template."""

import json

import pytest

from tandem.gguf.tokenizer import gguf_tokenizer
from tests.gguf_checkpoints.gguf_files import CHATML, SPECIALS, byte_level_tokenizer

TEXTS = ["the quick brown fox", "def fibonacci(n):\n    return n if n < 2 else 0", "  two  spaces\n\n\ttab",
         "naïve café — “quotes” 😀", "import os\nprint(os.path.join('a', 'b'))", "x = 12345 + 6.7"]


def _write(path, tokens, types, model="gpt2", pre="default", merges=None, scores=None, bos=1, eos=2,
           add_bos=None, chat_template=None, add_space_prefix=None):
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model(model)
    if model == "gpt2":
        w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    if merges is not None:
        w.add_token_merges(merges)
    if scores is not None:
        w.add_token_scores(scores)
    w.add_bos_token_id(bos)
    w.add_eos_token_id(eos)
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    if add_space_prefix is not None:
        w.add_add_space_prefix(add_space_prefix)
    if chat_template:
        w.add_chat_template(chat_template)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


@pytest.fixture(scope="module")
def reference():
    return byte_level_tokenizer(320)


def _byte_level_file(path, reference, **kw):
    vocab = sorted(reference.get_vocab().items(), key=lambda kv: kv[1])
    merges = [" ".join(m) for m in json.loads(reference.to_str())["model"]["merges"]]
    return _write(path, [t for t, _ in vocab], [3 if t in SPECIALS else 1 for t, _ in vocab], merges=merges,
                  chat_template=CHATML, **kw)


def test_byte_level_ids_match_the_source_tokenizer(tmp_path, reference):
    tok = gguf_tokenizer(_byte_level_file(tmp_path / "t.gguf", reference, add_bos=False))
    for text in TEXTS:
        assert tok(text).input_ids == reference.encode(text).ids, text
        assert tok.decode(tok(text).input_ids) == text
    assert (tok.bos_token, tok.eos_token, tok.eos_token_id) == ("<|im_start|>", "<|im_end|>", 2)
    assert tok("<|im_start|>user<|im_end|>").input_ids[0] == 1  # a control token is one token, never split
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert tok.decode(ids) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_add_bos_token(tmp_path, reference):
    tok = gguf_tokenizer(_byte_level_file(tmp_path / "t.gguf", reference, add_bos=True))
    assert tok("the fox").input_ids == [1] + reference.encode("the fox").ids


@pytest.mark.parametrize("pre,want", [
    ("default", ["x", "Ġ12345", "Ġ+", "Ġ6", ".", "7"]),
    ("smollm", ["x", "Ġ", "1", "2", "3", "4", "5", "Ġ+", "Ġ", "6", ".", "7"]),
    ("llama-bpe", ["x", "Ġ", "123", "45", "Ġ+", "Ġ", "6", ".", "7"]),
    ("qwen2", ["x", "Ġ", "1", "2", "3", "4", "5", "Ġ+", "Ġ", "6", ".", "7"]),
])
def test_pre_tokenizers_by_name(tmp_path, reference, pre, want):
    tok = gguf_tokenizer(_byte_level_file(tmp_path / "t.gguf", reference, pre=pre))
    pieces = [p for p, _ in tok.backend_tokenizer.pre_tokenizer.pre_tokenize_str("x 12345 + 6.7")]
    assert pieces == want


def test_an_unknown_pre_tokenizer_is_an_error_naming_it(tmp_path, reference):
    with pytest.raises(ValueError, match="'deepseek-coder'"):
        gguf_tokenizer(_byte_level_file(tmp_path / "t.gguf", reference, pre="deepseek-coder"))


def test_sentencepiece_pieces_by_hand(tmp_path):
    # <unk> <s> </s>, byte fallback pieces, then pieces whose scores order the merges.
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    pieces = {"▁": -1.0, "h": -2.0, "e": -2.0, "l": -2.0, "o": -2.0, "w": -2.0, "r": -2.0, "d": -2.0,
              "ll": -3.0, "▁h": -3.5, "▁he": -4.0, "llo": -4.5, "▁hello": -5.0, "▁w": -6.0, "or": -6.0,
              "ld": -7.0, "▁wor": -8.0, "▁world": -9.0}
    tokens += list(pieces)
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    scores = [0.0] * 259 + list(pieces.values())
    tok = gguf_tokenizer(_write(tmp_path / "spm.gguf", tokens, types, model="llama", scores=scores))
    ids = tok("hello world").input_ids
    assert [tok.convert_ids_to_tokens(i) for i in ids] == ["<s>", "▁hello", "▁world"]  # BOS by default
    assert tok.decode(ids, skip_special_tokens=True) == "hello world"
    ids = tok("hé").input_ids  # é is not a piece: its two UTF-8 bytes
    assert tok.convert_ids_to_tokens(ids) == ["<s>", "▁h", "<0xC3>", "<0xA9>"]
    assert tok.decode(ids, skip_special_tokens=True) == "hé"


def test_a_file_without_a_tokenizer(tmp_path):
    import gguf

    w = gguf.GGUFWriter(str(tmp_path / "none.gguf"), "llama")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert gguf_tokenizer(str(tmp_path / "none.gguf")) is None
