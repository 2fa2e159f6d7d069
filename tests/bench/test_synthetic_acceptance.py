"""Synthetic acceptance (benchmark only): the rule against a slow reference, its statistics through the
whole command, its label everywhere, and that nothing but `tandem bench` can turn it on."""

import os
import random

import pytest
import torch

from tandem.bench.synthetic import LABEL, expected_accept_length, parse_profile, synthetic_accept
from tandem.speculative.tree import DraftTree, chain_tree

REPO_SRC = os.path.join(os.path.dirname(__file__), "..", "..", "src", "tandem")


def slow_synthetic_accept(tokens, parents, heads):
    """One request: from the root, move to the first child (in index order) whose coin is heads."""
    cur, path = 0, [0]
    while True:
        nxt = next((c for c in range(1, len(tokens)) if parents[c] == cur and heads[c]), None)
        if nxt is None:
            return path
        cur = nxt
        path.append(cur)


def random_tree(rng, gen, batch, nodes):
    parents = [[-1] + [rng.randrange(i) for i in range(1, nodes)] for _ in range(batch)]
    depths = []
    for ps in parents:
        d = [0]
        for i in range(1, nodes):
            d.append(d[ps[i]] + 1)
        depths.append(d)
    tokens = torch.randint(0, 50, (batch, nodes), generator=gen)
    return DraftTree(tokens, torch.tensor(parents), torch.tensor(depths))


@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_matches_slow_reference(shape):
    rng, gen = random.Random(0), torch.Generator().manual_seed(0)
    b, n = 64, 6
    if shape == "chain":
        tree = chain_tree(torch.randint(0, 50, (b,), generator=gen), torch.randint(0, 50, (b, n - 1), generator=gen))
    else:
        tree = random_tree(rng, gen, b, n)
    argmax = torch.randint(0, 50, (b, n), generator=gen)
    uniforms = torch.rand(b, n, generator=gen)
    out = synthetic_accept(tree, argmax, uniforms, 0.6)
    for i in range(b):
        heads = (uniforms[i] < 0.6).tolist()
        path = slow_synthetic_accept(tree.tokens[i].tolist(), tree.parents[i].tolist(), heads)
        k = len(path)
        assert out.accept_lens[i] == k
        assert out.path[i, :k].tolist() == path
        # The emitted tokens are the drafted ones, then the target's argmax at the last accepted node.
        want = [tree.tokens[i, j].item() for j in path[1:]] + [argmax[i, path[-1]].item()]
        assert out.out_tokens[i, :k].tolist() == want


def test_chain_acceptance_is_geometric():
    gen = torch.Generator().manual_seed(1)
    b, steps, p = 200_000, 3, 0.5
    tree = chain_tree(torch.zeros(b, dtype=torch.long), torch.ones(b, steps, dtype=torch.long))
    uniforms = torch.rand(b, steps + 1, generator=gen)
    lens = synthetic_accept(tree, torch.zeros(b, steps + 1, dtype=torch.long), uniforms, p).accept_lens.float()
    assert expected_accept_length(p, steps) == 1 + p + p ** 2 + p ** 3
    assert lens.mean().item() == pytest.approx(expected_accept_length(p, steps), abs=4 * lens.std().item() / b ** 0.5)
    for k in range(1, steps + 1):  # position k accepted with probability p^k
        assert (lens > k).float().mean().item() == pytest.approx(p ** k, abs=0.005)


def test_a_profile_accepts_each_chain_position_at_its_own_rate():
    """Profile (0.9, 0.6): position 1 with 0.9, position 2 with 0.6 given position 1, position 3 with 0.6
    again (the last rate repeats), against counts over 200,000 chains."""
    gen = torch.Generator().manual_seed(2)
    b, steps, profile = 200_000, 3, (0.9, 0.6)
    tree = chain_tree(torch.zeros(b, dtype=torch.long), torch.ones(b, steps, dtype=torch.long))
    uniforms = torch.rand(b, steps + 1, generator=gen)
    lens = synthetic_accept(tree, torch.zeros(b, steps + 1, dtype=torch.long), uniforms, profile).accept_lens
    for k, rate in zip(range(1, steps + 1), (0.9, 0.6, 0.6)):
        reached, accepted = (lens > k - 1).sum().item(), (lens > k).sum().item()
        assert accepted / reached == pytest.approx(rate, abs=0.006)
    assert expected_accept_length(profile, steps) == pytest.approx(1 + 0.9 + 0.9 * 0.6 + 0.9 * 0.6 * 0.6)


@pytest.mark.parametrize("text", ["0.8,x", "", "0.8,1.5", "-0.1"])
def test_a_bad_profile_is_refused(text):
    with pytest.raises(ValueError, match="profile|rates"):
        parse_profile(text)


def test_a_profile_through_the_command(bench):
    """Profile 1,0 at a chain of 3: every step accepts exactly position 1 (2 tokens a step)."""
    rc, record, _, _ = bench("--preset", "tiny-test", "--synthetic-acceptance-profile", "1,0", "--spec", "on",
                             "--speculative-adaptive", "off", "--speculative-num-steps", "3",
                             "--speculative-num-draft-tokens", "4", "--batch-sizes", "2", "--input-len", "6",
                             "--output-len", "21", "--no-plots")
    assert rc == 0
    assert record["batches"][0]["spec_on"]["mean_accept_length"] == 2.0
    assert record["batches"][0]["spec_on"]["accept_per_position"] == [1.0, 0.0, 0.0]
    assert record["synthetic_acceptance"]["p"] == [1.0, 0.0]
    assert record["synthetic_acceptance"]["expected_mean_accept_length"] == 2.0
    rc, _, _, stderr = bench("--preset", "tiny-test", "--synthetic-acceptance-profile", "0.9,0.8", "--spec", "on",
                             "--speculative-eagle-topk", "2", "--speculative-num-draft-tokens", "6")
    assert rc != 0 and "needs a chain" in stderr


