"""One timed offline run: a batch of prompts added at once and stepped to completion."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch

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
    # Adaptive speculation, each engine step after every request had its first token: [wall ms, depth of
    # the verify step whose results it took (-1: none), catch-ups it launched]. Under overlap a step's
    # wall time is mostly the GPU time of the step whose results it waits for.
    step_trace: list[list] | None = None

    def as_dict(self) -> dict:
        return {k: rounded(v) for k, v in asdict(self).items()}


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


def rounded(v):
    if isinstance(v, float):
        return round(v, 4)
    return [rounded(x) for x in v] if isinstance(v, list) else v


def run_batch(engine, prompts: list[list[int]], output_len: int, temperature: float = 0.0, top_p: float = 1.0,
              json_schema: dict | None = None, **sampling) -> tuple[RunMetrics, list[list[int]]]:
    """Runs `prompts` together for exactly `output_len` tokens each; returns metrics and the tokens. With
    `json_schema`, each output is a document of that schema and ends with it (at most output_len tokens).
    `sampling`: more SamplingParams fields (penalties, logprobs)."""
    params = SamplingParams(max_new_tokens=output_len, temperature=temperature, top_p=top_p,
                            ignore_eos=json_schema is None, json_schema=json_schema, **sampling)
    spec = engine.runner.spec
    before = _spec_counts(spec)
    grammar_before = _grammar_time(engine)
    _sync(engine)
    t0 = time.perf_counter()
    rids = [engine.add_request(p, params) for p in prompts]
    first: dict[str, float] = {}
    done: dict[str, tuple[float, list[int]]] = {}
    decode_start, decode_steps = None, 0
    first_token_steps, last = [], t0
    trace = [] if spec is not None and spec.policy is not None else None
    counts = _spec_counts(spec)
    while len(done) < len(rids):
        out = engine.step()
        now = time.perf_counter()
        if decode_start is not None:
            decode_steps += 1
            if trace is not None:
                new = _spec_counts(spec)
                depth = next((d for d, (a, b) in enumerate(zip(new[3], counts[3] + [0] * len(new[3])))
                              if a > b), -1)
                trace.append([round(1e3 * (now - last), 3), depth, new[4] - counts[4]])
                counts = new
            last = now
        else:
            first_token_steps.append(1e3 * (now - last))
            last = now
            counts = _spec_counts(spec) if trace is not None else counts
        for d in out.deltas:
            if d.new_token_ids:
                first.setdefault(d.request_id, now)
        for f in out.finished:
            done[f.request_id] = (now, f.token_ids)
        if decode_start is None and len(first) == len(rids):
            decode_start = now
    t1 = time.perf_counter()
    while engine.has_unfinished():  # overlap: the step launched ahead of the last results
        engine.step()
    tokens = [done[r][1] for r in rids]
    n_out = sum(len(t) for t in tokens)
    per_token = [(done[r][0] - first[r]) / (len(done[r][1]) - 1) for r in rids if len(done[r][1]) > 1]
    metrics = RunMetrics(
        batch_size=len(prompts), output_tokens=n_out, total_s=t1 - t0, tokens_per_s=n_out / (t1 - t0),
        ttft_ms=1e3 * sum(first[r] - t0 for r in rids) / len(rids),
        ms_per_output_token=1e3 * sum(per_token) / len(per_token) if per_token else None,
        iteration_ms=1e3 * (t1 - decode_start) / decode_steps if decode_steps else None,
        decode_iterations=decode_steps, first_token_steps_ms=first_token_steps, step_trace=trace,
    )
    if json_schema is not None and decode_steps:
        metrics.grammar_mask_ms_per_step = 1e3 * (_grammar_time(engine) - grammar_before) / decode_steps
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
            row = spec.policy.cost_row(spec.padded_batch(len(prompts)))
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
