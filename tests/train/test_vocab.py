"""The draft vocabulary (d2t / t2d) against a slow reference."""

from collections import Counter

import torch

from tandem.train.vocab import build_draft_vocab


def slow_vocab(sequences, vocab, k):
    counts = Counter(t for s in sequences for t in s)
    ranked = sorted(range(vocab), key=lambda t: (-counts[t], t))  # most frequent; ties: lower id
    kept = sorted(ranked[:k])
    d2t = [target - i for i, target in enumerate(kept)]
    t2d = [t in set(kept) for t in range(vocab)]
    return d2t, t2d


def test_matches_slow_reference():
    gen = torch.Generator().manual_seed(0)
    for trial in range(5):
        vocab = 50
        seqs = [torch.randint(0, vocab, (int(n),), generator=gen).tolist()
                for n in torch.randint(1, 40, (7,), generator=gen)]
        seqs = [[t % (vocab - 10 * (trial % 3)) for t in s] for s in seqs]  # some ids never appear
        for k in (1, 10, 37, vocab):
            v = build_draft_vocab(seqs, vocab, k)
            d2t, t2d = slow_vocab(seqs, vocab, k)
            assert v.d2t.dtype == torch.int64 and v.t2d.dtype == torch.bool
            assert v.d2t.tolist() == d2t
            assert v.t2d.tolist() == t2d
            # the public meaning: draft id i is target id i + d2t[i], exactly the ids t2d marks
            assert (torch.arange(k) + v.d2t).tolist() == torch.nonzero(v.t2d).flatten().tolist()


def test_most_frequent_kept():
    v = build_draft_vocab([[5, 5, 5, 9, 9, 2]], 12, 2)
    assert v.target_ids.tolist() == [5, 9]
    assert v.d2t.tolist() == [5, 8]
