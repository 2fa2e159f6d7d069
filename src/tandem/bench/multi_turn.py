"""`tandem bench --workload multi-turn`: conversations as a chat server sees them, prefix cache on and off.

Every conversation starts with one system prompt shared by all; each turn adds a user message and the
model's answer, and the next turn sends the whole history again. Conversations start a few steps apart
and run side by side: each sends its next turn as soon as its answer is back, so turns of different
conversations interleave as a server sees them.
Prompts are random token ids (the shapes matter, not the words); answers are the engine's own greedy
tokens, so with and without the cache the same histories are sent (greedy outputs do not depend on it).

For each engine (prefix cache on / off, x speculation on / off) the record holds each turn's time to first
token, its cached prompt tokens, its acceptance lengths and the wall time; the summary compares turns 2..N
(the ones with history to reuse) with and without the cache. `--workload no-reuse` sends fresh random
prompts of the same lengths instead, to price the cache where nothing is shared. With `--repeats N` every
engine runs N times, cache on and off taking turns at going first (the first engine of a process may pay for
compiles its warm-up did not need, which would land on one side alone); the summary is each metric's median.
"""

from __future__ import annotations

import gc
import os
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field


@dataclass(frozen=True)
class MultiTurnConfig:
    engine_kwargs: dict
    preset: str | None = None
    workload: str = "multi-turn"  # or "no-reuse"
    conversations: int = 32
    turns: int = 6
    system_len: int = 1024
    user_len: int = 128
    answer_len: int = 128
    spec: str = "both"  # both | on | off
    # Runs of every engine; cache on goes first in odd runs and second in even ones, so that whatever the first
    # engine of a process pays (compiles for shapes the warm-up did not see) falls on both.
    repeats: int = 1
    synthetic_acceptance: float | tuple[float, ...] | None = None
    seed: int = 0
    out: str | None = None
    progress: bool = True
    command: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.workload not in ("multi-turn", "no-reuse"):
            raise ValueError(f"workload must be multi-turn or no-reuse (got {self.workload!r})")
        for name in ("conversations", "turns", "user_len", "answer_len", "repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1 (got {getattr(self, name)})")
        if self.system_len < 0:
            raise ValueError(f"system_len must be >= 0 (got {self.system_len})")

    @property
    def context_length(self) -> int:
        return self.system_len + self.turns * (self.user_len + self.answer_len) + 1


