"""Opening a GGUF file: its metadata as plain Python values, and the checks that reject a file we
cannot run (architecture, tensor types) before any model is built."""

from __future__ import annotations

import functools
import os

# general.architecture values that are the Llama-family decoder (llama.cpp writes Mistral models as
# "llama"; their name tells them apart, see config.py).
SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3")

# Tensor types we dequantize at load. The K-quants Q2_K and Q3_K come along: the same package routine
# dequantizes them and the tests cover them like the others.
SUPPORTED_TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
                          "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")

# Metadata arrays too large to be worth turning into Python lists unless asked for (tokenizer.py).
_BULKY = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.scores", "tokenizer.ggml.token_type")


def is_gguf_path(path: str | None) -> bool:
    return bool(path) and path.lower().endswith(".gguf") and os.path.isfile(path)


def _gguf():
    try:
        import gguf
    except ImportError:  # a dependency in pyproject; this helps an environment installed without it
        raise ImportError("reading GGUF files needs the `gguf` package: pip install gguf") from None
    return gguf


@functools.lru_cache(maxsize=2)
def _open_cached(path: str, mtime_ns: int, size: int):
    return _gguf().GGUFReader(path)


def open_reader(path: str):
    """The file's `gguf.GGUFReader` (memory-mapped; one per file and version, as config, tokenizer and
    weights are read from it in turn)."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no GGUF file at {path!r}")
    st = os.stat(path)
    try:
        return _open_cached(os.path.abspath(path), st.st_mtime_ns, st.st_size)
    except (ValueError, OSError) as e:  # the reader raises ValueError on a bad magic or a truncated file
        raise ValueError(f"{path!r} is not a readable GGUF file: {e}") from None


def metadata(reader, bulky: bool = False) -> dict:
    """Every key-value field of the file; the tokenizer's vocabulary arrays only with `bulky`."""
    out = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        if key in _BULKY and not bulky:
            continue
        out[key] = field.contents()
    return out


def check_supported(path: str, reader, meta: dict) -> str:
    """Returns the architecture; raises a ValueError naming what this file has that we cannot load."""
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"GGUF file {path!r} has architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    bad = sorted({(t.tensor_type.name, t.name) for t in reader.tensors if t.tensor_type.name not in SUPPORTED_TENSOR_TYPES})
    if bad:
        types = sorted({t for t, _ in bad})
        raise ValueError(f"GGUF file {path!r} has tensors of type {', '.join(types)} (first: {bad[0][1]!r}); "
                         f"supported: {', '.join(SUPPORTED_TENSOR_TYPES)}")
    return arch
