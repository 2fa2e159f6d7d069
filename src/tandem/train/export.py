"""Writes a trained head as a public EAGLE-3 checkpoint: config.json + model.safetensors with the
public tensor names (q/k/v and gate/up stored separately), `d2t` and `t2d`."""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import save_file

from tandem.layers.linear import MergedLinear
from tandem.models.eagle3 import Eagle3Draft
from tandem.models.llama import PACKED_MODULES

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def checkpoint_tensors(head: Eagle3Draft, t2d: torch.Tensor, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Public names -> tensors (floating ones cast to `dtype`), on the CPU."""
    unpack = {(merged, shard): frag for frag, (merged, shard) in PACKED_MODULES.items()}
    out = {}
    for name, p in head.named_parameters():
        p = p.detach().cpu()
        module_name, _, leaf = name.rpartition(".")
        module = head.get_submodule(module_name) if module_name else head
        if isinstance(module, MergedLinear):
            prefix, _, merged = module_name.rpartition(".")
            for shard, (offset, size) in module.shard_offsets.items():
                out[f"{prefix}.{unpack[(merged, shard)]}.{leaf}"] = p.narrow(0, offset, size)
        else:
            out[name] = p
    out = {k: v.to(dtype) if v.is_floating_point() else v for k, v in out.items()}
    out["t2d"] = t2d.cpu().bool()
    return out


def save_eagle3(head: Eagle3Draft, t2d: torch.Tensor, config: dict, out_dir: str, dtype: str = "float32") -> None:
    """Writes both files next to each other; each through a temporary name, so a reader never sees half."""
    os.makedirs(out_dir, exist_ok=True)
    tensors = checkpoint_tensors(head, t2d, DTYPES[dtype])
    tmp = os.path.join(out_dir, "model.safetensors.tmp")
    save_file({k: v.contiguous() for k, v in tensors.items()}, tmp, metadata={"format": "pt"})
    os.replace(tmp, os.path.join(out_dir, "model.safetensors"))
    tmp = os.path.join(out_dir, "config.json.tmp")
    with open(tmp, "w") as f:
        json.dump({**config, "torch_dtype": dtype}, f, indent=2)
    os.replace(tmp, os.path.join(out_dir, "config.json"))


def save_as(src_dir: str, out_dir: str, dtype: str = "float16") -> None:
    """A copy of the EAGLE-3 checkpoint in `src_dir` with its floating tensors cast to `dtype` (a head
    trained in float32 on a CPU, shipped in float16)."""
    from safetensors.torch import load_file

    tensors = load_file(os.path.join(src_dir, "model.safetensors"))
    with open(os.path.join(src_dir, "config.json")) as f:
        config = json.load(f)
    os.makedirs(out_dir, exist_ok=True)
    cast = {k: v.to(DTYPES[dtype]) if v.is_floating_point() else v for k, v in tensors.items()}
    save_file(cast, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump({**config, "torch_dtype": dtype}, f, indent=2)
