"""One tensor-parallel engine run for tests/gpu/test_tp_gpu.py, in a process of its own (a broken
collective or a hung rank cannot take the test process down with it). Prints one line
`TP_RUN_RESULT {json}` on stdout, then shuts the engine down and prints `TP_RUN_SHUTDOWN {json}`.

Greedy run of tiny checkpoints (spec_run.py's workload: 16 requests, staggered arrivals):
    python -m tests.gpu.tp_run ROOT [--tp N] [--dtype float32|bfloat16] [--spec none|chain|tree]
        [--self-draft] [--no-overlap] [--no-graph] [--attention-backend torch|triton] [--logprobs K]
    result: {"tokens": [[...] per request], "accept_lengths": [[...] per request],
             "logprobs": [[[token, logprob, [[id, logprob], ...top K]] per position] per request] | null}

Plain decode speed with random weights in a named shape (tandem/bench/presets.py):
    python -m tests.gpu.tp_run ROOT --bench llama-3.1-8b [--tp N] [--dtype bfloat16]
        [--attention-backend triton] [--batches 1 32] [--prompt-len 128] [--warmup 8] [--steps 64]
    result: {"rows": [{"batch", "decode_ms_per_step", "tokens_per_s", ...}], "engine_init_s", ...}

The device is $TP_RUN_DEVICE (default cuda). With TP_RUN_DEVICE=cpu the same harness runs on a CPU:
the launcher then starts its ranks on the CPU and their collectives use gloo instead of NCCL.

Run as a module (`python -m`), never imported for its side effects: the launcher starts ranks 1..N-1
with multiprocessing's spawn, which imports this main module again in each of them; everything
that does work sits under the `__main__` guard.
"""

import argparse
import json
import os
import sys
import threading
import time

import torch

from tandem import Engine, SamplingParams
from tests.gpu.spec_run import models, staggered_run
from tests.speculative.conftest import CHAIN, TREE

SHUTDOWN_TIMEOUT_S = 20.0  # a healthy shutdown takes well under a second


def device() -> str:
    return os.environ.get("TP_RUN_DEVICE", "cuda")


def sync() -> None:
    if device() != "cpu" and torch.cuda.is_available():
        torch.cuda.synchronize()


# ---- greedy outputs of the tiny models ------------------------------------------------------------
def generate(ns) -> tuple[Engine, dict]:
    target, head = models(ns.root)
    kwargs = dict(device=device(), dtype=ns.dtype, tp_size=ns.tp, page_size=4, max_total_tokens=32768,
                  max_running_requests=16, disable_cuda_graph=ns.no_graph,
                  attention_backend=ns.attention_backend)
    if ns.spec != "none":
        kwargs.update(CHAIN if ns.spec == "chain" else TREE,
                      speculative_algorithm="STANDALONE" if ns.self_draft else "EAGLE3",
                      speculative_draft_model_path=target if ns.self_draft else head,
                      disable_overlap_schedule=ns.no_overlap)
    engine = Engine(target, **kwargs)
    params = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True, logprobs=ns.logprobs)
    outs = staggered_run(engine, params)
    sync()
    logprobs = None
    if ns.logprobs is not None:
        logprobs = [[[lp.token_id, lp.logprob, [list(t) for t in lp.top]] for lp in o.logprobs] for o in outs]
    return engine, {"tokens": [o.token_ids for o in outs],
                    "accept_lengths": [o.spec_accept_lengths for o in outs], "logprobs": logprobs}


# ---- plain decode speed ---------------------------------------------------------------------------
def gpu_used_gib() -> list[float] | None:
    """Memory in use on every visible GPU, whichever process holds it (rank 1's shows up on its GPU)."""
    if device() == "cpu" or not torch.cuda.is_available():
        return None
    used = []
    for i in range(torch.cuda.device_count()):
        free, total = torch.cuda.mem_get_info(i)
        used.append((total - free) / 2**30)
    return used


def step(engine: Engine, started: set, done: dict) -> None:
    """One engine step; notes the requests that got tokens and keeps the finished outputs."""
    out = engine.step()
    started.update(d.request_id for d in out.deltas if d.new_token_ids)
    done.update((o.request_id, o) for o in out.finished)


