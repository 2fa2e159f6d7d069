"""Where the host time of one speculative decode step goes (cProfile), for one shape and batch,
with and without the plan stream (overlap on). Complements overlap_bench.py's phase totals.

python bench/profile_step.py [--shape llama-3.2-1b] [--batch 8] [--steps 20]
"""

import argparse
import cProfile
import io
import os
import pstats
import sys
import tempfile

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
from tandem import Engine, SamplingParams  # noqa: E402
from tandem.bench.presets import write_preset  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama-3.2-1b")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=20)
    ns = ap.parse_args()
    target, head = write_preset(ns.shape, tempfile.mkdtemp())
    for plan in (True, False):
        engine = Engine(target, load_format="dummy", device="cuda", dtype="bfloat16", speculative_algorithm="EAGLE3",
                        speculative_draft_model_path=head, speculative_num_steps=3, speculative_eagle_topk=1,
                        speculative_num_draft_tokens=4, disable_plan_stream=not plan, context_length=2048,
                        max_total_tokens=ns.batch * 2048, max_running_requests=ns.batch)
        params = SamplingParams(max_new_tokens=100_000, temperature=0.0, ignore_eos=True)
        for i in range(ns.batch):
            engine.add_request(list(range(1000 + i, 1256 + i)), params)
        for _ in range(10):
            engine.step()
        torch.cuda.synchronize()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(ns.steps):
            engine.step()
        torch.cuda.synchronize()
        prof.disable()
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(18)
        print(f"==== plan_stream={plan} ({ns.shape}, batch {ns.batch}, {ns.steps} steps)")
        print("\n".join(out.getvalue().splitlines()[:40]))
        engine.shutdown()
        del engine
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
