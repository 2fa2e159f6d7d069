"""`tandem bench --sweep`: plain decoding, fixed-depth and adaptive speculation over a grid of synthetic
acceptance rates, batch sizes and temperatures, all three in one process; JSON and heatmaps.

At each grid point every draft token is accepted with probability p (tandem.bench.synthetic: BENCHMARK
ONLY, the emitted tokens are the draft's), which the adaptive policy sees exactly as it sees real
acceptance: through the accept lengths of each verify step. Its acceptance averages are reset to the
prior at each point (a fresh deployment); its cost table, timed at start-up, stays.
"""

from __future__ import annotations

import gc
import os
import tempfile
import time
from dataclasses import dataclass

from tandem.bench import report, synthetic
from tandem.bench.measure import median_of_runs, random_prompts, run_batch, upper_median

SWEEP_ACCEPTANCE = (0.0, 0.3, 0.6, 0.81, 0.95)
SWEEP_BATCH_SIZES = (1, 8, 32, 64, 128)
SWEEP_TEMPERATURES = (0.0, 1.0)
MODES = ("plain", "fixed", "adaptive")


@dataclass(frozen=True)
class SweepConfig:
    engine_kwargs: dict  # the speculative engine (run_bench's resolved arguments)
    acceptance: tuple[float, ...] = SWEEP_ACCEPTANCE
    batch_sizes: tuple[int, ...] = SWEEP_BATCH_SIZES
    temperatures: tuple[float, ...] = SWEEP_TEMPERATURES
    input_len: int = 64
    output_len: int = 64
    repeats: int = 1
    out: str | None = None
    plots: bool = True
    progress: bool = True
    command: list[str] | None = None
    trace: bool = False  # keep each speculative run's per-step trace in the record


def run_sweep(cfg: SweepConfig) -> dict:
    import torch
    from tqdm import tqdm

    from tandem import Engine

    kw = cfg.engine_kwargs
    out = cfg.out or report.default_out("sweep")
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    points = []
    result = {
        "tool": "tandem bench --sweep", "date": time.strftime("%Y-%m-%d %H:%M:%S"), "commit": report.revision(),
        "command": cfg.command,
        "label": synthetic.LABEL, "device": str(torch.cuda.get_device_name(0)) if torch.cuda.is_available() else "cpu",
        # A preset's paths are temporary directories: not worth recording.
        "engine_args": {k: v for k, v in kw.items() if not (kw.get("load_format") == "dummy" and k.endswith("model_path"))},
        "input_len": cfg.input_len, "output_len": cfg.output_len, "repeats": cfg.repeats, "json": out,
        "complete": False, "points": points,
    }
    engines = {"plain": Engine(**dict(kw, speculative_algorithm=None, speculative_draft_model_path=None)),
               "fixed": Engine(**dict(kw, speculative_adaptive=False)),
               "adaptive": Engine(**dict(kw, speculative_adaptive=True))}
    total = len(cfg.temperatures) * len(cfg.acceptance) * len(cfg.batch_sizes)
    bar = tqdm(total=total, desc="tandem bench --sweep", unit="point", disable=not cfg.progress)
    try:
        vocab = engines["plain"].arch.vocab_size
        for b in cfg.batch_sizes:  # warm-up: first-call costs stay out of the numbers
            for engine in engines.values():
                run_batch(engine, random_prompts(b, cfg.input_len, vocab, seed=10_007), 8)
        for temperature in cfg.temperatures:
            for p in cfg.acceptance:
                for name in ("fixed", "adaptive"):
                    synthetic.install(engines[name], p, seed=0)
                for b in cfg.batch_sizes:
                    bar.set_postfix_str(f"T {temperature}, p {p}, batch {b}")
                    prompts = random_prompts(b, cfg.input_len, vocab, seed=0)
                    point = {"temperature": temperature, "acceptance": p, "batch_size": b}
                    # Each point starts the policy from its prior (it must learn this acceptance), and the
                    # engines take turns run by run: a slow stretch of the GPU (plain decoding's batch-128
                    # step ran 6.4 ms at one point and 8.0 ms at the next) then lands on all three alike.
                    engines["adaptive"].runner.spec.policy.reset_acceptance()
                    runs = {name: [] for name in engines}
                    for _ in range(cfg.repeats):
                        for name, engine in engines.items():
                            runs[name].append(run_batch(engine, prompts, cfg.output_len, temperature,
                                                        trace=cfg.trace)[0])
                    for name in engines:
                        point[name] = median_of_runs(runs[name])
                    point.update(point_ratios(point))
                    points.append(point)
                    result["worst"] = worst_points(points)
                    _save(result, out)  # after every point: an interrupted sweep keeps what it measured
                    bar.update()
    finally:
        bar.close()
        for engine in engines.values():
            engine.shutdown()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    result["complete"] = True
    if cfg.plots:
        result["plots"] = plot_heatmaps(result, os.path.splitext(out)[0])
    _save(result, out)
    return result


