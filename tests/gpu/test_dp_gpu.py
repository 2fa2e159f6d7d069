"""Data parallelism on GPUs (2 or more): replica r runs on its own GPU, chosen by the same code as
`tandem serve --dp-size` (`replica_envs`), driven directly as spawned engine processes because GPU
machines may lack the server's fastapi/uvicorn/pyzmq.

(a) Throughput: DP=2 vs DP=1 at batch 32 per replica, llama-3.2-1b shape with random weights in
bfloat16, plain decoding; aggregated output tokens/s of the replicas' overlapping timed runs. JSON
goes to $TANDEM_GPU_RESULTS_DIR/dp_throughput.json when that variable is set.
(b) The stream-race check under DP=2: on each replica, speculative greedy output with delay
injection (TANDEM_STREAM_DELAY_CYCLES) equals plain greedy output.
"""

import json
import os

import pytest
import torch

from tests.gpu.dp_run import delay_injection_replica, run_replicas, throughput_replica

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs (data parallelism)")]

BATCH, INPUT_LEN, OUTPUT_LEN = 32, 128, 256
MIN_SCALING = 1.3  # two GPUs, two processes: expect ~2x; below this the replicas did not run side by side
DELAY = "20000000"  # ~10 ms of spinning before each cross-stream write, as in test_overlap_gpu.py


def throughput(dp_size: int, engine_kwargs: dict, vocab: int) -> dict:
    from tandem.bench.measure import random_prompts

    # a different batch per replica (replica 0's is the DP=1 batch)
    args = [(engine_kwargs, random_prompts(BATCH, INPUT_LEN, vocab, seed=r), OUTPUT_LEN) for r in range(dp_size)]
    res = run_replicas(throughput_replica, dp_size, 1, args)
    start, end = min(r["start"] for r in res), max(r["end"] for r in res)
    tokens = sum(r["output_tokens"] for r in res)
    return {"dp_size": dp_size, "output_tokens": tokens, "wall_s": round(end - start, 4),
            "tokens_per_s": round(tokens / (end - start), 2),
            "replicas": [{k: r[k] for k in ("tokens_per_s", "cuda_visible_devices", "gpu_name", "gpu_uuid")}
                         for r in res],
            "_token_ids": [r["token_ids"] for r in res]}


def distinct_gpus(replicas: list[dict]) -> bool:
    ids = [r["gpu_uuid"] or r["cuda_visible_devices"] for r in replicas]
    return None not in ids and len(set(ids)) == len(ids)


def test_dp2_throughput_vs_dp1(tmp_path):
    from tandem.bench.presets import PRESETS, write_preset

    target, _ = write_preset("llama-3.2-1b", str(tmp_path))
    kwargs = dict(model_path=target, load_format="dummy", dtype="bfloat16", device="cuda",
                  max_running_requests=BATCH, context_length=INPUT_LEN + OUTPUT_LEN + 1,
                  max_total_tokens=BATCH * (INPUT_LEN + OUTPUT_LEN + 64))
    vocab = PRESETS["llama-3.2-1b"]["vocab_size"]
    dp1 = throughput(1, kwargs, vocab)
    dp2 = throughput(2, kwargs, vocab)
    record = {"preset": "llama-3.2-1b", "load_format": "dummy", "dtype": "bfloat16", "decoding": "plain",
              "batch_per_replica": BATCH, "input_len": INPUT_LEN, "output_len": OUTPUT_LEN,
              "dp1": {k: v for k, v in dp1.items() if not k.startswith("_")},
              "dp2": {k: v for k, v in dp2.items() if not k.startswith("_")},
              "scaling": round(dp2["tokens_per_s"] / dp1["tokens_per_s"], 3),
              # same prompts, batch and weights on replica 0: equal unless kernels are not deterministic
              "dp2_replica0_tokens_equal_dp1": dp2["_token_ids"][0] == dp1["_token_ids"][0]}
    out_dir = os.environ.get("TANDEM_GPU_RESULTS_DIR")
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "dp_throughput.json"), "w") as f:
            json.dump(record, f, indent=1)
    print(json.dumps(record))
    assert dp2["output_tokens"] == 2 * BATCH * OUTPUT_LEN
    assert distinct_gpus(dp2["replicas"]), dp2["replicas"]
    assert record["scaling"] >= MIN_SCALING, record


def test_dp2_delay_injection_keeps_greedy_output(tmp_path):
    from tests.gpu.spec_run import models
    from tests.models.tiny_checkpoints import prompts

    target, head = models(str(tmp_path))
    plain = dict(model_path=target, device="cuda", dtype="float32", page_size=4, max_total_tokens=32768,
                 max_running_requests=16)
    # Eager: with CUDA graphs a greedy iteration runs on one stream and has no cross-stream edge.
    spec = dict(plain, speculative_algorithm="EAGLE3", speculative_draft_model_path=head,
                speculative_eagle_topk=1, speculative_num_steps=3, speculative_num_draft_tokens=4,
                disable_cuda_graph=True)
    delay = {"TANDEM_STREAM_DELAY_CYCLES": DELAY}
    args = [(plain, spec, prompts(10, seed=21 + 2 * r) + prompts(6, seed=22 + 2 * r), delay) for r in range(2)]
    res = run_replicas(delay_injection_replica, 2, 1, args)
    assert distinct_gpus(res), res
    for r in res:
        assert r["spec"] == r["plain"], f"replica {r['replica']} ({r['cuda_visible_devices']}): delays changed tokens"
        assert sum(len(t) for t in r["plain"]) == 16 * 24