@pytest.mark.parametrize("p, steps, mean", [(1.0, 3, 4.0), (0.0, 3, 1.0), (1.0, 2, 3.0)])
def test_extremes_through_the_command(bench, p, steps, mean):
    """P=1 accepts every draft (num_steps + 1 tokens a step), P=0 none (1 token a step)."""
    rc, record, _, _ = bench("--preset", "tiny-test", "--synthetic-acceptance", str(p), "--spec", "on",
                             "--speculative-adaptive", "off",  # every step drafts num_steps
                             "--speculative-num-steps", str(steps), "--speculative-num-draft-tokens", str(steps + 1),
                             "--batch-sizes", "1", "4", "--input-len", "6", "--output-len", "20", "--no-plots")
    assert rc == 0
    per_position = [p] * steps
    for row in record["batches"]:
        assert row["spec_on"]["mean_accept_length"] == mean
        assert row["spec_on"]["accept_per_position"] == per_position
        assert row["spec_on"]["output_tokens"] == 20 * row["batch_size"]
    assert record["synthetic_acceptance"]["expected_mean_accept_length"] == mean


@pytest.fixture
def plot_titles(monkeypatch):
    """{png path: figure title} of every figure saved (a PNG holds its text only as pixels)."""
    import matplotlib.figure

    titles, original = {}, matplotlib.figure.Figure.savefig

    def savefig(self, fname, *args, **kwargs):
        titles[str(fname)] = self._suptitle.get_text() if self._suptitle else ""
        return original(self, fname, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", savefig)
    return titles


def test_half_acceptance_and_labels(bench, plot_titles):
    """P=0.5, 3 steps: mean acceptance 1 + p + p^2 + p^3 = 1.875 within 4 standard errors, and the label
    on the record, on each speculative row, in the table and in the plots' titles."""
    rc, record, stdout, _ = bench("--preset", "tiny-test", "--synthetic-acceptance", "0.5", "--speculative-adaptive",
                                  "off", "--batch-sizes", "16", "--input-len", "4", "--output-len", "96")
    assert rc == 0
    on = record["batches"][0]["spec_on"]
    # A verify step makes at most 4 tokens, so there were at least 16 * 95 / 4 of them; the accept
    # length's standard deviation at p=0.5 is 1.05.
    min_steps = 16 * 95 / 4
    assert on["mean_accept_length"] == pytest.approx(1.875, abs=4 * 1.053 / min_steps ** 0.5)
    for k, share in enumerate(on["accept_per_position"], start=1):
        assert share == pytest.approx(0.5 ** k, abs=4 * 0.5 / min_steps ** 0.5)
    assert list(record)[0] == "label" and record["label"] == LABEL
    assert record["synthetic_acceptance"] == {"p": 0.5, "label": LABEL, "expected_mean_accept_length": 1.875}
    assert on["label"] == LABEL and "label" not in record["batches"][0]["spec_off"]
    assert stdout.count(LABEL) == 2
    assert len(record["plots"]) == 2
    for png in record["plots"]:
        assert LABEL in plot_titles[png]


# ---- it cannot be turned on from anywhere else --------------------------------------------------

@pytest.mark.parametrize("name", ["synthetic_acceptance", "bench_synthetic_acceptance"])
def test_not_an_engine_argument(name):
    from tandem import Engine
    from tandem.engine.engine import EngineArgs

    assert not [f for f in EngineArgs.names() if "synthetic" in f]
    with pytest.raises(TypeError, match="unknown Engine arguments"):
        Engine("/nonexistent", **{name: 0.5})


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_not_a_generate_or_serve_flag(command, capsys):
    from tandem.cli import build_parser

    with pytest.raises(SystemExit) as e:
        build_parser().parse_args([command, "--synthetic-acceptance", "0.5"])
    assert e.value.code == 2
    assert "unrecognized arguments: --synthetic-acceptance" in capsys.readouterr().err


def test_only_bench_code_sets_the_hook():
    """The worker's hook attribute is named in its own file and in tandem/bench only."""
    users = set()
    for root, _, files in os.walk(REPO_SRC):
        for f in files:
            if f.endswith(".py") and "bench_synthetic_acceptance" in open(os.path.join(root, f)).read():
                users.add(os.path.relpath(os.path.join(root, f), REPO_SRC))
    assert users == {os.path.join("speculative", "worker.py"), os.path.join("bench", "synthetic.py")}


def test_a_normal_engine_verifies(tiny_pair):
    from tandem import Engine, SamplingParams

    target, head, _ = tiny_pair
    params = SamplingParams(max_new_tokens=12, temperature=0)
    with Engine(target, device="cpu", dtype="float32", speculative_algorithm="EAGLE3",
                speculative_draft_model_path=head, max_total_tokens=256) as engine:
        assert getattr(engine.runner.spec, "bench_synthetic_acceptance", None) is None
        spec_out = engine.generate(input_ids=[[5, 6, 7]], sampling_params=params)
    with Engine(target, device="cpu", dtype="float32", max_total_tokens=256) as engine:
        plain = engine.generate(input_ids=[[5, 6, 7]], sampling_params=params)
    assert spec_out[0].token_ids == plain[0].token_ids


def test_refused_without_speculation(bench):
    rc, _, _, stderr = bench("--preset", "tiny-test", "--synthetic-acceptance", "0.5", "--spec", "off")
    assert rc == 2 and "needs speculation" in stderr
