"""A GGUF file written out once as a Hugging Face checkpoint directory: config.json, the tokenizer with
its chat template, generation_config.json and one model.safetensors of the dequantized weights."""

from __future__ import annotations

import json
import os

from tandem.gguf.config import gguf_config
from tandem.gguf.tensors import iter_gguf_tensors
from tandem.gguf.tokenizer import gguf_tokenizer


def convert_to_checkpoint(gguf_path: str, out_dir: str, dtype: str = "float32") -> None:
    """Writes the checkpoint into `out_dir` (created). float32 keeps every dequantized value exactly."""
    import torch
    from safetensors.torch import save_file

    os.makedirs(out_dir, exist_ok=True)
    cfg = gguf_config(gguf_path)
    cfg["torch_dtype"] = dtype
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    generation = {k: cfg[k] for k in ("bos_token_id", "eos_token_id") if cfg.get(k) is not None}
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump(generation, f, indent=2)
    tokenizer = gguf_tokenizer(gguf_path)
    if tokenizer is not None:
        _save_tokenizer(tokenizer, out_dir, cfg["max_position_embeddings"])
    torch_dtype = getattr(torch, dtype)
    tensors = {name: t.to(torch_dtype) for name, t in iter_gguf_tensors(gguf_path, desc="converting to safetensors")}
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})


def _save_tokenizer(tokenizer, out_dir: str, model_max_length: int) -> None:
    """tokenizer.json and a hand-written tokenizer_config.json (chat template inside), which read the
    same under transformers 4 and 5, whose `save_pretrained` layouts differ."""
    tokenizer.backend_tokenizer.save(os.path.join(out_dir, "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": model_max_length,
              "clean_up_tokenization_spaces": False, "chat_template": tokenizer.chat_template}
    for role in ("bos_token", "eos_token", "unk_token", "pad_token"):
        config[role] = getattr(tokenizer, role)
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2)
