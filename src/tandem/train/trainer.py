"""`train_eagle3`: trains an EAGLE-3 head for a target model and writes it in the public format.

The target is loaded by tandem's own loader and frozen; its aux states and logits are computed
online for every batch. The head is tandem's `Eagle3Draft`, so the written weights load in the
engine unchanged.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Sequence

import torch
from tqdm import tqdm

from tandem.train import corpus as corpus_lib
from tandem.train.checkpoint import load_state, restore_rng, save_run_config, save_state
from tandem.train.config import TrainConfig
from tandem.train.export import save_eagle3
from tandem.train.head import build_head, head_config, init_head
from tandem.train.target import load_frozen_target, target_features
from tandem.train.ttt import estimated_accept_length, ttt_forward, ttt_loss
from tandem.train.vocab import DraftVocab, build_draft_vocab, token_counts

logger = logging.getLogger(__name__)

DEFAULT_DRAFT_VOCAB = 32000  # what the public Llama-3 EAGLE-3 heads use
MAX_HELDOUT_SEQUENCES = 32  # teacher-forced held-out metrics are a quick check, not the evaluation


@dataclass
class TrainSummary:
    output_dir: str
    steps_done: int
    finished: bool  # False when stopped early by `stop_after`
    history: list[dict] = field(default_factory=list)  # per step: step, lr, loss, acc (per TTT step)
    num_train_sequences: int = 0
    num_heldout_documents: int = 0
    vocab_coverage: float = 0.0  # share of training tokens inside the draft vocabulary
    heldout: dict | None = None  # teacher-forced loss / per-step accuracy / estimated tau

    def mean_loss(self, first: int, last: int) -> float:
        """Mean training loss over history[first:last] (negative indices count from the end)."""
        rows = self.history[first:last] if last else self.history[first:]
        return sum(r["loss"] for r in rows) / len(rows)


def prepare_sequences(corpus, tokenizer, config: TrainConfig) -> tuple[list[list[int]], list[list[int]]]:
    """(training sequences, held-out documents) from a corpus path or token-id lists."""
    if isinstance(corpus, (str, os.PathLike)):
        docs = corpus_lib.read_documents(os.fspath(corpus), tokenizer, config.extensions)
        train_docs, held = corpus_lib.split_documents(docs, config.eval_fraction, config.seed)
        return corpus_lib.pack(train_docs, config.seq_len), held
    train_docs, held = corpus_lib.split_documents([list(s) for s in corpus], config.eval_fraction, config.seed)
    return corpus_lib.chunk(train_docs, config.seq_len), held


def train_eagle3(target_path: str, corpus: str | Sequence[Sequence[int]], out_dir: str,
                 config: TrainConfig = TrainConfig()) -> TrainSummary:
    """Trains a head on `corpus` (a path, see train/corpus.py, or token-id lists) into `out_dir`."""
    from tandem.tokenizer import load_tokenizer

    device = torch.device(config.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    torch.manual_seed(config.seed)
    max_positions = config.seq_len + config.ttt_steps  # TTT step j runs rope up to T - 1 + j - 1
    target, arch = load_frozen_target(target_path, str(device), config.target_dtype, max_positions)
    train_seqs, held_docs = prepare_sequences(corpus, load_tokenizer(target_path), config)
    sampler = corpus_lib.BatchSampler(len(train_seqs), config.batch_size, config.seed)
    save_run_config(out_dir, config, target_path,
                    os.fspath(corpus) if isinstance(corpus, (str, os.PathLike)) else None)
    run = _start_or_resume(config, target, arch, train_seqs, out_dir, device, max_positions)
    head, vocab = run.head, run.vocab

    counts = token_counts(train_seqs, arch.vocab_size)
    summary = TrainSummary(out_dir, run.start, False, run.history, len(train_seqs), len(held_docs),
                           float(counts[vocab.t2d].sum() / counts.sum().clamp_min(1)))
    vocab_ids = vocab.target_ids.to(device)
    stop = config.stop_after or config.steps
    bar = tqdm(total=config.steps, initial=run.start, desc="train-draft", unit="step", disable=not config.progress)
    running = None  # exponential averages for the progress bar
    head.train()
    for step in range(run.start, stop):
        lr = config.lr_at(step)
        for group in run.optimizer.param_groups:
            group["lr"] = lr
        ids, valid = corpus_lib.collate([train_seqs[i] for i in sampler.indices(step)])
        out = _train_step(run, target, ids.to(device), valid.to(device), vocab_ids, config)
        acc = [c / max(n, 1) for c, n in zip(out.step_correct, out.step_count)]
        run.history.append({"step": step + 1, "lr": lr, "loss": float(out.loss.detach()), "acc": acc})
        running = _ema(running, [run.history[-1]["loss"], *acc])
        bar.set_postfix_str(_postfix(running))
        bar.update(1)
        done = step + 1
        if config.save_every and done % config.save_every == 0 and done < stop:
            _save(out_dir, done, run)
    bar.close()
    head.eval()
    summary.steps_done = max(run.start, stop)
    summary.finished = summary.steps_done >= config.steps
    _save(out_dir, summary.steps_done, run)
    if summary.finished and held_docs:
        summary.heldout = heldout_metrics(head, target, held_docs, vocab, config, device)
    return summary


@dataclass
class _Run:
    head: torch.nn.Module  # tandem's Eagle3Draft
    vocab: DraftVocab
    head_config: dict  # its config.json
    optimizer: torch.optim.Optimizer
    params: list  # the trainable parameters
    history: list[dict]
    start: int  # optimizer steps already done


def _start_or_resume(config: TrainConfig, target, arch, train_seqs, out_dir: str, device, max_positions) -> _Run:
    state = load_state(out_dir, device) if config.resume else None
    if state is not None:
        vocab, hcfg = DraftVocab(state["d2t"].cpu(), state["t2d"].cpu()), state["head_config"]
    else:
        vocab_size = config.draft_vocab_size or min(DEFAULT_DRAFT_VOCAB, arch.vocab_size)
        vocab = build_draft_vocab(train_seqs, arch.vocab_size, vocab_size)
        export_dtype = "bfloat16" if device.type == "cuda" else "float32"
        hcfg = head_config(arch, vocab_size, config.aux_layer_ids, config.intermediate_size, export_dtype)
    head = build_head(hcfg, target, max_positions, device)
    init_head(head, target, vocab, config.seed)
    params = [p for p in head.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay)
    run = _Run(head, vocab, hcfg, optimizer, params, [], 0)
    if state is not None:
        head.load_state_dict(state["head"])
        optimizer.load_state_dict(state["optimizer"])
        run.history, run.start = list(state["history"]), int(state["step"])
        restore_rng(state)
        logger.info("resuming from step %d", run.start)
    elif config.resume:
        logger.info("no training state in %s: starting from scratch", out_dir)
    return run


def _train_step(run: _Run, target, ids, valid, vocab_ids, config: TrainConfig):
    feats = target_features(target, ids, run.head.aux_layer_ids, vocab_ids)
    with torch.autocast(ids.device.type, dtype=torch.bfloat16, enabled=ids.device.type == "cuda"):
        hiddens = ttt_forward(run.head, ids, feats.aux, config.ttt_steps)
        out = ttt_loss(run.head, hiddens, valid, feats.probs, feats.argmax, config.step_loss_decay)
    run.optimizer.zero_grad(set_to_none=True)
    out.loss.backward()
    torch.nn.utils.clip_grad_norm_(run.params, config.grad_clip)
    run.optimizer.step()
    return out


def _save(out_dir: str, step: int, run: _Run) -> None:
    save_eagle3(run.head, run.vocab.t2d, run.head_config, out_dir, run.head_config["torch_dtype"])
    save_state(out_dir, step, run.head, run.optimizer, run.vocab, run.head_config, run.history)


@torch.no_grad()
def heldout_metrics(head, target, held_docs, vocab: DraftVocab, config: TrainConfig, device) -> dict | None:
    """Teacher-forced TTT loss and per-step top-1 agreement on held-out documents."""
    seqs = corpus_lib.chunk(held_docs, config.seq_len)[:MAX_HELDOUT_SEQUENCES]
    if not seqs:
        return None
    vocab_ids = vocab.target_ids.to(device)
    loss, correct, count = 0.0, [0] * config.ttt_steps, [0] * config.ttt_steps
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    for i in range(0, len(seqs), config.batch_size):
        ids, valid = corpus_lib.collate(seqs[i:i + config.batch_size])
        ids, valid = ids.to(device), valid.to(device)
        feats = target_features(target, ids, head.aux_layer_ids, vocab_ids)
        with autocast:
            out = ttt_loss(head, ttt_forward(head, ids, feats.aux, config.ttt_steps), valid, feats.probs,
                           feats.argmax, config.step_loss_decay)
        loss += float(out.loss) * len(ids)
        correct = [a + b for a, b in zip(correct, out.step_correct)]
        count = [a + b for a, b in zip(count, out.step_count)]
    acc = [c / max(n, 1) for c, n in zip(correct, count)]
    return {"loss": loss / len(seqs), "acc": acc, "estimated_accept_length": estimated_accept_length(acc),
            "num_sequences": len(seqs)}


def _ema(old, new, beta: float = 0.9):
    return list(new) if old is None else [beta * o + (1 - beta) * n for o, n in zip(old, new)]


def _postfix(running) -> str:
    loss, *acc = running
    return (f"loss={loss:.3f} acc={'/'.join(f'{a:.2f}' for a in acc)} "
            f"tau~{estimated_accept_length(acc):.2f}")
