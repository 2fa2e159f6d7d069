"""Shared helpers for the engine tests: tiny checkpoints, Hugging Face references, checkpoint surgery."""

from __future__ import annotations

import json
import os
import shutil

import torch

from tandem import Engine
from tests.models.tiny_checkpoints import INIT_RANGE, checkpoint_dir

__all__ = ["checkpoint_dir", "cpu_engine", "hf_greedy", "hf_logprobs", "make_tokenizer_checkpoint",
           "copy_checkpoint", "edit_tensors", "edit_config", "instrument_preemptions", "eagle3_head_for", "CHAIN3"]


def eagle3_head_for(tmp_path_factory, target: str, seed: int) -> str:
    """A random EAGLE-3 head in the public format for the target checkpoint at `target`."""
    from tests.speculative.draft_checkpoints import write_eagle3_head

    path = str(tmp_path_factory.mktemp("eagle3"))
    write_eagle3_head(path, json.load(open(os.path.join(target, "config.json"))), seed=seed)
    return path


CHAIN3 = dict(speculative_algorithm="EAGLE3", speculative_num_steps=3, speculative_eagle_topk=1,
              speculative_num_draft_tokens=4)


def cpu_engine(path: str, **kwargs) -> Engine:
    kwargs = {"device": "cpu", "dtype": "float32", "page_size": 4, **kwargs}
    return Engine(path, **kwargs)


def hf_greedy(model, ids: list[int], max_new_tokens: int, eos_token_id=None, **kwargs) -> list[int]:
    """Transformers' own greedy generate (no EOS unless given)."""
    model.generation_config.eos_token_id = eos_token_id
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=0, attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             eos_token_id=eos_token_id, **kwargs)
    return out[0, len(ids):].tolist()


def hf_logprobs(model, prompt: list[int], output: list[int]) -> torch.Tensor:
    """log_softmax of the HF logits that predicted each output token (teacher forcing): [len(output), V]."""
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    return torch.log_softmax(logits[len(prompt) - 1: len(prompt) + len(output) - 1], dim=-1)


def make_tokenizer_checkpoint(path: str, seed: int = 0):
    """A tiny random Llama whose vocabulary is the demo byte-level tokenizer's, saved with it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from tandem.demo import byte_level_tokenizer

    tokenizer = byte_level_tokenizer()
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         initializer_range=INIT_RANGE, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return os.path.abspath(path), model, tokenizer


def copy_checkpoint(src: str, dst: str) -> str:
    shutil.copytree(src, dst)
    return dst


def edit_tensors(path: str, edit) -> None:
    """Rewrites model.safetensors in place with `edit(dict of tensors)` applied."""
    from safetensors.torch import load_file, save_file

    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


def edit_config(path: str, **changes) -> None:
    file = os.path.join(path, "config.json")
    with open(file) as f:
        cfg = json.load(f)
    cfg.update(changes)
    with open(file, "w") as f:
        json.dump(cfg, f)


def instrument_preemptions(engine: Engine) -> list[str]:
    """Wraps engine.scheduler.schedule; the returned list collects every preempted request id."""
    preempted: list[str] = []
    schedule = engine.scheduler.schedule

    def counting_schedule():
        out = schedule()
        preempted.extend(out.preempted_ids)
        return out

    engine.scheduler.schedule = counting_schedule
    return preempted
