"""Corpus reading, the seeded split, packing and the step -> batch mapping."""

import json

import pytest

from tandem.demo import byte_level_tokenizer
from tandem.train.corpus import BatchSampler, chunk, collate, pack, read_documents, split_documents

EXT = (".py", ".txt")


@pytest.fixture(scope="module")
def tokenizer():
    tok = byte_level_tokenizer()
    tok.chat_template = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}")
    return tok


def test_directory_recursive_by_extension(tmp_path, tokenizer):
    (tmp_path / "pkg" / "sub").mkdir(parents=True)
    (tmp_path / "a.py").write_text("def f(): pass")
    (tmp_path / "pkg" / "sub" / "b.txt").write_text("hello")
    (tmp_path / "pkg" / "skip.bin").write_text("not this")
    docs = read_documents(str(tmp_path), tokenizer, EXT)
    eos = tokenizer.eos_token_id
    assert [tokenizer.decode(d[:-1]) for d in docs] == ["def f(): pass", "hello"]  # sorted by path
    assert all(d[-1] == eos for d in docs)
    with pytest.raises(ValueError, match="no files"):
        read_documents(str(tmp_path / "pkg" / "sub"), tokenizer, (".rs",))


def test_jsonl_text_chat_and_token_ids(tmp_path, tokenizer):
    path = tmp_path / "data.jsonl"
    records = [{"text": "plain"}, {"messages": [{"role": "user", "content": "hi"}]}, {"input_ids": [5, 6, 7]}]
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n\n")
    docs = read_documents(str(path), tokenizer, EXT)
    assert tokenizer.decode(docs[0]) == "plain</s>"
    assert tokenizer.decode(docs[1]) == "<s>user: hi</s>"  # rendered by the chat template
    assert docs[2] == [5, 6, 7]
    path.write_text(json.dumps({"other": 1}) + "\n")
    with pytest.raises(ValueError, match="data.jsonl:1"):
        read_documents(str(path), tokenizer, EXT)
    with pytest.raises(ValueError, match="no tokenizer"):
        read_documents(_text_file(tmp_path), None, EXT)


def _text_file(tmp_path):
    p = tmp_path / "one.txt"
    p.write_text("abc")
    return str(p)


def test_split_is_seeded_and_disjoint():
    docs = [[i] * 3 for i in range(20)]
    train, held = split_documents(docs, 0.2, seed=7)
    assert len(held) == 4 and len(train) == 16
    assert sorted(d[0] for d in train + held) == list(range(20))
    assert split_documents(docs, 0.2, seed=7) == (train, held)
    assert split_documents(docs, 0.2, seed=8) != (train, held)
    assert split_documents(docs[:2], 0.01, seed=0)[1] != []  # a nonzero fraction holds out at least one
    assert split_documents(docs, 0.0, seed=0)[1] == []


def test_pack_and_chunk():
    docs = [[1, 2, 3], [4, 5], [6, 7, 8, 9, 10]]
    assert pack(docs, 4) == [[1, 2, 3, 4], [5, 6, 7, 8]]  # the 2-token tail is too short to train on
    assert pack(docs, 3) == [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    assert chunk([[1, 2, 3, 4, 5, 6, 7], [1, 2]], 3) == [[1, 2, 3], [4, 5, 6]]


def test_batches_depend_on_step_only():
    s = BatchSampler(10, 3, seed=1)
    epoch = [i for step in range(3) for i in s.indices(step)]
    assert len(set(epoch)) == 9  # one epoch: distinct sequences
    assert s.indices(4) == BatchSampler(10, 3, seed=1).indices(4)
    assert [s.indices(k) for k in range(3)] != [s.indices(k) for k in range(3, 6)]  # reshuffled
    assert BatchSampler(2, 8, seed=0).indices(5) in ([0, 1], [1, 0])
    ids, valid = collate([[3, 4, 5], [6, 7]])
    assert ids.tolist() == [[3, 4, 5], [6, 7, 0]] and valid.tolist() == [[True] * 3, [True, True, False]]