def run_conversations(engine, cfg: MultiTurnConfig, vocab: int, bar=None) -> dict:
    """Drives every conversation to its last turn on `engine`; returns per-turn records and wall time."""
    from tandem import SamplingParams

    rng = random.Random(cfg.seed)
    draw = lambda n: [rng.randrange(3, vocab) for _ in range(n)]  # noqa: E731 (ids 0-2: special tokens)
    system = draw(cfg.system_len)
    users = [[draw(cfg.user_len) for _ in range(cfg.turns)] for _ in range(cfg.conversations)]
    fresh = [[draw(cfg.system_len + t * (cfg.user_len + cfg.answer_len) + cfg.user_len) for t in range(cfg.turns)]
             for _ in range(cfg.conversations)] if cfg.workload == "no-reuse" else None
    params = SamplingParams(max_new_tokens=cfg.answer_len, temperature=0.0, ignore_eos=True)
    history = [list(system) for _ in range(cfg.conversations)]
    turn_of = [0] * cfg.conversations
    live: dict[str, dict] = {}
    records = []
    step_ms: list[float] = []  # each engine.step()'s wall time (a cached turn's first token waits a few)

    def send(c: int) -> None:
        t = turn_of[c]
        prompt = fresh[c][t] if fresh is not None else history[c] + users[c][t]
        rid = engine.add_request(prompt, params)
        live[rid] = {"conversation": c, "turn": t + 1, "prompt": prompt, "sent": time.perf_counter(),
                     "first": None, "sent_step": steps, "first_step": None}

    # Conversations start one after another, spread over one answer's worth of steps, so their turns arrive
    # apart as a server's do (started together, equal-length answers would keep them in lockstep: every
    # turn of every conversation would arrive in the same step).
    stagger = max(1, cfg.answer_len // cfg.conversations)
    not_started = list(range(cfg.conversations))
    steps = 0
    start = time.perf_counter()
    while not_started or engine.has_unfinished():
        while not_started and (steps >= not_started[0] * stagger or not engine.has_unfinished()):
            send(not_started.pop(0))
        before = time.perf_counter()
        out = engine.step()
        steps += 1
        now = time.perf_counter()
        step_ms.append(1e3 * (now - before))
        for d in out.deltas:
            rec = live.get(d.request_id)
            if rec is not None and rec["first"] is None and d.new_token_ids:
                rec["first"], rec["first_step"] = now, steps
        for fin in out.finished:
            rec = live.pop(fin.request_id)
            c = rec["conversation"]
            records.append({"conversation": c, "turn": rec["turn"], "prompt_tokens": len(rec["prompt"]),
                            "cached_tokens": fin.num_cached_tokens, "ttft_s": (rec["first"] or now) - rec["sent"],
                            "e2e_s": now - rec["sent"], "output_tokens": len(fin.token_ids),
                            # engine.step() calls from sending to the first token, the one it came in included
                            "ttft_steps": (rec["first_step"] or steps) - rec["sent_step"],
                            "accept_lengths": list(fin.spec_accept_lengths)})
            if bar is not None:
                bar.update()
            history[c] = rec["prompt"] + list(fin.token_ids)
            turn_of[c] += 1
            if turn_of[c] < cfg.turns:
                send(c)
    return {"records": sorted(records, key=lambda r: (r["conversation"], r["turn"])),
            "wall_s": time.perf_counter() - start, "step_ms": [round(x, 3) for x in step_ms]}


def summarize(run: dict) -> dict:
    """Time to first token, hit rate and acceptance over turns 2..N, against turn 1."""
    later = [r for r in run["records"] if r["turn"] >= 2]
    first = [r for r in run["records"] if r["turn"] == 1]
    ttft = sorted(r["ttft_s"] for r in later)
    lengths = [n for r in later for n in r["accept_lengths"]]
    lengths_cold = [n for r in first for n in r["accept_lengths"]]
    out_tokens = sum(r["output_tokens"] for r in run["records"])
    return {
        "ttft_p50_ms": 1e3 * _quantile(ttft, 0.5), "ttft_p99_ms": 1e3 * _quantile(ttft, 0.99),
        "hit_rate": sum(r["cached_tokens"] for r in later) / max(1, sum(r["prompt_tokens"] for r in later)),
        "mean_accept_length": sum(lengths) / len(lengths) if lengths else None,
        "mean_accept_length_turn1": sum(lengths_cold) / len(lengths_cold) if lengths_cold else None,
        "tokens_per_s": out_tokens / run["wall_s"], "wall_s": run["wall_s"],
        # With the cache a turn's first token is mostly steps of waiting (the one in flight, its own,
        # the overlap's lag), so TTFT is best read in steps.
        "steps": len(run.get("step_ms", ())), "step_ms_p50": _quantile(sorted(run.get("step_ms", ())), 0.5),
    }


def _quantile(xs: list[float], q: float) -> float:
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def run_multi_turn(cfg: MultiTurnConfig) -> dict:
    """Every engine of the workload, one at a time in this process; writes and returns the record."""
    import torch
    from tqdm import tqdm

    from tandem import Engine
    from tandem.bench import report, synthetic
    from tandem.bench.run import BenchConfig, resolve_engine_kwargs

    modes = [("spec_on", cfg.spec in ("both", "on")), ("spec_off", cfg.spec in ("both", "off"))]
    modes = [m for m, wanted in modes if wanted]
    engines = [(r, m, cache) for r in range(cfg.repeats) for m in modes
               for cache in (("cache_on", "cache_off") if r % 2 == 0 else ("cache_off", "cache_on"))]
    result = {"workload": cfg.workload, "commit": report.revision(), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
              "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
              "command": cfg.command, "config": {
        k: getattr(cfg, k) for k in ("conversations", "turns", "system_len", "user_len", "answer_len", "spec",
                                     "synthetic_acceptance", "seed", "preset", "repeats")},
        "runs": {}, "summary": {}, "engine_order": [], "repeat_runs": {}, "repeat_summaries": {}}
    with tempfile.TemporaryDirectory(prefix="tandem-multi-turn-") as root:
        bench_cfg = BenchConfig(engine_kwargs=cfg.engine_kwargs, preset=cfg.preset, batch_sizes=(cfg.conversations,),
                                input_len=cfg.context_length - 2, output_len=2, spec="on" if "spec_on" in modes else "off")
        spec_kw = resolve_engine_kwargs(bench_cfg, root)
        spec_kw["context_length"] = cfg.context_length
        plain_kw = dict(spec_kw, speculative_algorithm=None, speculative_draft_model_path=None)
        bar = tqdm(total=len(engines) * cfg.conversations * cfg.turns, desc=f"tandem bench {cfg.workload}",
                   unit="turn", disable=not cfg.progress)
        try:
            for repeat, mode, cache in engines:
                bar.set_postfix_str(f"{mode.replace('_', ' ')}, prefix {cache.replace('_', ' ')}")
                kw = dict(spec_kw if mode == "spec_on" else plain_kw, disable_prefix_caching=cache == "cache_off")
                engine = Engine(**kw)
                try:
                    if mode == "spec_on" and cfg.synthetic_acceptance is not None:
                        synthetic.install(engine, cfg.synthetic_acceptance, seed=cfg.seed)
                    vocab = engine.arch.vocab_size
                    warm = MultiTurnConfig(**{**cfg.__dict__, "conversations": 2, "turns": 2, "seed": cfg.seed + 1})
                    run_conversations(engine, warm, vocab)  # kernels, allocator: first-call costs
                    engine.flush_cache()
                    run = run_conversations(engine, cfg, vocab, bar)
                finally:
                    engine.shutdown()
                    del engine
                    gc.collect()
                    if torch.cuda.is_available():
                        torch.cuda.empty_cache()
                key = f"{mode}/{cache}"
                result["engine_order"].append(key)
                result["repeat_runs"].setdefault(key, []).append(run)
                result["repeat_summaries"].setdefault(key, []).append(summarize(run))
        finally:
            bar.close()
    for key, runs in result.pop("repeat_runs").items():
        result["runs"][key] = runs[0]
        if len(runs) > 1:
            result["runs"][key]["later_repeats"] = runs[1:]
        result["summary"][key] = _median_summary(result["repeat_summaries"][key])
    result["ratios"] = _ratios(result["summary"])
    result["ratios_by_repeat"] = [_ratios({k: v[r] for k, v in result["repeat_summaries"].items()})
                                  for r in range(cfg.repeats)]
    if cfg.synthetic_acceptance is not None:
        result["label"] = synthetic.LABEL
    out = cfg.out or report.default_out(cfg.workload)
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    result["json"] = out
    report.write_json(result, out)
    return result


def _median_summary(summaries: list[dict]) -> dict:
    """Each metric's median over the repeats (with two, their mean)."""
    out = {}
    for k, v in summaries[0].items():
        xs = sorted(s[k] for s in summaries if s[k] is not None)
        if not xs or not isinstance(v, (int, float)):
            out[k] = v
            continue
        mid = len(xs) // 2
        out[k] = xs[mid] if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2
    return out


def _ratios(summary: dict) -> dict:
    """Cache on against off, per speculation mode; speculation's speedup with and without the cache."""
    out = {}
    for mode in ("spec_on", "spec_off"):
        on, off = summary.get(f"{mode}/cache_on"), summary.get(f"{mode}/cache_off")
        if on and off:
            out[mode] = {"ttft_p50_off_over_on": off["ttft_p50_ms"] / on["ttft_p50_ms"],
                         "ttft_p99_off_over_on": off["ttft_p99_ms"] / on["ttft_p99_ms"],
                         "throughput_on_over_off": on["tokens_per_s"] / off["tokens_per_s"]}
            if on["mean_accept_length"] and off["mean_accept_length"]:
                out[mode]["accept_length_on_over_off"] = on["mean_accept_length"] / off["mean_accept_length"]
    for cache in ("cache_on", "cache_off"):
        s, p = summary.get(f"spec_on/{cache}"), summary.get(f"spec_off/{cache}")
        if s and p:
            out[f"spec_speedup/{cache}"] = s["tokens_per_s"] / p["tokens_per_s"]
    return out


def table(result: dict) -> str:
    lines = [f"{'engine':<20} {'TTFT p50 ms':>11} {'TTFT p99 ms':>11} {'hit rate':>8} {'accept':>6} {'tok/s':>8} "
             f"{'step p50 ms':>11}"]
    for key, s in result["summary"].items():
        acc = f"{s['mean_accept_length']:.2f}" if s["mean_accept_length"] else "-"
        lines.append(f"{key:<20} {s['ttft_p50_ms']:>11.1f} {s['ttft_p99_ms']:>11.1f} {s['hit_rate']:>8.3f} "
                     f"{acc:>6} {s['tokens_per_s']:>8.1f} {s['step_ms_p50']:>11.2f}")
    for key, r in result["ratios"].items():
        lines.append(f"{key}: " + (", ".join(f"{k} {v:.3f}" for k, v in r.items()) if isinstance(r, dict)
                                   else f"{r:.3f}"))
    return "\n".join(lines)


def main_from_namespace(ns) -> int:
    from tandem.bench.cli import synthetic_rate
    from tandem.engine_flags import engine_kwargs

    kw = engine_kwargs(ns)
    kw.pop("disable_prefix_caching", None)  # the workload runs both
    cfg = MultiTurnConfig(engine_kwargs=kw, preset=ns.preset, workload=ns.workload,
                          conversations=ns.conversations, turns=ns.conversation_turns, system_len=ns.system_len,
                          user_len=ns.user_len, answer_len=ns.answer_len, spec=ns.spec, repeats=ns.repeats,
                          synthetic_acceptance=synthetic_rate(ns), out=ns.out, progress=not ns.no_progress,
                          command=["tandem", *sys.argv[1:]])
    result = run_multi_turn(cfg)
    print(table(result))
    print(f"wrote {result['json']}")
    return 0
