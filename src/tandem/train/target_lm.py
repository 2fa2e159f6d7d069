"""Pre-training a small Llama target from scratch, with transformers' `LlamaForCausalLM` as the module.

Documents are shuffled (seeded, per epoch), concatenated and cut into windows; the loss is the
next-token cross-entropy over every position. AdamW (no decay on norms), linear warmup, cosine to
`min_lr_ratio * lr`, gradient clipping, bfloat16 autocast on a GPU. The weights are written as
float16 safetensors with a hand-written config.json (tied embeddings: no lm_head tensor), which
tandem and transformers 4 and 5 all read.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from tqdm import tqdm

CALIBRATION_STEPS = (5, 20)  # with a time budget, the step time is measured between these steps


@dataclass(frozen=True)
class TargetShape:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    max_position_embeddings: int
    rope_theta: float = 10000.0

    def config_json(self, bos_id: int, eos_id: int, pad_id: int) -> dict:
        return {
            "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads, "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.hidden_size // self.num_heads,
            "max_position_embeddings": self.max_position_embeddings, "rope_theta": self.rope_theta,
            "rope_scaling": None, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
            "attention_bias": False, "mlp_bias": False, "initializer_range": 0.02,
            "bos_token_id": bos_id, "eos_token_id": eos_id, "pad_token_id": pad_id, "torch_dtype": "float16",
        }


@dataclass(frozen=True)
class LMTraining:
    steps: int
    batch_size: int
    seq_len: int
    lr: float
    warmup_steps: int
    weight_decay: float = 0.1
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0

    def lr_at(self, step: int, total: int) -> float:
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        frac = min(1.0, (step - self.warmup_steps) / max(1, total - self.warmup_steps))
        return self.lr * (self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))


def hf_module(config: dict):
    """transformers' LlamaForCausalLM for a config.json written by `TargetShape.config_json`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "max_position_embeddings", "rope_theta", "rms_norm_eps",
            "tie_word_embeddings", "attention_bias", "mlp_bias", "initializer_range", "bos_token_id",
            "eos_token_id", "pad_token_id", "hidden_act")
    return LlamaForCausalLM(LlamaConfig(**{k: config[k] for k in keys}))


class WindowSampler:
    """Batch `step` of a seeded epoch-by-epoch reshuffle: documents in a new order each epoch,
    concatenated, cut into `seq_len` windows (the tail dropped), windows in a random order."""

    def __init__(self, docs: list[list[int]], batch_size: int, seq_len: int, seed: int):
        self.docs = [torch.tensor(d, dtype=torch.long) for d in docs]
        self.batch_size, self.seq_len, self.seed = batch_size, seq_len, seed
        self.num_windows = sum(len(d) for d in self.docs) // seq_len
        if self.num_windows < batch_size:
            raise ValueError(f"the corpus has {self.num_windows} windows of {seq_len} tokens; "
                             f"a batch needs {batch_size}")
        self.batches_per_epoch = self.num_windows // batch_size
        self._epoch, self._windows = None, None

    def batch(self, step: int) -> torch.Tensor:
        epoch, k = divmod(step, self.batches_per_epoch)
        if epoch != self._epoch:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            order = torch.randperm(len(self.docs), generator=gen).tolist()
            stream = torch.cat([self.docs[i] for i in order])[: self.num_windows * self.seq_len]
            windows = stream.view(self.num_windows, self.seq_len)
            self._windows = windows[torch.randperm(self.num_windows, generator=gen)]
            self._epoch = epoch
        return self._windows[k * self.batch_size:(k + 1) * self.batch_size]  # [B, T]


