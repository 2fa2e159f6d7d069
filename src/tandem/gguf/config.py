"""A GGUF file's metadata as the Hugging Face `config.json` of the same model.

Keys are llama.cpp's (`{arch}.block_count`, `{arch}.attention.head_count_kv`, ...); what the metadata
does not say (tied embeddings, biases, Llama-3 rope scaling) is read off the tensors, as llama.cpp
itself does.
"""

from __future__ import annotations

import math

import numpy as np

from tandem.gguf.reader import check_supported, metadata, open_reader

# general.file_type -> the dtype the tensors were stored in, for `dtype="auto"` (quantized: none).
_FILE_DTYPES = {0: "float32", 1: "float16", 32: "bfloat16"}

_HF_ARCHITECTURES = {"llama": ("LlamaForCausalLM", "llama"), "mistral": ("MistralForCausalLM", "mistral"),
                     "qwen2": ("Qwen2ForCausalLM", "qwen2"), "qwen3": ("Qwen3ForCausalLM", "qwen3")}


def gguf_config(path: str) -> dict:
    """The `config.json` dict of the model in the GGUF file at `path` (ValueError if we cannot run it)."""
    reader = open_reader(path)
    meta = metadata(reader)
    arch = check_supported(path, reader, meta)
    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise ValueError(f"GGUF file {path!r} has no token_embd.weight tensor")

    def key(name, default=None, required=False):
        value = meta.get(f"{arch}.{name}", default)
        if required and value is None:
            raise ValueError(f"GGUF file {path!r} lacks the metadata key {arch}.{name!r}")
        if isinstance(value, list):  # per-layer values (some files): only a uniform list is one decoder
            if len(set(value)) != 1:
                raise ValueError(f"GGUF file {path!r}: {arch}.{name} differs between layers ({value[:4]}...); "
                                 "only uniform layers are supported")
            value = value[0]
        return value

    hidden = key("embedding_length", required=True)
    num_heads = key("attention.head_count", required=True)
    head_dim = key("attention.key_length") or hidden // num_heads
    rope_dim = key("rope.dimension_count")
    if rope_dim is not None and rope_dim != head_dim:
        raise ValueError(f"GGUF file {path!r}: rope over {rope_dim} of {head_dim} head dimensions (partial rotary) "
                         "is not supported")
    rope_theta = float(key("rope.freq_base", 10000.0))
    family = "mistral" if arch == "llama" and _names_mistral(meta) else arch
    hf_arch, model_type = _HF_ARCHITECTURES[family]
    cfg = {
        "architectures": [hf_arch],
        "model_type": model_type,
        "vocab_size": int(tensors["token_embd.weight"].shape[1]),  # shape is [hidden, vocab] (ggml order)
        "hidden_size": hidden,
        "intermediate_size": key("feed_forward_length", required=True),
        "num_hidden_layers": key("block_count", required=True),
        "num_attention_heads": num_heads,
        "num_key_value_heads": key("attention.head_count_kv") or num_heads,
        "head_dim": head_dim,
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": rope_theta,
        "rope_scaling": _rope_scaling(path, arch, meta, reader, head_dim, rope_theta),
        "max_position_embeddings": key("context_length", 4096),
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        "mlp_bias": "blk.0.ffn_up.bias" in tensors,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": _eos_ids(meta),
        "torch_dtype": _FILE_DTYPES.get(meta.get("general.file_type")),
    }
    if family == "mistral":
        cfg["sliding_window"] = key("attention.sliding_window")
    if cfg["bos_token_id"] is None:
        del cfg["bos_token_id"]
    return cfg


def _names_mistral(meta: dict) -> bool:
    # llama.cpp converts Mistral models to architecture "llama"; only their name says which they are.
    names = (meta.get("general.name"), meta.get("general.basename"))
    return any(isinstance(n, str) and "mistral" in n.lower() for n in names)


def _eos_ids(meta: dict) -> list[int] | int | None:
    # Instruct files often name the end of a turn (eot) apart from the end of text (eos); both stop.
    ids = [meta[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id") if k in meta]
    ids = list(dict.fromkeys(ids))
    return None if not ids else ids[0] if len(ids) == 1 else ids


def _rope_scaling(path, arch, meta, reader, head_dim, theta) -> dict | None:
    kind = meta.get(f"{arch}.rope.scaling.type", "none")
    freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if freqs is not None:  # Llama 3.x: llama.cpp stores the per-frequency divisors, not their parameters
        return llama3_rope_scaling(np.asarray(freqs.data, dtype=np.float64), head_dim, theta, path)
    if kind == "none":
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(meta[f"{arch}.rope.scaling.factor"])}
    raise ValueError(f"GGUF file {path!r} uses rope scaling {kind!r}; supported: none, linear, llama3")


def llama3_divisors(head_dim: int, theta: float, factor: float, low: float, high: float, original: int) -> np.ndarray:
    """Llama 3's per-frequency rope divisors (what llama.cpp stores as rope_freqs.weight)."""
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / freqs
    smooth = (original / wavelen - low) / (high - low)
    mid = 1.0 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < original / high, 1.0, np.where(wavelen > original / low, factor, mid))


def llama3_rope_scaling(divisors: np.ndarray, head_dim: int, theta: float, path: str = "") -> dict:
    """The Llama-3 rope_scaling parameters that reproduce `divisors`: the factor is their largest value;
    the rest are found among the values Llama 3 models use."""
    factor = float(divisors.max())
    for original in (8192, 4096, 16384, 32768, 2048, 1024, 512, 256, 128, 64):
        for low, high in ((1.0, 4.0), (1.0, 2.0), (1.0, 8.0), (2.0, 4.0)):
            want = llama3_divisors(head_dim, theta, factor, low, high, original)
            if np.allclose(want, divisors, rtol=1e-5, atol=0):
                return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
                        "high_freq_factor": high, "original_max_position_embeddings": original}
    raise ValueError(f"GGUF file {path!r}: rope_freqs.weight matches no Llama-3 rope scaling; not supported")
