"""Training text in, fixed-length token sequences out.

A corpus is a directory of text/code files (read recursively, by extension), a JSONL file (one
`{"text": ...}`, chat `{"messages": [...]}` or pre-tokenized `{"input_ids": [...]}` per line), a
single text file, or token-id lists given directly. Documents are split into training and held-out
ones by a seeded permutation, so the split is the same for training and for `--eval-only`.
"""

from __future__ import annotations

import json
import os
import random
from typing import Sequence

import torch

MIN_SEQUENCE_LEN = 3  # one input token, one label, and the token that precedes both


def read_documents(path: str, tokenizer, extensions: Sequence[str]) -> list[list[int]]:
    """Every document of the corpus at `path` as token ids."""
    if os.path.isdir(path):
        files = sorted(os.path.join(root, name) for root, _, names in os.walk(path) for name in names
                       if name.endswith(tuple(extensions)))
        if not files:
            raise ValueError(f"no files ending in {', '.join(extensions)} under {path!r}")
        return [_tokenize(_read_text(f), tokenizer) for f in files]
    if not os.path.isfile(path):
        raise FileNotFoundError(f"corpus {path!r} does not exist")
    if path.endswith(".jsonl"):
        return _read_jsonl(path, tokenizer)
    return [_tokenize(_read_text(path), tokenizer)]


def _read_text(path: str) -> str:
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read()


def _read_jsonl(path: str, tokenizer) -> list[list[int]]:
    docs = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            record = json.loads(line)
            if "input_ids" in record:
                docs.append([int(t) for t in record["input_ids"]])
            elif "messages" in record:
                _need(tokenizer, path)
                text = tokenizer.apply_chat_template(record["messages"], tokenize=False)
                docs.append(tokenizer(text, add_special_tokens=False)["input_ids"])  # the template has BOS
            elif "text" in record:
                docs.append(_tokenize(record["text"], tokenizer))
            else:
                raise ValueError(f"{path}:{line_no}: expected a 'text', 'messages' or 'input_ids' field")
    return docs


def _tokenize(text: str, tokenizer) -> list[int]:
    _need(tokenizer, "a text corpus")
    ids = tokenizer(text, add_special_tokens=True)["input_ids"]
    eos = tokenizer.eos_token_id
    # Documents are packed back to back: the EOS marks the boundary, as the target saw in training.
    if eos is not None and (not ids or ids[-1] != eos):
        ids.append(eos)
    return ids


def _need(tokenizer, what: str) -> None:
    if tokenizer is None:
        raise ValueError(f"the target model directory has no tokenizer, needed to read {what}")


def split_documents(docs: list[list[int]], eval_fraction: float, seed: int) -> tuple[list, list]:
    """(training documents in a seeded shuffled order, held-out documents)."""
    order = list(range(len(docs)))
    random.Random(seed).shuffle(order)
    n_eval = round(len(docs) * eval_fraction)
    if eval_fraction > 0 and n_eval == 0 and len(docs) > 1:
        n_eval = 1
    held = [docs[i] for i in order[:n_eval]]
    train = [docs[i] for i in order[n_eval:]]
    return train, held


def pack(docs: list[list[int]], seq_len: int) -> list[list[int]]:
    """Concatenates the documents and cuts the stream into `seq_len` pieces (the last may be shorter)."""
    stream = [t for d in docs for t in d]
    seqs = [stream[i:i + seq_len] for i in range(0, len(stream), seq_len)]
    return [s for s in seqs if len(s) >= MIN_SEQUENCE_LEN]


def chunk(sequences: Sequence[Sequence[int]], seq_len: int) -> list[list[int]]:
    """Token-id lists given directly: kept as they are, long ones cut into `seq_len` pieces."""
    out = []
    for seq in sequences:
        seq = [int(t) for t in seq]
        out += [seq[i:i + seq_len] for i in range(0, len(seq), seq_len)]
    return [s for s in out if len(s) >= MIN_SEQUENCE_LEN]


class BatchSampler:
    """Which sequences make up the batch of a given step: a seeded reshuffle every epoch, so a run
    resumed at step k sees exactly the batches an uninterrupted run would."""

    def __init__(self, num_sequences: int, batch_size: int, seed: int):
        if num_sequences == 0:
            raise ValueError("the corpus yields no training sequences")
        self.n, self.seed = num_sequences, seed
        self.batch_size = min(batch_size, num_sequences)
        self.batches_per_epoch = num_sequences // self.batch_size

    def indices(self, step: int) -> list[int]:
        epoch, k = divmod(step, self.batches_per_epoch)
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        perm = torch.randperm(self.n, generator=gen)
        return perm[k * self.batch_size:(k + 1) * self.batch_size].tolist()


def collate(sequences: list[list[int]], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids [B, T], valid [B, T]) with T the longest sequence; padding goes at the end."""
    t = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), t), pad_id, dtype=torch.long)
    valid = torch.zeros(len(sequences), t, dtype=torch.bool)
    for i, s in enumerate(sequences):
        ids[i, :len(s)] = torch.tensor(s, dtype=torch.long)
        valid[i, :len(s)] = True
    return ids, valid