def train_lm(config: dict, docs: list[list[int]], train: LMTraining, device: torch.device, seed: int,
             time_budget_s: float | None = None, progress: bool = True):
    """(trained module, record). With `time_budget_s` the run is shortened to what fits, decided
    after `CALIBRATION_STEPS[1]` steps (inside the warmup, so the schedule is that of a plain run
    of the chosen length); the record says how many steps were done."""
    torch.manual_seed(seed)
    model = hf_module(config).to(device)
    model.train()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": train.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}],
                                  lr=train.lr, betas=(0.9, 0.95), fused=device.type == "cuda")
    sampler = WindowSampler(docs, train.batch_size, train.seq_len, seed)
    total = train.steps
    bar = tqdm(total=total, desc="train target", unit="step", disable=not progress)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    history, marks, start = [], {}, time.perf_counter()
    step = 0
    while step < total:
        for group in optimizer.param_groups:
            group["lr"] = train.lr_at(step, total)
        ids = sampler.batch(step).to(device, non_blocking=True)
        with autocast:
            logits = model(input_ids=ids).logits  # [B, T, V]
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), train.grad_clip)
        optimizer.step()
        step += 1
        if step % 10 == 0 or step == total:  # .item() waits for the GPU: not every step
            history.append({"step": step, "loss": loss.item()})
            bar.set_postfix_str(f"loss={history[-1]['loss']:.3f}")
        if step in CALIBRATION_STEPS:
            if device.type == "cuda":
                torch.cuda.synchronize()
            marks[step] = time.perf_counter()
        if time_budget_s is not None and step == CALIBRATION_STEPS[1] < total:
            per_step = (marks[CALIBRATION_STEPS[1]] - marks[CALIBRATION_STEPS[0]]) / (
                CALIBRATION_STEPS[1] - CALIBRATION_STEPS[0])
            fits = int(time_budget_s / per_step)
            if fits < total:
                total = max(fits, train.warmup_steps + 1, step)
                bar.total = total
        bar.update(1)
    bar.close()
    model.eval()
    record = {"steps_done": total, "steps_planned": train.steps,
              "tokens_seen": total * train.batch_size * train.seq_len,
              "epochs": total / sampler.batches_per_epoch, "train_seconds": time.perf_counter() - start,
              "final_loss": history[-1]["loss"] if history else None, "loss_history": history}
    return model, record


def save_half(model, config: dict, out_dir: str) -> None:
    """config.json + model.safetensors in float16 (a tied lm_head is not stored)."""
    os.makedirs(out_dir, exist_ok=True)
    tensors = {name: t.detach().to("cpu", torch.float16).contiguous() for name, t in model.state_dict().items()
               if not (config["tie_word_embeddings"] and name == "lm_head.weight")}
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"],
                   "pad_token_id": config["pad_token_id"]}, f, indent=2)


def load_half(model_dir: str, device: torch.device):
    """The saved target as the training module, upcast to float32."""
    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f)
    model = hf_module(config)
    state = {k: v.float() for k, v in load_file(os.path.join(model_dir, "model.safetensors")).items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise ValueError(f"{model_dir}: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    return model.to(device).eval()


@torch.no_grad()
def heldout_perplexity(model, docs: list[list[int]], num_bytes: int, seq_len: int, device: torch.device,
                       batch_size: int = 8, progress: bool = True) -> dict:
    """Perplexity over the held-out documents, concatenated and cut into non-overlapping windows of
    `seq_len` (each window predicts its tokens 2..T from what precedes them inside the window);
    also bits per UTF-8 byte of the held-out text, which does not depend on the tokenizer."""
    stream = torch.tensor([t for d in docs for t in d], dtype=torch.long)
    n_full = len(stream) // seq_len
    batches = list(stream[:n_full * seq_len].view(n_full, seq_len).split(batch_size))
    if len(stream) - n_full * seq_len >= 2:
        batches.append(stream[n_full * seq_len:][None])  # the shorter last window
    nll, count = 0.0, 0
    for ids in tqdm(batches, desc="held-out perplexity", disable=not progress):
        ids = ids.to(device)
        logits = model(input_ids=ids).logits.float()  # [B, T, V]
        nll += F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten(), reduction="sum").item()
        count += ids[:, 1:].numel()
    return {"perplexity": math.exp(nll / count), "nats_per_token": nll / count,
            "bits_per_byte": nll / math.log(2) / num_bytes, "tokens": count, "bytes": num_bytes}
