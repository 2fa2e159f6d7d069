"""`tandem bench` end to end on a CPU: the JSON record, the plots, the table, and `--compare-hf`."""

import glob
import json
import os
import statistics

import pytest

METRICS = {"batch_size", "output_tokens", "total_s", "tokens_per_s", "ttft_ms", "ms_per_output_token",
           "iteration_ms", "decode_iterations"}
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_preset_both_modes_writes_json_and_plots(bench, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the default --out is relative: bench/results/bench-<preset>-<date>.json
    rc, _, stdout, _ = bench("--preset", "tiny-test", "--batch-sizes", "1", "3", "--input-len", "8",
                             "--output-len", "12", out=None)
    assert rc == 0
    [path] = glob.glob(str(tmp_path / "bench" / "results" / "bench-tiny-test-*.json"))
    record = json.load(open(path))
    assert record["model"]["preset"] == "tiny-test" and record["model"]["load_format"] == "dummy"
    assert record["model"]["draft"]["algorithm"] == "EAGLE3"
    assert record["batch_sizes"] == [1, 3] and record["modes"] == ["spec_on", "spec_off"]
    assert record["synthetic_acceptance"] is None and "label" not in record
    assert [r["batch_size"] for r in record["batches"]] == [1, 3]
    for row in record["batches"]:
        on, off = row["spec_on"], row["spec_off"]
        assert METRICS | {"mean_accept_length", "accept_per_position"} <= set(on)
        assert METRICS <= set(off) and "mean_accept_length" not in off
        assert on["output_tokens"] == off["output_tokens"] == 12 * row["batch_size"]
        assert 1.0 <= on["mean_accept_length"] <= 4.0 and len(on["accept_per_position"]) == 3
        assert row["speedup"] == pytest.approx(on["tokens_per_s"] / off["tokens_per_s"], rel=1e-3)
        assert row["latency_speedup"] > 0 and "hf" not in row
    assert len(record["plots"]) == 2
    for png in record["plots"]:
        with open(png, "rb") as f:
            assert f.read(8) == PNG_MAGIC
        assert os.path.dirname(os.path.abspath(png)) == os.path.dirname(path)
    assert "speedup" in stdout and os.path.relpath(path, tmp_path) in stdout and "SYNTHETIC" not in stdout


def test_spec_off_only_and_no_plots(bench, tiny_pair):
    rc, record, _, _ = bench("--model-path", tiny_pair[0], "--spec", "off", "--batch-sizes", "2",
                             "--input-len", "5", "--output-len", "6", "--no-plots")
    assert rc == 0
    [row] = record["batches"]
    assert set(row) == {"batch_size", "spec_off"} and "plots" not in record
    assert record["model"]["draft"] is None and record["model"]["load_format"] == "safetensors"


def test_paths_under_the_current_directory_are_recorded_relative(bench, tiny_pair, monkeypatch):
    # A record kept in a repository must not carry the checkout's location; paths elsewhere stay as given.
    root = os.path.dirname(tiny_pair[0])
    monkeypatch.chdir(root)
    rc, record, _, _ = bench("--model-path", tiny_pair[0], "--speculative-algorithm", "EAGLE3",
                             "--speculative-draft-model-path", tiny_pair[1], "--batch-sizes", "1",
                             "--input-len", "5", "--output-len", "4", "--no-plots")
    assert rc == 0
    assert record["model"]["model_path"] == "target" and record["model"]["draft"]["path"] == "eagle3"
    assert record["engine_args"]["speculative_draft_model_path"] == "eagle3"
    assert os.path.isabs(record["json"]) and not record["json"].startswith(root)  # (--out lies outside root)


def test_repeats_report_the_median_and_keep_every_run(bench, tiny_pair):
    rc, record, _, _ = bench("--model-path", tiny_pair[0], "--spec", "off", "--batch-sizes", "2",
                             "--input-len", "5", "--output-len", "6", "--no-plots", "--repeats", "3")
    assert rc == 0 and record["repeats"] == 3
    [row] = record["batches"]
    off = row["spec_off"]
    assert len(off["runs"]) == 3 and all(r["output_tokens"] == 12 for r in off["runs"])
    for key in ("tokens_per_s", "ttft_ms", "iteration_ms", "total_s"):
        assert off[key] == statistics.median(r[key] for r in off["runs"]), key


@pytest.mark.parametrize("turns", ["step", "run", "sequential"])
def test_modes_take_turns(bench, tiny_pair, monkeypatch, turns):
    """By default both engines are held and take turns, on a CPU step by step (each engine's run timed on
    its own calls; the order reversed every round), with --turns run run by run, so a slow stretch of the
    machine lands on both modes; --sequential runs one engine's batches, then the other's."""
    from tandem.bench import measure
    from tandem.bench import run as bench_run

    order, steps = [], []
    real_run, real_step = bench_run.run_batch, measure.BatchRun.step

    def recording_run(engine, prompts, output_len, *args, **kwargs):
        if output_len == 10:  # the timed runs (warm-up runs are 8 tokens)
            order.append(("on" if engine.runner.spec is not None else "off", len(prompts)))
        return real_run(engine, prompts, output_len, *args, **kwargs)

    def recording_step(run):
        if run.busy_clock:  # (the timed runs in lockstep; run_batch's runs keep the wall clock)
            steps.append(("on" if run.spec is not None else "off", len(run.prompts), None))
        return real_step(run)

    monkeypatch.setattr(bench_run, "run_batch", recording_run)
    monkeypatch.setattr(measure.BatchRun, "step", recording_step)
    flags = {"step": [], "run": ["--turns", "run"], "sequential": ["--sequential"]}[turns]
    rc, record, _, _ = bench("--model-path", tiny_pair[0], "--speculative-algorithm", "EAGLE3",
                             "--speculative-draft-model-path", tiny_pair[1], "--batch-sizes", "1", "2",
                             "--input-len", "5", "--output-len", "10", "--no-plots", "--repeats", "2", *flags)
    assert rc == 0
    if turns == "sequential":
        assert order == [("on", 1)] * 2 + [("on", 2)] * 2 + [("off", 1)] * 2 + [("off", 2)] * 2 and not steps
    elif turns == "run":
        assert order == [("on", 1), ("off", 1)] * 2 + [("on", 2), ("off", 2)] * 2 and not steps
    else:  # (the order within a lockstep run: tests/bench/test_lockstep.py)
        assert not order and record["turns"] == "step"
        assert {(mode, b) for mode, b, _ in steps} == {(m, b) for m in ("on", "off") for b in (1, 2)}
    assert all(len(row[mode]["runs"]) == 2 for row in record["batches"] for mode in ("spec_on", "spec_off"))
    for row in record["batches"]:
        on, off = row["spec_on"], row["spec_off"]
        if turns == "sequential":  # no pairs: the ratio of the medians
            assert row["speedup"] == pytest.approx(on["tokens_per_s"] / off["tokens_per_s"], rel=1e-3)
            assert "speedup_by_run" not in row
        else:  # runs that took turns: the upper median of the pairs' own ratios
            by_run = [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(on["runs"], off["runs"])]
            assert row["speedup_by_run"] == pytest.approx(by_run, rel=1e-3)
            assert row["speedup"] == pytest.approx(max(by_run), rel=1e-3)


@pytest.mark.parametrize("args, message", [
    (["--spec", "on"], "speculation needs"),  # a checkpoint without a draft
    (["--repeats", "0"], "--repeats"),
    (["--preset", "tiny-test"], "--preset or --model-path"),
    (["--output-len", "1"], "--output-len"),
    (["--compare-hf", "--temperature", "0.7"], "--temperature 0"),
])
def test_bad_arguments_exit_2(bench, tiny_pair, args, message):
    rc, _, _, stderr = bench("--model-path", tiny_pair[0], *args)
    assert rc == 2 and message in stderr


def test_compare_hf_on_a_checkpoint(bench, tiny_pair):
    """transformers loads the checkpoint itself (from_pretrained); tandem's greedy tokens, with
    speculation and without, equal its generate's at every batch size."""
    target, head, _ = tiny_pair
    rc, record, stdout, _ = bench("--model-path", target, "--speculative-algorithm", "EAGLE3",
                                  "--speculative-draft-model-path", head, "--compare-hf", "--batch-sizes", "1", "4",
                                  "--input-len", "7", "--output-len", "24", "--dtype", "float32")
    assert rc == 0
    for row in record["batches"]:
        hf = row["hf"]
        assert METRICS <= set(hf) and hf["output_tokens"] == 24 * row["batch_size"] and hf["tokens_per_s"] > 0
        assert hf["match_spec_off"] == {"requests_equal": 1.0, "first_difference_at": None}
        assert hf["match_spec_on"] == {"requests_equal": 1.0, "first_difference_at": None}
    assert "hf tok/s" in stdout


def test_compare_hf_on_a_preset_copies_tandems_weights(bench):
    rc, record, _, _ = bench("--preset", "tiny-test", "--spec", "off", "--compare-hf", "--batch-sizes", "2",
                             "--input-len", "6", "--output-len", "16", "--no-plots")
    assert rc == 0
    assert record["batches"][0]["hf"]["match_spec_off"]["requests_equal"] == 1.0


@pytest.mark.parametrize("family", ["llama3", "llama2_tied", "llama_headdim", "qwen3"])
def test_transformers_model_from_tandems_weights(tmp_path, family):
    """The copy --compare-hf makes for random weights: tandem's tensors under transformers' names
    (merged q/k/v and gate/up split; tied, biased, q/k-normed variants) are exactly the checkpoint's,
    and the transformers model built from them computes the same logits as the original."""
    import torch

    from tandem import Engine
    from tandem.bench.hf_compare import build_hf_model, hf_state_dict
    from tests.models.tiny_checkpoints import make_checkpoint

    original = make_checkpoint(family, str(tmp_path), seed=1)
    with Engine(str(tmp_path), device="cpu", dtype="float32", max_total_tokens=64) as engine:
        ours = hf_state_dict(engine.runner.model)
        copy = build_hf_model(engine, copy_weights=True)
    theirs = {k: v for k, v in original.state_dict().items() if not k.endswith("inv_freq")}
    if original.config.tie_word_embeddings:
        theirs.pop("lm_head.weight")
    assert set(ours) == set(theirs)
    for name, tensor in theirs.items():
        assert torch.equal(ours[name], tensor), name
    ids = torch.tensor([[5, 9, 17, 3, 200, 41]])
    with torch.no_grad():
        assert torch.equal(copy(ids).logits, original(ids).logits)


def test_sweep_writes_grid_worst_points_and_heatmaps(tmp_path):
    """`tandem bench --sweep` on the tiny preset: every grid point has plain, fixed and adaptive runs and
    the three ratios, the worst points are the minima, and one labelled heatmap PNG per temperature."""
    import json
    import subprocess
    import sys

    out = tmp_path / "sweep.json"
    proc = subprocess.run([sys.executable, "-m", "tandem", "bench", "--sweep", "--preset", "tiny-test",
                           "--batch-sizes", "1", "3", "--sweep-acceptance", "0", "0.9", "--sweep-temperatures", "0",
                           "1", "--input-len", "6", "--output-len", "12", "--out", str(out), "--no-progress"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads(out.read_text())
    points = record["points"]
    assert len(points) == 2 * 2 * 2
    for p in points:
        assert {"plain", "fixed", "adaptive"} <= set(p)
        plain, fixed, adaptive = (p[m]["tokens_per_s"] for m in ("plain", "fixed", "adaptive"))
        # (one run each: the pairs' ratios are the medians' ratios)
        for key in ("adaptive_speedup", "adaptive_speedup_of_medians"):
            assert p[key] == pytest.approx(adaptive / plain, rel=1e-3)
        for key in ("adaptive_vs_best", "adaptive_vs_best_of_medians"):
            assert p[key] == pytest.approx(adaptive / max(plain, fixed), rel=1e-3)
        tau = p["fixed"]["mean_accept_length"]  # the synthetic rate reached the fixed-depth engine
        assert tau == 1.0 if p["acceptance"] == 0 else tau > 2.0
    assert record["worst"]["adaptive_vs_plain"]["adaptive_speedup"] == min(p["adaptive_speedup"] for p in points)
    assert record["complete"] and record["label"] and "SYNTHETIC" in record["label"]
    assert [os.path.basename(p) for p in record["plots"]] == ["sweep-T0.png", "sweep-T1.png"]
    assert all(os.path.getsize(p) > 10_000 for p in record["plots"])
    assert "worst adaptive/plain" in proc.stdout


def test_sweep_ratios_pair_the_runs_that_took_turns():
    """Five runs each, taken in turns (tokens per second; hand-made after the H200 point at T 1, acceptance
    0.81, batch 8). Run 3 stalled for every engine; adaptive's runs 4 and 5 alone stalled. Pair by pair,
    adaptive / best of plain and fixed is 1, 1, 1, 0.9 and 0.95: median 1. The median runs (plain 100, fixed
    200, adaptive 190) give 0.95: stalls of one engine decide."""
    from tandem.bench.sweep import point_ratios

    runs = {"plain": [100, 100, 80, 100, 100], "fixed": [200, 200, 160, 200, 200],
            "adaptive": [200, 200, 160, 180, 190]}
    point = {name: {"tokens_per_s": sorted(tps)[2], "runs": [{"tokens_per_s": t} for t in tps]}
             for name, tps in runs.items()}
    ratios = point_ratios(point)
    assert ratios["adaptive_vs_best"] == 1.0 and ratios["adaptive_speedup"] == 2.0 and ratios["fixed_speedup"] == 2.0
    assert ratios["adaptive_vs_best_of_medians"] == 0.95 and ratios["adaptive_speedup_of_medians"] == 1.9


@pytest.mark.parametrize("trace", [False, True], ids=["default", "trace"])
def test_step_traces_only_when_asked(bench, tiny_pair, trace):
    """A record leaves each run's per-step trace out unless --trace asks (it is most of a sweep's size); with
    it, every adaptive run lists one entry per decode step, each naming the depth whose results it took."""
    rc, record, _, _ = bench("--model-path", tiny_pair[0], "--speculative-algorithm", "EAGLE3",
                             "--speculative-draft-model-path", tiny_pair[1], "--batch-sizes", "2", "--input-len", "5",
                             "--output-len", "10", "--no-plots", "--repeats", "2", *(["--trace"] if trace else []))
    assert rc == 0
    [row] = record["batches"]
    runs = row["spec_on"]["runs"]
    assert len(runs) == 2 and "step_trace" not in row["spec_on"] and "step_trace" not in row["spec_off"]
    assert all("step_trace" not in r for r in row["spec_off"]["runs"])
    if not trace:
        assert all("step_trace" not in r for r in runs)
        return
    for r in runs:
        assert len(r["step_trace"]) == r["decode_iterations"] > 0
        assert all(ms > 0 and -1 <= depth <= 3 for ms, depth, _ in r["step_trace"])


def test_record_names_the_commit_it_measured(bench, tiny_pair):
    import subprocess

    src = os.path.join(os.path.dirname(__file__), "..", "..", "src", "tandem", "bench")
    git = subprocess.run(["git", "-C", src, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    rc, record, _, _ = bench("--model-path", tiny_pair[0], "--spec", "off", "--batch-sizes", "1",
                             "--input-len", "5", "--output-len", "4", "--no-plots")
    assert rc == 0
    if git.returncode != 0:  # (a copy of the tree without its git history)
        assert record["commit"] is None
    else:
        assert record["commit"].split("-")[0] == git.stdout.strip()
