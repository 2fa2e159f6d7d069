"""The adaptive policy on a modelled clock: the demo pair decodes on this machine, and every time the policy
is told (start-up replays, each step's, the draft prefill's, catch-ups') comes from a cost model of another
machine instead of this one's clock.

python bench/policy_clock.py --batch-sizes 1 8 32 --runs 3 [--model h200-fast-host] [--warmup-len 8] --out clock.json

The engine is the real one (EAGLE-3 chain of 3, adaptive depth, the scheduler, the worker and the policy as
they run anywhere), so acceptance is the pair's own and every rule of the policy acts. Only time is modelled:
each step's time is the model's for its shape and padded batch, the run's decode time is the sum of its
steps', and plain decoding and fixed depth are priced by the same model (fixed depth's iterations counted by
a fixed-depth engine on this machine, plain decoding's one a token). So a policy change can be tried against
a host-bound GPU's costs without the GPU. What the model leaves out it cannot show: the host's speed moving
from call to call, the overlap's lag in results, steps with prompt chunks (not timed by the policy and not
counted here).

The models (MODELS below) are the demo pair on an H200: replays as the worker timed them at start-up; online,
a step takes the longer of its replay x device_overhead and its host work, plain decoding's online step plus
what keeping draft state adds (depth 0) or what drafting adds. "h200-fast-host" is from bench/results/
sampling-demo-h200-c2d8682.json and policy-trace-demo-h200-{414a194,c2d8682}.json; "h200-slow-host" has the
plain and fixed-depth steps of sampling-demo-h200-46d1c77.json (a machine whose host ran plain decoding's
batch-1 step in 0.38 ms against 0.22).
"""

import argparse
import bisect
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
from tandem import Engine  # noqa: E402
from tandem.bench.demo_batches import add_batch_arguments, demo_engine_kwargs  # noqa: E402
from tandem.bench.measure import random_prompts, run_batch  # noqa: E402
from tandem.layers.sampler import GRAPHED_SAMPLING, step_mode  # noqa: E402
from tandem.speculative.policy.shape import DraftShape  # noqa: E402

# Padded batch sizes with CUDA graphs (the worker pads a batch to the next one, as on the GPU).
GRAPH_SIZES = [1, 2, 4, 8, 16, 24, 32]
FAST_HOST = {
    # padded batch -> graph replay ms at depth 0..3, and the dormant step's
    "replay": {1: [0.2164, 0.3886, 0.452, 0.5147], 8: [0.2155, 0.4179, 0.5047, 0.5402],
               32: [0.2506, 0.4592, 0.5191, 0.6093]},
    "dormant_replay": {1: 0.1987, 8: 0.2164, 32: 0.2301},
    # plain decoding's online step (sampling bench, fast host): a dormant batch's host work
    "plain_online": {1: 0.223, 8: 0.317, 32: 1.183},
    # host work beyond plain decoding's: a depth-0 step keeping draft state (trace: depth 0 online 0.30-0.32
    # ms at batch 1, 0.39 at batch 8), a drafting step (fixed depth's chain of 3 at batch 32: 1.33 ms)
    "depth0_host_extra": 0.08,
    "drafting_host_extra": 0.15,
    # online device time over a replay (fixed depth at batch 1 and 8: 0.563 and 0.600 ms against 0.515, 0.540)
    "device_overhead": 1.1,
    # the draft's prefill call: start-up timings (tokens, ms; not recorded: assumed 0.5 ms fixed and 0.24 us a
    # token of device work), and online ms = fixed + per token x tokens (the per-token part from fixed depth's
    # two prompt steps at batch 32, 14.5 and 13.4 ms against plain's 9.4 and 8.7: about 2.4 us a prompt token;
    # the fixed part assumed)
    "draft_prefill_startup": [(16, 0.5), (512, 0.62)],
    "draft_prefill_online": (1.0, 0.0024),
    # a catch-up call (the whole window of 32 steps), ms: the recorded catch-up share, 0.0038 / 0.0043 /
    # 0.0053 ms a deferred step, times 32
    "catch_up": {1: 0.12, 8: 0.14, 32: 0.17},
}
# Plain decoding 0.383 / 0.584 / 1.327 ms at batch 1 / 8 / 32 and fixed depth 0.5545 / 0.6225 / 1.4521: drafting's
# extra host work fits at 0.04 (depth 0's is not recorded there; taken as half of it).
SLOW_HOST = dict(FAST_HOST, plain_online={1: 0.383, 8: 0.584, 32: 1.327}, depth0_host_extra=0.02,
                 drafting_host_extra=0.04)
MODELS = {"h200-fast-host": FAST_HOST, "h200-slow-host": SLOW_HOST}
MODEL = dict(FAST_HOST)  # the one in use (`--model`)


def _at(table: dict, b: int) -> float | list[float]:
    """A per-batch entry at padded batch b: linear between the recorded sizes, clamped at their ends."""
    keys = sorted(table)
    if b <= keys[0]:
        return table[keys[0]]
    if b >= keys[-1]:
        return table[keys[-1]]
    i = bisect.bisect_left(keys, b)
    lo, hi = keys[i - 1], keys[i]
    f = (b - lo) / (hi - lo)
    a, c = table[lo], table[hi]
    return [x + f * (y - x) for x, y in zip(a, c)] if isinstance(a, list) else a + f * (c - a)


def online_ms(b: int, depth: int | None) -> float:
    """The modelled online step at padded batch b: depth None for a dormant batch's (plain decoding's)."""
    plain = _at(MODEL["plain_online"], b)
    if depth is None:
        return max(_at(MODEL["dormant_replay"], b) * MODEL["device_overhead"], plain)
    extra = MODEL["depth0_host_extra"] if depth == 0 else MODEL["drafting_host_extra"]
    return max(_at(MODEL["replay"], b)[depth] * MODEL["device_overhead"], plain + extra)


