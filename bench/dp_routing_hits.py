"""Prefix-cache hit rate of data-parallel replicas under three routing rules: cache-aware (the server's
default, server/prefix_routing.py), shortest queue and random. Two (or more) engines in this process stand
for the replicas, each with its own prefix cache; the multi-turn workload of `tandem bench --workload
multi-turn` runs over them, each turn routed by the rule, and the hit rate is the engines' own count of
cached prompt tokens over turns 2..N.

    OMP_NUM_THREADS=1 python bench/dp_routing_hits.py --out bench/results/dp-routing-hits-cpu.json
"""

from __future__ import annotations

import argparse
import os
import random
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

from tandem import Engine, SamplingParams  # noqa: E402
from tandem.bench import report  # noqa: E402
from tandem.server.prefix_routing import PrefixRouter  # noqa: E402

RULES = ("cache_aware", "shortest_queue", "random")


def run(engines, rule: str, ns, seed: int = 0) -> dict:
    rng = random.Random(seed)
    vocab = engines[0].arch.vocab_size
    draw = lambda n: [rng.randrange(3, vocab) for _ in range(n)]  # noqa: E731
    system = draw(ns.system_len)
    users = [[draw(ns.user_len) for _ in range(ns.turns)] for _ in range(ns.conversations)]
    router = PrefixRouter(len(engines), engines[0].args.page_size, engines[0].scheduler.allocator.num_total)
    pick_rng = random.Random(seed + 1)
    # Answers of differing lengths (half to one and a half times --answer-len), so conversations finish in a
    # changing order, as they do on a server: with equal lengths, taking turns keeps each on one replica.
    lengths = [[rng.randint(max(1, ns.answer_len // 2), ns.answer_len * 3 // 2) for _ in range(ns.turns)]
               for _ in range(ns.conversations)]
    history = [list(system) for _ in range(ns.conversations)]
    turn = [0] * ns.conversations
    live: dict[tuple[int, str], tuple[int, list[int]]] = {}
    stats = {"prompt_tokens": 0, "cached_tokens": 0, "by_replica": [0] * len(engines)}

    def load(r: int) -> int:
        return sum(1 for (e, _) in live if e == r)

    def send(c: int) -> None:
        prompt = history[c] + users[c][turn[c]]
        hashes = router.hashes([prompt])
        loads = {r: load(r) for r in range(len(engines))}
        if rule == "random":
            r = pick_rng.randrange(len(engines))
        else:
            r = router.choose(list(loads), loads, hashes) if rule == "cache_aware" else None
            r = min(loads, key=lambda i: (loads[i], stats["by_replica"][i])) if r is None else r
        router.record(r, hashes)
        stats["by_replica"][r] += 1
        params = SamplingParams(max_new_tokens=lengths[c][turn[c]], temperature=0.0, ignore_eos=True)
        live[(r, engines[r].add_request(prompt, params))] = (c, prompt)

    for c in range(ns.conversations):
        send(c)
    while live:
        for r, engine in enumerate(engines):
            if not engine.has_unfinished():
                continue
            for fin in engine.step().finished:
                c, prompt = live.pop((r, fin.request_id))
                if turn[c] >= 1:
                    stats["prompt_tokens"] += len(prompt)
                    stats["cached_tokens"] += fin.num_cached_tokens
                history[c] = prompt + list(fin.token_ids)
                router.record(r, router.hashes([history[c]]))
                turn[c] += 1
                if turn[c] < ns.turns:
                    send(c)
    stats["hit_rate"] = stats["cached_tokens"] / max(1, stats["prompt_tokens"])
    return stats


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--system-len", type=int, default=32)
    ap.add_argument("--user-len", type=int, default=48)
    ap.add_argument("--answer-len", type=int, default=48)
    ap.add_argument("--max-total-tokens", type=int, default=8192,
                    help="each replica's KV pool: small enough that one replica cannot cache everything")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", required=True)
    ns = ap.parse_args()
    engines = [Engine(device=ns.device, dtype="float32", max_total_tokens=ns.max_total_tokens)
               for _ in range(ns.replicas)]
    result = {"tool": "bench/dp_routing_hits.py", "config": vars(ns), "rules": {}}
    for rule in RULES:
        for e in engines:
            e.flush_cache()
        result["rules"][rule] = run(engines, rule, ns)
        s = result["rules"][rule]
        print(f"{rule:>15}: hit rate {s['hit_rate']:.3f} over turns 2-{ns.turns}, turns by replica {s['by_replica']}")
    report.write_json(result, ns.out)
    print(f"wrote {ns.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
