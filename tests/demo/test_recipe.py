"""`tandem make-demo-pair` end to end at the tiny preset (seconds on a CPU), and its pieces."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors import safe_open

from tandem.train import stdlib_corpus
from tandem.train.demo_recipe import PRESETS, make_demo_pair, measure_demo_pair
from tandem.train.target_lm import LMTraining, WindowSampler


def write(root, rel, text="x = 1\n"):
    path = os.path.join(root, rel)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


def test_collect_stdlib_holds_out_packages_and_skips_test_dirs(tmp_path):
    root = str(tmp_path)
    for rel in ("abc.py", "pkg/mod.py", "json/__init__.py", "email/parser.py", "asyncio/events.py",
                "test/test_abc.py", "pkg/tests/test_mod.py", "idlelib/idle_test/t.py", "site-packages/x.py",
                "pkg/notes.txt", "jsonlike.py"):
        write(root, rel)
    corpus = stdlib_corpus.collect_stdlib(root)
    assert [f.path for f in corpus.train] == ["abc.py", "jsonlike.py", "pkg/mod.py"]
    assert [f.path for f in corpus.heldout] == ["asyncio/events.py", "email/parser.py", "json/__init__.py"]
    assert corpus.fingerprint() == stdlib_corpus.collect_stdlib(root).fingerprint()


def test_collect_stdlib_needs_held_out_packages(tmp_path):
    write(str(tmp_path), "abc.py")
    with pytest.raises(ValueError, match="held-out"):
        stdlib_corpus.collect_stdlib(str(tmp_path))


def test_window_sampler_is_seeded_and_covers_every_window_once_per_epoch():
    docs = [list(range(i * 100, i * 100 + 37)) for i in range(10)]
    a, b = WindowSampler(docs, 3, 8, seed=0), WindowSampler(docs, 3, 8, seed=0)
    epoch = torch.cat([a.batch(s) for s in range(a.batches_per_epoch)])
    assert torch.equal(epoch, torch.cat([b.batch(s) for s in range(b.batches_per_epoch)]))
    assert len({tuple(w.tolist()) for w in epoch}) == len(epoch) == a.batches_per_epoch * 3
    assert not torch.equal(a.batch(0), a.batch(a.batches_per_epoch))  # reshuffled next epoch


def test_lm_schedule_warms_up_then_decays_to_the_floor():
    t = LMTraining(steps=100, batch_size=1, seq_len=8, lr=1.0, warmup_steps=10, min_lr_ratio=0.1)
    assert t.lr_at(0, 100) == pytest.approx(0.1) and t.lr_at(9, 100) == pytest.approx(1.0)
    assert t.lr_at(100, 100) == pytest.approx(0.1) and t.lr_at(40, 100) > t.lr_at(80, 100)


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("demo_pair"))
    entry = make_demo_pair(out, PRESETS["tiny"], device="cpu", progress=False, head_seconds=60.0)
    return out, entry


def test_tiny_recipe_writes_the_bundle_layout(tiny_pair):
    out, entry = tiny_pair
    assert sorted(os.listdir(out)) == ["eagle3", "eval_prompts.json", "results.json", "target"]
    assert sorted(os.listdir(os.path.join(out, "eagle3"))) == ["config.json", "model.safetensors"]
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(
        os.listdir(os.path.join(out, "target")))
    for sub in ("target", "eagle3"):
        with safe_open(os.path.join(out, sub, "model.safetensors"), "pt") as f:
            assert {f.get_slice(n).get_dtype() for n in f.keys() if n not in ("d2t", "t2d")} == {"F16"}
    with open(os.path.join(out, "eagle3", "config.json")) as f:
        assert json.load(f)["torch_dtype"] == "float16"


def test_tiny_recipe_records_every_measurement(tiny_pair):
    out, entry = tiny_pair
    with open(os.path.join(out, "results.json")) as f:
        results = json.load(f)
    assert list(results) == ["cpu"]
    assert set(entry["acceptance"]) == {"chain_greedy", "chain_t0.7", "tree_greedy", "tree_t0.7"}
    assert all(r["mean_accept_length"] >= 1.0 for r in entry["acceptance"].values())
    assert entry["heldout_perplexity"]["perplexity"] > 1.0
    assert entry["speed"]["greedy_matches_plain"] == {"chain": 2, "tree": 2}
    assert entry["corpus"]["heldout_packages"] == list(stdlib_corpus.HELD_OUT_PACKAGES)
    assert entry["target"]["steps_done"] == PRESETS["tiny"].target.steps
    assert entry["head"]["steps_done"] == PRESETS["tiny"].head_steps  # the time budget was ample


def test_measure_only_adds_an_entry_and_keeps_the_others(tiny_pair):
    out, _ = tiny_pair
    path = os.path.join(out, "results.json")
    with open(path) as f:
        results = json.load(f)
    results["cuda"] = {"kept": True}
    with open(path, "w") as f:
        json.dump(results, f)
    entry = measure_demo_pair(out, PRESETS["tiny"], device="cpu", progress=False)
    with open(path) as f:
        results = json.load(f)
    assert results["cuda"] == {"kept": True} and results["cpu"]["acceptance"] == entry["acceptance"]