def bench(ns) -> tuple[Engine, dict]:
    from tandem.bench.measure import random_prompts
    from tandem.bench.presets import PRESETS, write_preset

    target, _ = write_preset(ns.bench, ns.root)
    # Requests get their first tokens a step or two apart (chunked prefill), so they are given a few
    # tokens more than the steps run: every timed step decodes the whole batch.
    new_tokens = 1 + ns.warmup + ns.steps + 8
    context = ns.prompt_len + new_tokens + 8
    max_bs = max(ns.batches)
    before = gpu_used_gib()  # (creates a context on every GPU first, so the difference is the engine's)
    start = time.perf_counter()
    engine = Engine(target, load_format="dummy", dtype=ns.dtype, device=device(), tp_size=ns.tp,
                    attention_backend=ns.attention_backend, disable_cuda_graph=ns.no_graph,
                    max_running_requests=max_bs, context_length=context, max_total_tokens=max_bs * (context + 16))
    sync()
    init_s = time.perf_counter() - start
    after = gpu_used_gib()
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    rows = []
    for batch in ns.batches:
        prompts = random_prompts(batch, ns.prompt_len, PRESETS[ns.bench]["vocab_size"], seed=0)
        rids = [engine.add_request(p, params) for p in prompts]
        started, done = set(), {}
        while len(started) < batch:  # prefill until every request has its first token
            step(engine, started, done)
        for _ in range(ns.warmup):
            step(engine, started, done)
        sync()
        t0 = time.perf_counter()
        for _ in range(ns.steps):
            step(engine, started, done)
        sync()
        elapsed = time.perf_counter() - t0
        if done:
            raise RuntimeError(f"{len(done)} requests finished during the timed steps")
        while engine.has_unfinished():
            step(engine, started, done)
        rows.append({"batch": batch, "decode_ms_per_step": round(1e3 * elapsed / ns.steps, 4),
                     "tokens_per_s": round(batch * ns.steps / elapsed, 2), "timed_steps": ns.steps,
                     "max_new_tokens": new_tokens, "output_tokens": sum(len(done[r].token_ids) for r in rids)})
    return engine, {"preset": ns.bench, "tp": ns.tp, "dtype": ns.dtype, "attention_backend": ns.attention_backend,
                    "cuda_graphs": not ns.no_graph and device() != "cpu", "prompt_len": ns.prompt_len,
                    "warmup_steps": ns.warmup, "engine_init_s": round(init_s, 2), "rows": rows,
                    "gpu_used_gib_before": before, "gpu_used_gib_after": after}


# ---- shutdown --------------------------------------------------------------------------------------
def shutdown(engine: Engine) -> None:
    """Stops the engine (and so its other ranks) under a time limit: a teardown that hangs (e.g. in
    NCCL) is reported as such instead of running into the test's timeout."""
    workers = list(getattr(engine.runner, "workers", []))  # the rank processes spawned here
    error = []

    def stop():
        try:
            engine.shutdown()
        except BaseException as e:  # reported below
            error.append(repr(e))

    start = time.perf_counter()
    thread = threading.Thread(target=stop, daemon=True)
    thread.start()
    thread.join(SHUTDOWN_TIMEOUT_S)
    hung = thread.is_alive()
    for p in workers:
        if p.is_alive():
            p.kill()
            p.join()
    report = {"ok": not hung and not error, "hung": hung, "error": error[0] if error else None,
              "seconds": round(time.perf_counter() - start, 2), "worker_exitcodes": [p.exitcode for p in workers]}
    print("TP_RUN_SHUTDOWN " + json.dumps(report), flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("root", help="directory for the checkpoints (reused when already there)")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--spec", default="none", choices=["none", "chain", "tree"])
    ap.add_argument("--self-draft", action="store_true", help="the target drafts for itself (STANDALONE)")
    ap.add_argument("--no-overlap", action="store_true")
    ap.add_argument("--no-graph", action="store_true", help="eager decode steps (no CUDA graphs)")
    ap.add_argument("--attention-backend", default="torch", choices=["torch", "triton"])
    ap.add_argument("--logprobs", type=int, default=None, help="also report each token's logprob and the top K")
    ap.add_argument("--bench", default=None, metavar="PRESET", help="time plain decoding of this shape instead")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--steps", type=int, default=64)
    ns = ap.parse_args(argv)
    if device() == "cpu":
        torch.set_num_threads(1)  # tiny models; the launcher gives every rank rank 0's thread count
    engine, result = bench(ns) if ns.bench else generate(ns)
    print("TP_RUN_RESULT " + json.dumps(result), flush=True)
    shutdown(engine)
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip the interpreter's teardown: the result and the shutdown report are out, and an exit that
    # waits on leftover NCCL/gloo state would only turn a finished run into a timeout.
    os._exit(0)


if __name__ == "__main__":
    main()
