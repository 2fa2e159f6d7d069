"""One timed offline run: a batch of prompts added at once and stepped to completion."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch

from tandem.layers.sampler import SamplingFeatures, step_mode
from tandem.request import SamplingParams


def admit_every_request_dormant(engine) -> None:
    """BENCHMARK ONLY: the speculative `engine`'s policy admits every request dormant (no draft prefill, no
    catch-ups; a batch of them runs plain decoding's step), whatever it would decide: the floor of the depth-0
    path, and what acceptance 0 settles to. The policy's own admission runs first, for its bookkeeping."""
    policy = engine.runner.spec.policy
    admit = policy.admit

    def dormant_admit(request_id, *args, **kwargs):
        admit(request_id, *args, **kwargs)
        policy.sentinels.discard(request_id)  # (no request keeps its draft, not even a sentinel)
        policy.dormant.add(request_id)
        return True

    policy.admit = dormant_admit


def random_prompts(batch: int, input_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    """A different random prompt per request (one repeated prompt would flatter caches and drafts).
    Keyed by (seed, batch), so spec on, spec off and transformers see the same prompts."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + batch)
    low = min(1000, vocab_size // 8)  # above most special tokens
    return torch.randint(low, vocab_size, (batch, input_len), generator=gen).tolist()


@dataclass
class RunMetrics:
    batch_size: int
    output_tokens: int
    total_s: float  # first add_request .. last request finished
    tokens_per_s: float  # output tokens / total_s (prefill included)
    ttft_ms: float  # mean time to a request's first token
    ms_per_output_token: float | None  # mean over requests of (finish - first token) / (tokens - 1): what one user sees
    iteration_ms: float | None  # mean engine step, once every request has its first token
    decode_iterations: int
    mean_accept_length: float | None = None  # tokens per verify step (accepted drafts + 1); spec only
    accept_per_position: list[float] | None = None  # share of verify steps that accepted draft k+1; spec only
    grammar_mask_ms_per_step: float | None = None  # host time of grammar masks per engine step (--json-schema)
    # Adaptive speculation, this run: engine steps by chosen depth, catch-ups, requests admitted dormant.
    steps_by_depth: list[int] | None = None
    catch_ups: int | None = None
    dormant_admitted: int | None = None
    dormant_demoted: int | None = None  # running requests that dropped their draft state
    dormant_steps: int | None = None  # steps of dormant rows alone (plain decoding's step)
    # The policy's cost table at the batch's padded size after the run (ms; what its choices rested on).
    policy_costs_ms: dict | None = None
    # Wall time of each engine step until every request had its first token (where time to first token goes).
    first_token_steps_ms: list[float] | None = None
    # Adaptive speculation with `trace`, each engine step after every request had its first token: [wall ms,
    # depth of the verify step whose results it took (-1: none), catch-ups it launched]. Under overlap a
    # step's wall time is mostly the GPU time of the step whose results it waits for.
    step_trace: list[list] | None = None

    def as_dict(self) -> dict:
        return {k: rounded(v) for k, v in asdict(self).items() if not (k == "step_trace" and v is None)}


def median_of_runs(runs: list[RunMetrics]) -> dict:
    """One row for repeated runs of a batch: each metric's median over the runs (upper median for
    an even count), and, with more than one run, every run's own metrics under "runs"."""
    rows = [r.as_dict() for r in runs]
    if len(rows) == 1:
        return rows[0]
    out = dict(rows[0])
    for key, value in rows[0].items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            values = sorted(r[key] for r in rows if r[key] is not None)
            out[key] = values[len(values) // 2] if values else None
    out["runs"] = rows
    out.pop("step_trace", None)  # (one run's; each run keeps its own)
    return out


def upper_median(values):
    """The median of the values that are not None (the upper one for an even count, as median_of_runs); None
    where there are none."""
    values = sorted(v for v in values if v is not None)
    return values[len(values) // 2] if values else None


def rounded(v):
    if isinstance(v, float):
        return round(v, 4)
    return [rounded(x) for x in v] if isinstance(v, list) else v


def run_batch(engine, prompts: list[list[int]], output_len: int, temperature: float = 0.0, top_p: float = 1.0,
              json_schema: dict | None = None, trace: bool = False, **sampling) -> tuple[RunMetrics, list[list[int]]]:
    """Runs `prompts` together for exactly `output_len` tokens each; returns metrics and the tokens. With
    `json_schema`, each output is a document of that schema and ends with it (at most output_len tokens).
    `trace`: keep the per-step trace (adaptive speculation). `sampling`: more SamplingParams fields
    (penalties, logprobs). Timed on the wall clock."""
    run = BatchRun(engine, prompts, output_len, temperature, top_p, json_schema, trace=trace, **sampling)
    run.start()
    while not run.step():
        pass
    return run.result()


def run_in_lockstep(runs: list["BatchRun"]) -> list[tuple[RunMetrics, list[list[int]]]]:
    """Runs several engines' batches at once, one engine step at a time in turn (the order reversed every
    round), each timed on its own busy clock: the machine's slow stretches land on every engine alike. On a
    2-core CPU four engines doing identical work (two plain, two speculative with every request dormant),
    taking turns run by run, ran 0.79-1.21x the first one's speed round by round (medians 0.957-1.023);
    taking turns step by step, 0.97-1.05x (medians 1.001-1.007;
    bench/results/engine-instance-spread-cpu-09f0343.json). CPU engines only: on a GPU a step returns
    before its device work is done, so one engine's wait would time the other's kernels."""
    for run in runs:
        if not run.busy_clock:
            raise ValueError("run_in_lockstep needs runs timed on their busy clock (BatchRun(busy_clock=True))")
        run.start()
    live, turn = list(runs), 0
    while live:
        for run in live[:] if turn % 2 == 0 else live[::-1]:  # (copies: finished runs leave `live`)
            if run.step():
                live.remove(run)
        turn += 1
    return [run.result() for run in runs]


class BatchRun:
    """One timed run of a batch on one engine (`run_batch`), stepped by its caller. Its clock: the wall
    clock, or with `busy_clock` only the time spent in its own engine calls (add_request, step), for runs of
    several engines whose steps take turns (`run_in_lockstep`). The bookkeeping between steps is on the wall
    clock but not on the busy one; on a GPU under overlap that gap overlaps the device's work, so GPU runs
    keep the wall clock."""

    def __init__(self, engine, prompts: list[list[int]], output_len: int, temperature: float = 0.0,
                 top_p: float = 1.0, json_schema: dict | None = None, busy_clock: bool = False, trace: bool = False,
                 **sampling):
        if busy_clock and engine.runner.device.type == "cuda":
            raise ValueError("a busy clock times host calls: on a GPU they return before the device is done")
        self.engine, self.prompts, self.json_schema, self.busy_clock = engine, prompts, json_schema, busy_clock
        self.keep_trace = trace
        self.params = SamplingParams(max_new_tokens=output_len, temperature=temperature, top_p=top_p,
                                     ignore_eos=json_schema is None, json_schema=json_schema, **sampling)
        self.spec = engine.runner.spec
        self._busy = 0.0  # seconds in this run's engine calls (busy clock)

    def now(self) -> float:
        return self._busy if self.busy_clock else time.perf_counter()

    def _call(self, fn, *args):
        if not self.busy_clock:
            return fn(*args)
        started = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self._busy += time.perf_counter() - started

    def start(self) -> None:
        """Adds the batch's requests (the clock starts)."""
        engine, spec = self.engine, self.spec
        # Runs repeat the same prompts: each prefills them cold, as before prefix caching.
        engine.flush_cache()
        self.before = _spec_counts(spec)
        self.grammar_before = _grammar_time(engine)
        _sync(engine)
        self.t0 = self.now()
        self.rids = self._call(lambda: [engine.add_request(p, self.params) for p in self.prompts])
        self.first: dict[str, float] = {}
        self.done: dict[str, tuple[float, list[int]]] = {}
        self.decode_start, self.decode_steps = None, 0
        self.first_token_steps, self.last = [], self.t0
        self.trace = [] if self.keep_trace and spec is not None and spec.policy is not None else None
        self.counts = _spec_counts(spec)

    def step(self) -> bool:
        """One engine step; True once every request has finished (and the engine holds nothing)."""
        out = self._call(self.engine.step)
        now, spec = self.now(), self.spec
        if self.decode_start is not None:
            self.decode_steps += 1
            if self.trace is not None:
                new, counts = _spec_counts(spec), self.counts
                depth = next((d for d, (a, b) in enumerate(zip(new[3], counts[3] + [0] * len(new[3])))
                              if a > b), -1)
                self.trace.append([round(1e3 * (now - self.last), 3), depth, new[4] - counts[4]])
                self.counts = new
        else:
            self.first_token_steps.append(1e3 * (now - self.last))
            self.counts = _spec_counts(spec) if self.trace is not None else self.counts
        self.last = now
        for d in out.deltas:
            if d.new_token_ids:
                self.first.setdefault(d.request_id, now)
        for f in out.finished:
            self.done[f.request_id] = (now, f.token_ids)
        if self.decode_start is None and len(self.first) == len(self.rids):
            self.decode_start = now
        if len(self.done) < len(self.rids):
            return False
        while self.engine.has_unfinished():  # overlap: the step launched ahead of the last results
            self._call(self.engine.step)
        self.t1 = self.now()
        return True

    def result(self) -> tuple[RunMetrics, list[list[int]]]:
        """The finished run's metrics and tokens."""
        rids, done, first, t0, t1 = self.rids, self.done, self.first, self.t0, self.t1
        tokens = [done[r][1] for r in rids]
        n_out = sum(len(t) for t in tokens)
        per_token = [(done[r][0] - first[r]) / (len(done[r][1]) - 1) for r in rids if len(done[r][1]) > 1]
        steps = self.decode_steps
        metrics = RunMetrics(
            batch_size=len(self.prompts), output_tokens=n_out, total_s=t1 - t0, tokens_per_s=n_out / (t1 - t0),
            ttft_ms=1e3 * sum(first[r] - t0 for r in rids) / len(rids),
            ms_per_output_token=1e3 * sum(per_token) / len(per_token) if per_token else None,
            iteration_ms=1e3 * (t1 - self.decode_start) / steps if steps else None,
            decode_iterations=steps, first_token_steps_ms=self.first_token_steps, step_trace=self.trace,
        )
        if self.json_schema is not None and steps:
            metrics.grammar_mask_ms_per_step = 1e3 * (_grammar_time(self.engine) - self.grammar_before) / steps
        spec, before = self.spec, self.before
        if spec is not None:
            after = _spec_counts(spec)
            drafts = after[0] - before[0]
            if drafts:
                metrics.mean_accept_length = 1 + (after[1] - before[1]) / drafts
                old = before[2] + [0] * (len(after[2]) - len(before[2]))
                metrics.accept_per_position = [(a - b) / drafts for a, b in zip(after[2], old)]
            if spec.policy is not None:
                old_steps = before[3] + [0] * (len(after[3]) - len(before[3]))
                metrics.steps_by_depth = [a - b for a, b in zip(after[3], old_steps)]
                metrics.catch_ups, metrics.dormant_admitted = after[4] - before[4], after[5] - before[5]
                metrics.dormant_demoted, metrics.dormant_steps = after[6] - before[6], after[7] - before[7]
                mode = step_mode(SamplingFeatures.of([self.params]))  # (the run's cost table)
                row = spec.policy.cost_row(spec.padded_batch(len(self.prompts)), mode)
                metrics.policy_costs_ms = {k: round(v, 4) for k, v in row.items()}
        return metrics, tokens


def _grammar_time(engine) -> float:
    grammar = engine.runner.grammar
    return 0.0 if grammar is None else grammar.mask_seconds


def _spec_counts(spec) -> tuple:
    """Verify steps, accepted drafts, accepted drafts per depth, steps by depth, catch-ups, dormant
    admissions, demotions and dormant steps, so far (the stats are cumulative)."""
    if spec is None:
        return 0, 0, [], [], 0, 0, 0, 0
    s = spec.stats
    return (s.num_drafts, s.num_accepted_tokens, list(s.accepted_per_position), list(s.steps_by_depth),
            s.catch_ups, s.dormant_admitted, s.dormant_demoted, s.dormant_steps)


def _sync(engine) -> None:
    if engine.runner.device.type == "cuda":
        torch.cuda.synchronize(engine.runner.device)
