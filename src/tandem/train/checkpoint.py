"""Resumable training state: head weights, optimizer, step, RNG states and the draft vocabulary.

It lives next to the exported head (`<output_dir>/training_state.pt`); the engine never reads it.
"""

from __future__ import annotations

import os

import torch

STATE_FILE = "training_state.pt"


def state_path(out_dir: str) -> str:
    return os.path.join(out_dir, STATE_FILE)


def save_state(out_dir: str, step: int, head, optimizer, vocab, head_config: dict, history: list) -> None:
    state = {
        "step": step,  # optimizer steps done
        "head": head.state_dict(),
        "optimizer": optimizer.state_dict(),
        "d2t": vocab.d2t, "t2d": vocab.t2d,
        "head_config": head_config,
        "history": history,
        "rng_cpu": torch.get_rng_state(),
        "rng_cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }
    os.makedirs(out_dir, exist_ok=True)
    tmp = state_path(out_dir) + ".tmp"
    torch.save(state, tmp)
    os.replace(tmp, state_path(out_dir))  # a crash mid-save leaves the previous state intact


def load_state(out_dir: str, device) -> dict | None:
    path = state_path(out_dir)
    if not os.path.isfile(path):
        return None
    return torch.load(path, map_location=device, weights_only=True)


def restore_rng(state: dict) -> None:
    torch.set_rng_state(state["rng_cpu"].cpu())
    if state["rng_cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["rng_cuda"]])


RUN_CONFIG_FILE = "train_config.json"


def save_run_config(out_dir: str, config, target_path: str, corpus: str | None) -> None:
    """The run's settings in plain JSON: for people, and for `--eval-only` to find the same held-out split."""
    import dataclasses
    import json

    os.makedirs(out_dir, exist_ok=True)
    record = {**dataclasses.asdict(config), "target_path": target_path, "corpus": corpus}
    with open(os.path.join(out_dir, RUN_CONFIG_FILE), "w") as f:
        json.dump(record, f, indent=2)


def load_run_config(out_dir: str) -> dict:
    import json

    path = os.path.join(out_dir, RUN_CONFIG_FILE)
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        return json.load(f)