def _save(result: dict, path: str) -> None:
    tmp = f"{path}.tmp"
    report.write_json(result, tmp)
    os.replace(tmp, path)


def point_ratios(point: dict) -> dict:
    """A grid point's ratios from its engines' runs, pair by pair: the engines took turns run by run, so run i
    of each met the same stretch of the machine, and each ratio is the upper median of the runs' own ratios
    (as `tandem bench` compares interleaved runs). The ratios of the engines' median runs stay beside them
    ("..._of_medians"). Those mix stretches: on an H200 one run whose prompt step stalled was adaptive's
    median run and read 0.927x fixed depth, where the pairs' median read 0.994x."""
    runs = {name: point[name].get("runs", [point[name]]) for name in MODES}
    pairs = list(zip(*(runs[name] for name in MODES)))
    tps = [[run["tokens_per_s"] for run in pair] for pair in pairs]  # (plain, fixed, adaptive) per run
    medians = [point[name]["tokens_per_s"] for name in MODES]
    out = {}
    for key, ratio in (("fixed_speedup", lambda plain, fixed, adaptive: fixed / plain),
                       ("adaptive_speedup", lambda plain, fixed, adaptive: adaptive / plain),
                       ("adaptive_vs_best", lambda plain, fixed, adaptive: adaptive / max(plain, fixed))):
        out[key] = round(upper_median(ratio(*row) for row in tps), 4)
        out[f"{key}_of_medians"] = round(ratio(*medians), 4)
    return out


def worst_points(points: list[dict]) -> dict:
    """The grid's worst point for adaptive against plain and against the better of plain and fixed."""
    def brief(p, key):
        return {k: p[k] for k in ("temperature", "acceptance", "batch_size")} | {key: p[key]}

    return {"adaptive_vs_plain": brief(min(points, key=lambda p: p["adaptive_speedup"]), "adaptive_speedup"),
            "adaptive_vs_best": brief(min(points, key=lambda p: p["adaptive_vs_best"]), "adaptive_vs_best")}


def plot_heatmaps(result: dict, stem: str) -> list[str]:
    """One PNG per temperature: speedup over plain of fixed depth and of adaptive, acceptance x batch."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    points = result["points"]
    accs = sorted({p["acceptance"] for p in points})
    sizes = sorted({p["batch_size"] for p in points})
    for temperature in sorted({p["temperature"] for p in points}):
        fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
        for ax, key, title in ((axes[0], "fixed_speedup", "fixed depth"), (axes[1], "adaptive_speedup", "adaptive")):
            grid = [[next(p[key] for p in points if p["temperature"] == temperature and p["acceptance"] == a
                          and p["batch_size"] == b) for b in sizes] for a in accs]
            im = ax.imshow(grid, cmap="RdYlGn", vmin=0.5, vmax=2.5, origin="lower", aspect="auto")
            for i, row in enumerate(grid):
                for j, v in enumerate(row):
                    ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=8)
            ax.set_xticks(range(len(sizes)), [str(s) for s in sizes])
            ax.set_yticks(range(len(accs)), [str(a) for a in accs])
            ax.set_xlabel("batch size")
            ax.set_ylabel("synthetic acceptance p")
            ax.set_title(f"{title}: speedup over plain (T={temperature})")
        fig.colorbar(im, ax=axes, shrink=0.8)
        fig.suptitle(f"{result['device']} - {result['label']}", fontsize=9)
        path = f"{stem}-T{temperature:g}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def sweep_with_preset(cfg: SweepConfig, preset: str | None) -> dict:
    with tempfile.TemporaryDirectory(prefix="tandem-sweep-") as root:
        from tandem.bench.run import BenchConfig, resolve_engine_kwargs

        bench_cfg = BenchConfig(engine_kwargs=cfg.engine_kwargs, preset=preset, batch_sizes=cfg.batch_sizes,
                                input_len=cfg.input_len, output_len=cfg.output_len)
        kw = resolve_engine_kwargs(bench_cfg, root)
        return run_sweep(SweepConfig(**{**cfg.__dict__, "engine_kwargs": kw}))
