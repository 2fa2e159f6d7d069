"""The target answers an instruction set itself (self-distillation): the training data of its draft head.

Chat-kind prompts go through the target's chat template, code prompts are continued as they are. Each
answered prompt is one JSON line `{"input_ids": prompt + answer, "kind", "subject", "template",
"temperature", "prompt_len"}` that `tandem train-draft --corpus FILE.jsonl` reads. Lines are appended
batch by batch, so an interrupted run continues where it stopped (the same command again).
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Sequence

from tandem.train.instruction_set import Prompt

logger = logging.getLogger(__name__)


def prompt_ids(tokenizer, prompt: Prompt) -> list[int]:
    if prompt.chat:
        return list(tokenizer.apply_chat_template([{"role": "user", "content": prompt.text}], add_generation_prompt=True))
    return tokenizer(prompt.text, add_special_tokens=True)["input_ids"]


def sampling_temperature(index: int, sampled_every: int) -> float:
    """Every `sampled_every`-th prompt is answered at temperature 0.7 (the rest greedily), so the head
    also sees the contexts a sampled request produces."""
    return 0.7 if sampled_every and index % sampled_every == sampled_every - 1 else 0.0


def distill(target: str, prompts: Sequence[Prompt], out_path: str, max_new_tokens: int = 160,
            batch_size: int = 32, sampled_every: int = 3, seed: int = 0, log_every: int = 1,
            **engine_kwargs) -> dict:
    """Answers `prompts` (skipping those already in `out_path`) and appends them; returns counts."""
    from tandem import Engine, SamplingParams

    done = _count_lines(out_path)
    todo = list(enumerate(prompts))[done:]
    logger.info("self-distillation: %d of %d prompts already answered in %s; %d to go", done, len(prompts),
                out_path, len(todo))
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    generated, start = 0, time.monotonic()
    engine_kwargs.setdefault("max_total_tokens", batch_size * 768)  # a batch's KV, not the memory-sized default
    with Engine(target, **engine_kwargs) as engine:
        eos = engine.tokenizer.eos_token_id
        for b in range(0, len(todo), batch_size):
            batch = todo[b:b + batch_size]
            ids = [prompt_ids(engine.tokenizer, p) for _, p in batch]
            params = [SamplingParams(max_new_tokens=max_new_tokens, temperature=sampling_temperature(i, sampled_every),
                                     seed=seed + i) for i, _ in batch]
            outs = engine.generate(input_ids=ids, sampling_params=params)
            lines = []
            for (i, p), x, out, sp in zip(batch, ids, outs, params):
                answer = list(out.token_ids)
                if out.finish_reason == "stop" and eos is not None and (not answer or answer[-1] != eos):
                    answer.append(eos)  # the turn's end, as the model wrote it
                lines.append(json.dumps({"input_ids": x + answer, "kind": p.kind, "subject": p.subject,
                                         "template": p.template, "temperature": sp.temperature,
                                         "prompt_len": len(x)}) + "\n")
                generated += len(out.token_ids)
            with open(out_path, "a") as f:  # one write per batch: a stop leaves whole lines
                f.write("".join(lines))
            n = done + b + len(batch)
            if (b // batch_size) % log_every == 0 or n == len(prompts):
                rate = generated / max(time.monotonic() - start, 1e-9)
                eta = (len(prompts) - n) * (generated / max(n - done, 1)) / max(rate, 1e-9)
                logger.info("answered %d/%d prompts, %d new tokens, %.1f tokens/s, about %.0f min to go",
                            n, len(prompts), generated, rate, eta / 60)
    return {"prompts": len(prompts), "answered_now": len(todo), "generated_tokens": generated,
            "seconds": time.monotonic() - start}


def _count_lines(path: str) -> int:
    """Complete lines of `path`; a last line cut short by a kill is dropped from the file."""
    if not os.path.isfile(path):
        return 0
    with open(path) as f:
        lines = f.readlines()
    if lines and not lines[-1].endswith("\n"):
        lines.pop()
        with open(path, "w") as f:
            f.writelines(lines)
    return len(lines)
