"""What the demo pair's results.json records, measured with tandem's own `Engine`: acceptance length
(chain and tree drafting, greedy and sampled) and tokens/s with and without speculation, side by side
in one process on the same prompts."""

from __future__ import annotations

import time
from collections import Counter
from typing import Sequence

from tqdm import tqdm

# The two drafting shapes the issue asks for (EngineArgs names without the `speculative_` prefix).
DRAFTING = {
    "chain": {"num_steps": 3, "eagle_topk": 1, "num_draft_tokens": 4},
    "tree": {"num_steps": 5, "eagle_topk": 4, "num_draft_tokens": 8},
}
SAMPLED_TEMPERATURE = 0.7


def spec_kwargs(draft_dir: str, drafting: str) -> dict:
    shape = DRAFTING[drafting]
    # A fixed shape: this measures the head at its configured depth, not the adaptive policy's choices.
    return {"speculative_algorithm": "EAGLE3", "speculative_draft_model_path": draft_dir, "speculative_adaptive": "off",
            **{f"speculative_{k}": v for k, v in shape.items()}}


def engine_kwargs(device: str, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> dict:
    """A KV pool just big enough for all prompts at once (the default sizes itself from memory)."""
    context = max(map(len, prompts)) + max_new_tokens + 16
    return {"device": device, "dtype": "auto", "context_length": context,
            "max_total_tokens": (len(prompts) + 1) * (context + 16)}


def acceptance(target_dir: str, draft_dir: str, prompts: list[list[int]], drafting: str, temperature: float,
               max_new_tokens: int, device: str, seed: int = 0) -> dict:
    """Mean accept length (tokens per verify step: accepted drafts + 1) over all prompts in one batch.
    Sampled runs give prompt i the seed `seed + i`."""
    from tandem import Engine, SamplingParams

    params = [SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature,
                             seed=None if temperature == 0 else seed + i) for i in range(len(prompts))]
    kwargs = {**engine_kwargs(device, prompts, max_new_tokens), **spec_kwargs(draft_dir, drafting)}
    with Engine(target_dir, **kwargs) as engine:
        outs = engine.generate(input_ids=prompts, sampling_params=params)
    lengths = [n for o in outs for n in o.spec_accept_lengths]
    return {"mean_accept_length": sum(lengths) / len(lengths), "verify_steps": len(lengths),
            "generated_tokens": sum(len(o.token_ids) for o in outs), "prompts": len(prompts),
            "temperature": temperature,
            "histogram": {str(k): v for k, v in sorted(Counter(lengths).items())}}  # str keys, as in JSON


def acceptance_table(target_dir: str, draft_dir: str, prompts: list[list[int]], max_new_tokens: int,
                     device: str, seed: int = 0, progress: bool = True) -> dict:
    """chain/tree x greedy/T=0.7, keyed `chain_greedy`, `chain_t0.7`, ..."""
    table = {}
    runs = [(d, t) for d in DRAFTING for t in (0.0, SAMPLED_TEMPERATURE)]
    for drafting, temperature in tqdm(runs, desc="acceptance", disable=not progress):
        key = f"{drafting}_{'greedy' if temperature == 0 else f't{temperature}'}"
        table[key] = acceptance(target_dir, draft_dir, prompts, drafting, temperature, max_new_tokens, device, seed)
    return table


def speed(target_dir: str, draft_dir: str, prompts: list[list[int]], max_new_tokens: int, device: str,
          rounds: int = 2, progress: bool = True) -> dict:
    """Greedy tokens/s of plain decoding and of chain and tree speculation, one request at a time
    (batch 1) and all prompts together; the engines alternate prompt by prompt, so background load
    falls on all of them alike. Every request makes exactly `max_new_tokens` (EOS ignored)."""
    from tandem import Engine, SamplingParams

    kwargs = engine_kwargs(device, prompts, max_new_tokens)
    engines = {"plain": Engine(target_dir, **kwargs)}
    for drafting in DRAFTING:
        engines[drafting] = Engine(target_dir, **kwargs, **spec_kwargs(draft_dir, drafting))
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)
    try:
        for engine in engines.values():  # warm-up: first-call allocations and lazy inits
            engine.generate(input_ids=prompts[:1], sampling_params=SamplingParams(max_new_tokens=8, ignore_eos=True))
        seconds = dict.fromkeys(engines, 0.0)
        tokens = dict.fromkeys(engines, 0)
        outputs: dict[str, list[list[int]]] = {name: [] for name in engines}
        steps = {name: 0 for name in engines}
        bar = tqdm(total=rounds * len(prompts), desc="tokens/s (batch 1)", disable=not progress)
        for r in range(rounds):
            for prompt in prompts:
                for name, engine in engines.items():
                    start = time.perf_counter()
                    out = engine.generate(input_ids=[prompt], sampling_params=params)[0]
                    seconds[name] += time.perf_counter() - start
                    tokens[name] += len(out.token_ids)
                    steps[name] += len(out.spec_accept_lengths) or len(out.token_ids)
                    if r == 0:
                        outputs[name].append(out.token_ids)
                bar.update(1)
        bar.close()
        batched = {}
        for name, engine in engines.items():
            start = time.perf_counter()
            outs = engine.generate(input_ids=prompts, sampling_params=params)
            batched[name] = sum(len(o.token_ids) for o in outs) / (time.perf_counter() - start)
    finally:
        for engine in engines.values():
            engine.shutdown()
    per_request = {name: tokens[name] / seconds[name] for name in engines}
    return {
        "batch_1_tokens_per_s": per_request,
        "batch_1_speedup": {name: per_request[name] / per_request["plain"] for name in DRAFTING},
        "batch_1_ms_per_step": {name: 1000 * seconds[name] / steps[name] for name in engines},
        f"batch_{len(prompts)}_tokens_per_s": batched,
        f"batch_{len(prompts)}_speedup": {name: batched[name] / batched["plain"] for name in DRAFTING},
        "greedy_matches_plain": {name: sum(a == b for a, b in zip(outputs[name], outputs["plain"]))
                                 for name in DRAFTING},
        "prompts": len(prompts), "rounds": rounds, "max_new_tokens": max_new_tokens,
    }
