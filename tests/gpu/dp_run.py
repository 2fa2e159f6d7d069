"""Data-parallel replicas on GPUs without the HTTP front end (which needs fastapi and pyzmq): each
replica is a spawned process that first applies its environment from `replica_envs` -- the same
device selection `tandem serve --dp-size` uses -- then runs an offline `Engine` on its own GPUs.

The replica entry points are module-level functions so that multiprocessing's spawn can import them.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import time
import traceback

from tandem.distributed.data_parallel import apply_env, replica_envs

RESULT_TIMEOUT_S = 540  # per replica: model build, warm-up and the timed run


def run_replicas(target, dp_size: int, tp_size: int, args_per_replica: list[tuple],
                 device: str = "cuda") -> list[dict]:
    """Starts `target(env, replica, *args, barrier, results)` in one spawned process per replica and
    returns their result dicts in replica order; raises with a replica's traceback if one failed."""
    envs = replica_envs(dp_size, tp_size, device)
    ctx = multiprocessing.get_context("spawn")  # a fresh CUDA context per replica, nothing inherited
    barrier, results = ctx.Barrier(dp_size), ctx.Queue()
    procs = [ctx.Process(target=target, args=(env, r, *args, barrier, results), daemon=True)
             for r, (env, args) in enumerate(zip(envs, args_per_replica))]
    for p in procs:
        p.start()
    try:
        out = {}
        deadline = time.monotonic() + RESULT_TIMEOUT_S
        while len(out) < dp_size:
            try:
                res = results.get(timeout=max(1.0, deadline - time.monotonic()))
            except queue.Empty:
                dead = [f"replica {r} exit code {p.exitcode}" for r, p in enumerate(procs) if not p.is_alive()]
                raise TimeoutError(f"replicas gave no result within {RESULT_TIMEOUT_S}s ({dead or 'all alive'})")
            if not res["ok"]:
                raise RuntimeError(f"replica {res['replica']} failed:\n{res['error']}")
            out[res["replica"]] = res
        return [out[r] for r in range(dp_size)]
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
                p.join()


def _device_identity() -> dict:
    import torch

    if not torch.cuda.is_available():  # (the harness also runs on a CPU, as a smoke test)
        return {"cuda_visible_devices": None, "gpu_name": None, "gpu_uuid": None}
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return {"cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"), "gpu_name": props.name,
            "gpu_uuid": str(getattr(props, "uuid", "")) or None}


def throughput_replica(env, replica, engine_kwargs, prompts, output_len, barrier, results) -> None:
    """Warms up, waits for every replica, then runs `prompts` as one batch to `output_len` tokens."""
    apply_env(env)  # first: this replica's GPUs, before anything initialises CUDA
    try:
        from tandem import Engine
        from tandem.bench.measure import run_batch

        engine = Engine(**engine_kwargs)
        run_batch(engine, prompts, 8)  # warm-up: allocator and kernel selection stay out of the timing
        barrier.wait(timeout=RESULT_TIMEOUT_S)  # the replicas' timed runs overlap
        start = time.monotonic()  # CLOCK_MONOTONIC: one clock for every process on the host
        metrics, tokens = run_batch(engine, prompts, output_len)
        end = time.monotonic()
        results.put({"ok": True, "replica": replica, "start": start, "end": end,
                     "output_tokens": sum(len(t) for t in tokens), "tokens_per_s": metrics.tokens_per_s,
                     "token_ids": tokens, **_device_identity()})
    except BaseException:
        barrier.abort()  # the other replicas stop waiting
        results.put({"ok": False, "replica": replica, "error": traceback.format_exc()})


def staggered_greedy(engine, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy outputs with staggered arrivals (prefill and verify rows share iterations)."""
    from tandem import SamplingParams

    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)
    half = len(prompts) // 2
    rids = [engine.add_request(p, params) for p in prompts[:half]]
    engine.step()
    rids += [engine.add_request(p, params) for p in prompts[half:]]
    done = {}
    while engine.has_unfinished():
        for out in engine.step().finished:
            done[out.request_id] = out
    return [done[r].token_ids for r in rids]


def delay_injection_replica(env, replica, plain_kwargs, spec_kwargs, prompts, delay_env, barrier, results) -> None:
    """Plain greedy output, then speculative greedy output with delays injected before every
    cross-stream write (the replicas run at the same time, one per GPU)."""
    apply_env(env)
    try:
        import torch

        from tandem import Engine

        with Engine(**plain_kwargs) as engine:
            plain = staggered_greedy(engine, prompts, 24)
        apply_env(delay_env)  # read when the speculative engine builds its streams
        barrier.wait(timeout=RESULT_TIMEOUT_S)
        with Engine(**spec_kwargs) as engine:
            spec = staggered_greedy(engine, prompts, 24)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        results.put({"ok": True, "replica": replica, "plain": plain, "spec": spec, **_device_identity()})
    except BaseException:
        barrier.abort()
        results.put({"ok": False, "replica": replica, "error": traceback.format_exc()})


if __name__ == "__main__":
    raise SystemExit("import this module (tests/gpu/test_dp_gpu.py); it has no command line")