def _padded(b: int) -> int:
    return next((s for s in GRAPH_SIZES if s >= b), b)


class ModelledClock:
    """Installs the model into an engine's speculative worker and counts its decode steps' modelled time."""

    def __init__(self, engine):
        self.engine = engine
        self.worker = worker = engine.runner.spec
        self.policy = policy = worker.policy
        self.decode_ms, self.steps = 0.0, []
        worker.padded_batch = _padded
        if policy is not None:
            self._install_startup(policy)
            real_prefill = policy.observe_draft_prefill
            fixed, per_token = MODEL["draft_prefill_online"]
            policy.observe_draft_prefill = lambda tokens, ms: real_prefill(tokens, fixed + per_token * tokens)
        real_inform = worker._inform_policy

        def inform(handle, lens, step_ms):
            if not handle.prefill_ids:
                b = handle.padded_batch
                ms = online_ms(b, None if handle.dormant else handle.shape.depth)
                handle.launch_ms = ms
                handle.catch_up_ms = _at(MODEL["catch_up"], b) if handle.catch_up_queries else 0.0
                self.decode_ms += ms + handle.catch_up_ms
                self.steps.append((b, "dormant" if handle.dormant else handle.shape.name))
            return real_inform(handle, lens, step_ms)

        worker._inform_policy = inform

    def _install_startup(self, policy) -> None:
        window = self.worker.pool.catch_up_window
        # (every graphed sampling mode at the greedy one's costs: sampled steps ran within 1.04x of them)
        modes = [step_mode(features) for features in GRAPHED_SAMPLING]
        for b in GRAPH_SIZES:
            for mode in modes:
                for d, ms in enumerate(_at(MODEL["replay"], b)):
                    policy.observe_time(b, DraftShape(d), ms, weight=1.0, mode=mode)
                policy.observe_dormant_time(b, _at(MODEL["dormant_replay"], b), weight=1.0, mode=mode)
            self.worker.catch_up_ms[b] = _at(MODEL["catch_up"], b)
            policy.observe_catch_up(b, self.worker.catch_up_ms[b] / window)
        policy.observe_draft_prefill_startup(MODEL["draft_prefill_startup"])

    def run(self, prompts, output_len: int, temperature: float = 0.0, seed: int = 0) -> dict:
        """One batch run; its decode steps' modelled time and what ran. Sampled runs are seeded, so every
        engine and every policy tried draws the same tokens (seeded speculative sampling gives plain
        decoding's)."""
        self.decode_ms, self.steps = 0.0, []
        sampling = {"seed": seed} if temperature > 0 else {}
        metrics, _ = run_batch(self.engine, prompts, output_len, temperature=temperature, **sampling)
        by_shape = {}
        for _, name in self.steps:
            by_shape[name] = by_shape.get(name, 0) + 1
        return {"decode_ms": round(self.decode_ms, 3), "steps": len(self.steps), "by_shape": by_shape,
                "mean_accept_length": metrics.mean_accept_length, "dormant_admitted": metrics.dormant_admitted}


def main():
    ap = argparse.ArgumentParser()
    add_batch_arguments(ap, warmup_len=8)
    ap.add_argument("--model", choices=sorted(MODELS), default="h200-fast-host")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--label", default=None, help="kept in the record (which policy ran, for comparisons)")
    ap.add_argument("--out", default=None)
    ns = ap.parse_args()
    MODEL.clear()
    MODEL.update(MODELS[ns.model])
    kw = demo_engine_kwargs(ns.batch_sizes, ns.input_len, ns.output_len)
    engines = {"adaptive": Engine(**kw, speculative_adaptive=True), "fixed": Engine(**kw, speculative_adaptive=False)}
    clocks = {name: ModelledClock(engine) for name, engine in engines.items()}
    rows = []
    try:
        for b in ns.batch_sizes:
            prompts = random_prompts(b, ns.input_len, engines["adaptive"].arch.vocab_size, seed=0)
            for clock in clocks.values():
                if ns.warmup_len:
                    clock.run(prompts, ns.warmup_len, ns.temperature, seed=b)
            for i in range(ns.runs):
                runs = {name: clock.run(prompts, ns.output_len, ns.temperature, seed=1000 * b + i)
                        for name, clock in clocks.items()}
                tokens = b * (ns.output_len - 1)  # (decode steps follow every row's first token)
                plain_ms = (ns.output_len - 1) * online_ms(_padded(b), None)
                row = {"batch": b, "run": i, **runs, "plain_decode_ms": round(plain_ms, 3)}
                for name in clocks:
                    row[f"{name}_vs_plain"] = round(plain_ms / runs[name]["decode_ms"], 4)
                row["adaptive_vs_better"] = round(row["adaptive_vs_plain"] / max(1.0, row["fixed_vs_plain"]), 4)
                row["tokens"] = tokens
                rows.append(row)
                print(json.dumps({k: row[k] for k in ("batch", "run", "adaptive_vs_plain", "fixed_vs_plain",
                                                      "adaptive_vs_better")}
                                 | {"adaptive_steps": runs["adaptive"]["by_shape"]}), flush=True)
    finally:
        for engine in engines.values():
            engine.shutdown()
    if ns.out:
        with open(ns.out, "w") as f:
            json.dump({"tool": "bench/policy_clock.py", "date": time.strftime("%Y-%m-%d %H:%M:%S"),
                       "command": "python " + " ".join(sys.argv), "label": ns.label, "model_name": ns.model,
                       "temperature": ns.temperature,
                       "model": MODEL, "graph_sizes": GRAPH_SIZES, "rows": rows}, f, separators=(",", ":"))


if __name__ == "__main__":
    main()
