"""A GGUF file's tensors under their Hugging Face names, dequantized to float32 one at a time.

llama.cpp stores a Llama model's Q and K rows permuted for its rope layout (each head's rotary halves
interleaved); `unpermute_rows` puts them back in the order the Hugging Face checkpoint had. Qwen2/3
files are written unpermuted (llama.cpp runs them with its NeoX rope).
"""

from __future__ import annotations

import re

import numpy as np
import torch
from tqdm import tqdm

from tandem.gguf.config import gguf_config
from tandem.gguf.reader import _gguf, open_reader

_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
# Read into the config instead (config.py): Llama 3's rope divisors.
_CONFIG_TENSORS = ("rope_freqs.weight",)
_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")
_PERMUTED_MODEL_TYPES = ("llama", "mistral")  # llama.cpp architecture "llama"


def hf_name(name: str) -> str:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; ValueError for a tensor the
    Llama-family decoder does not have."""
    m = _BLOCK.match(name)
    if m and m.group(2) in _BLOCK_NAMES:
        return f"model.layers.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}.{m.group(3)}"
    base, _, suffix = name.rpartition(".")
    if base in _GLOBAL_NAMES and suffix in ("weight", "bias"):
        return f"{_GLOBAL_NAMES[base]}.{suffix}"
    raise ValueError(f"GGUF tensor {name!r} has no place in a Llama-family model")


def unpermute_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undoes llama.cpp's `permute`, which reorders each head's rows (r0 r1 .. r{d/2-1} | r{d/2} ..)
    into pairs (r0 r{d/2} r1 r{d/2+1} ..); works on a weight [heads*d, in] and on a bias [heads*d]."""
    head_dim = w.shape[0] // num_heads
    return w.reshape(num_heads, head_dim // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def dequantize(tensor) -> np.ndarray:
    """A reader tensor as float32 in the torch layout ([out, in] for a matrix: ggml's shape reversed)."""
    gguf = _gguf()
    shape = tuple(int(n) for n in reversed(tensor.shape))
    return np.asarray(gguf.dequantize(tensor.data, tensor.tensor_type), dtype=np.float32).reshape(shape)


def iter_gguf_tensors(path: str, desc: str = "loading GGUF weights"):
    """Yields (Hugging Face name, float32 tensor) for every weight of the file, with a progress bar."""
    cfg = gguf_config(path)  # also rejects a file we cannot run, before anything is read
    reader = open_reader(path)
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    permuted = cfg["model_type"] in _PERMUTED_MODEL_TYPES
    for tensor in tqdm(reader.tensors, desc=desc, unit="tensor", leave=False):
        if tensor.name in _CONFIG_TENSORS:
            continue
        name = hf_name(tensor.name)
        w = dequantize(tensor)
        if permuted and ".self_attn.q_proj." in name:
            w = unpermute_rows(w, heads)
        elif permuted and ".self_attn.k_proj." in name:
            w = unpermute_rows(w, kv_heads)
        if not w.flags.writeable:  # an F32 tensor is a view of the read-only memory map
            w = w.copy()
        yield name, torch.from_numpy(np.ascontiguousarray(w))
