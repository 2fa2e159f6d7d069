"""What the demo pair's bench scripts share (admission_trace.py, policy_clock.py, sampling_bench.py): their batch
options and the engine bench/sampling_bench.py measures (EAGLE-3 chain of 3, a KV pool that holds every row)."""

from __future__ import annotations


def add_batch_arguments(ap, warmup_len: int = 0) -> None:
    """--batch-sizes, --runs, --input-len, --output-len and --warmup-len on an argparse parser."""
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=96)
    ap.add_argument("--warmup-len", type=int, default=warmup_len,
                    help="a warm-up batch of this many tokens first at each size")


def chain3_engine_kwargs(model_path: str, draft_path: str, max_bs: int, context: int) -> dict:
    """An EAGLE-3 chain of 3 with CUDA graphs up to `max_bs` rows and a KV pool that holds them all at
    `context` tokens (bench/sampling_bench.py's engines)."""
    return dict(model_path=model_path, speculative_algorithm="EAGLE3", speculative_draft_model_path=draft_path,
                speculative_num_steps=3, speculative_eagle_topk=1, speculative_num_draft_tokens=4,
                max_running_requests=max_bs, context_length=context, max_total_tokens=max_bs * (context + 64),
                cuda_graph_max_bs=max_bs)


def demo_engine_kwargs(batch_sizes, input_len: int, output_len: int) -> dict:
    """The demo pair's speculative engine as bench/sampling_bench.py builds it, sized for the largest batch."""
    from tandem.demo import demo_model_paths

    target, head = demo_model_paths()
    return chain3_engine_kwargs(target, head, max(batch_sizes), input_len + output_len + 16)
