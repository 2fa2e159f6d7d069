"""Runs a speculative greedy workload on the GPU and prints the outputs as JSON (one process, so a
deliberately broken configuration cannot take the test process's CUDA context down with it).

python -m tests.gpu.spec_run OUT_DIR [--drop EDGE] [--no-overlap] [--no-plan] [--tree] [--plain] [--no-graph] [--triton]
    [--logprobs] [--phase-graphs] [--dormant] [--demo]
    [--sampling greedy|seeded|seeded-penalties]
"""

import argparse
import json
import os
import sys

import torch

from tandem import Engine, SamplingParams
from tandem.demo import DEMO_DIR, demo_model_paths
from tandem.runtime.streams import FaultInjection
from tests.models.tiny_checkpoints import make_checkpoint, prompts
from tests.speculative.draft_checkpoints import write_eagle3_head


def models(root: str) -> tuple[str, str]:
    """The tiny llama3 target (4 query heads, 2 KV heads: one per rank at TP=2) and its EAGLE-3 head."""
    target, head = os.path.join(root, "target"), os.path.join(root, "eagle3")
    if not os.path.isfile(os.path.join(head, "config.json")):  # the head is written last
        make_checkpoint("llama3", target, seed=0)
        write_eagle3_head(head, json.load(open(os.path.join(target, "config.json"))), seed=2)
    return target, head


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("root")
    ap.add_argument("--drop", default=None)
    ap.add_argument("--no-overlap", action="store_true")
    ap.add_argument("--no-plan", action="store_true")
    ap.add_argument("--tree", action="store_true")
    ap.add_argument("--plain", action="store_true")
    ap.add_argument("--self-draft", action="store_true", help="the target drafts for itself (high acceptance)")
    ap.add_argument("--no-graph", action="store_true", help="eager decode steps (no CUDA graphs)")
    ap.add_argument("--triton", action="store_true", help="the triton attention backend")
    ap.add_argument("--logprobs", action="store_true", help="ask for logprobs (the whole-iteration GENERAL graph)")
    ap.add_argument("--phase-graphs", action="store_true",
                    help="drop the whole-iteration graphs: speculative steps replay the three phase graphs with the "
                         "plan stream between them (the path of constrained steps with penalties or logprobs)")
    ap.add_argument("--dormant", action="store_true",
                    help="every request admitted dormant (no draft state): the dormant-decode graphs run")
    ap.add_argument("--demo", action="store_true",
                    help="the bundled demo pair (a trained head: real acceptance) in float32, 32 requests of 64 tokens "
                         "cut from its held-out prompts, instead of the tiny random checkpoints")
    ap.add_argument("--sampling", choices=["greedy", "seeded", "seeded-penalties"], default="greedy",
                    help="seeded: a mix of seeded sampled requests (temperature, top-p, top-k, min-p) and greedy "
                         "ones, which the sampled whole-iteration graphs serve; seeded-penalties adds penalties")
    ap.add_argument("--shared-prefix", action="store_true",
                    help="prompts share a prefix, and a second wave resends each first-wave prompt with its output "
                         "and more (prefix-cache hits: the whole pages of both)")
    ap.add_argument("--no-prefix-cache", action="store_true")
    ns = ap.parse_args(argv)
    target, head = demo_model_paths() if ns.demo else models(ns.root)
    ids, new_tokens, running = (demo_prompts(32), 64, 32) if ns.demo else (None, 24, 16)
    shape = (dict(speculative_eagle_topk=4, speculative_num_steps=5, speculative_num_draft_tokens=8) if ns.tree
             else dict(speculative_eagle_topk=1, speculative_num_steps=3, speculative_num_draft_tokens=4))
    kwargs = dict(device=os.environ.get("SPEC_RUN_DEVICE", "cuda"), dtype="float32", page_size=4, max_total_tokens=32768,
                  max_running_requests=running, disable_cuda_graph=ns.no_graph,
                  attention_backend="triton" if ns.triton else "torch", disable_prefix_caching=ns.no_prefix_cache)
    if not ns.plain:
        kwargs.update(shape, speculative_algorithm="STANDALONE" if ns.self_draft else "EAGLE3",
                      speculative_draft_model_path=target if ns.self_draft else head,
                      disable_overlap_schedule=ns.no_overlap, disable_plan_stream=ns.no_plan)
    faults = FaultInjection(drop=frozenset([ns.drop] if ns.drop else []))
    engine = Engine(target, _runner_hooks={"stream_faults": faults}, **kwargs)
    if ns.phase_graphs:
        graphs = engine.runner.spec.phases.graphs
        for name in [n for n in graphs if n.startswith("iteration:")]:
            del graphs[name]
    if ns.dormant:
        policy = engine.runner.spec.policy
        policy.admit = lambda request_id, padded_batch, *_, **__: policy.dormant.add(request_id) or True
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True,
                            logprobs=1 if ns.logprobs else None)
    if ns.sampling != "greedy":
        params = seeded_mix(running, penalties=ns.sampling == "seeded-penalties", logprobs=1 if ns.logprobs else None,
                            max_new_tokens=new_tokens)
    if ns.shared_prefix:
        outs = shared_prefix_run(engine, params, ids)
    else:
        outs = staggered_run(engine, params, ids)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    json.dump([o.token_ids for o in outs], sys.stdout)


def seeded_mix(n: int, penalties: bool, logprobs=None, max_new_tokens: int = 24) -> list[SamplingParams]:
    """Seeded sampled requests of several kinds and a greedy one in every five."""
    kinds = [dict(temperature=1.0, top_p=0.9), dict(temperature=1.0), dict(temperature=0.7, top_k=20),
             dict(temperature=1.0, min_p=0.05), dict(temperature=0.0)]
    extra = dict(repetition_penalty=1.2, frequency_penalty=0.3) if penalties else {}
    return [SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True, seed=1000 + i, logprobs=logprobs,
                           **kinds[i % len(kinds)], **extra) for i in range(n)]


def demo_prompts(n: int) -> list[list[int]]:
    """The demo pair's held-out prompts, cut to 32, 64, 96 and 128 tokens in turn: a different prompt each."""
    held_out = json.load(open(os.path.join(DEMO_DIR, "eval_prompts.json")))["prompts"]
    return [held_out[i % len(held_out)][:32 * (1 + (i // len(held_out)) % 4)] for i in range(n)]


def shared_prefix_run(engine, params, ids=None) -> list:
    """Two staggered waves: the prompts behind one shared 37-token prefix, then each prompt again with its
    first answer and a few more tokens (a conversation's next turn). Returns both waves' outputs."""
    ids = ids or prompts(10, seed=21) + prompts(6, seed=22)
    shared = [t for p in prompts(4, seed=23) for t in p][:37]
    first = [shared + p for p in ids]
    outs = staggered_run(engine, params, first)
    second = [p + o.token_ids + p[-5:] for p, o in zip(first, outs)]
    return outs + staggered_run(engine, params, second)


def staggered_run(engine, params, ids=None) -> list:
    """The GPU tests' workload: 16 prompts (or `ids`), half of them one step late, so prefill and
    decode/verify rows share iterations. `params`: one for all, or one per prompt. Returns the outputs in
    prompt order."""
    ids = ids or prompts(10, seed=21) + prompts(6, seed=22)
    per = params if isinstance(params, list) else [params] * len(ids)
    half = len(ids) // 2
    rids = [engine.add_request(p, q) for p, q in zip(ids[:half], per[:half])]
    engine.step()
    rids += [engine.add_request(p, q) for p, q in zip(ids[half:], per[half:])]
    done = {}
    while engine.has_unfinished():
        for out in engine.step().finished:
            done[out.request_id] = out
    return [done[r] for r in rids]


if __name__ == "__main__":
    main()
