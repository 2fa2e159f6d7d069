"""Builds a model on its device and streams checkpoint tensors into it, one tensor at a time.

The module is allocated directly on the target device in the target dtype; each safetensors tensor is
read, copied into its parameter (or a slice of a merged one) and dropped, so host memory never holds
more than one tensor of the checkpoint.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os

import torch
from safetensors import safe_open
from torch import nn
from tqdm import tqdm

from tandem.layers.linear import WeightShapeError, default_weight_loader

# Tensors some checkpoints carry that have no parameter here, by design.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def resolve_dtype(dtype: str, device: str, checkpoint_dtype: str | None) -> torch.dtype:
    if dtype == "auto":
        if torch.device(device).type == "cpu":
            return torch.float32  # half-precision matmuls are ~100x slower on CPUs
        dtype = checkpoint_dtype if checkpoint_dtype in ("bfloat16", "float16") else "bfloat16"
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def checkpoint_files(model_path: str) -> list[str]:
    index = os.path.join(model_path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(model_path, n) for n in names]
    files = sorted(glob.glob(os.path.join(model_path, "*.safetensors")))
    if not files:
        # Many public EAGLE heads ship only a pickled state dict.
        files = sorted(glob.glob(os.path.join(model_path, "pytorch_model*.bin")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors (or pytorch_model*.bin) files in {model_path!r}")
    return files


def iter_checkpoint(model_path: str, desc: str = "loading weights", lazy: bool = False):
    """Yields (name, tensor) for every tensor of the checkpoint, with a progress bar. With `lazy`,
    safetensors tensors come as `LazyTensor`s: a tensor-parallel rank reads only its slice. A GGUF
    file's tensors come dequantized, whole (each rank then keeps its slice)."""
    from tandem.gguf import is_gguf_path

    if is_gguf_path(model_path):
        from tandem.gguf.tensors import iter_gguf_tensors

        yield from iter_gguf_tensors(model_path, desc=desc)
        return
    files = checkpoint_files(model_path)
    handles = [_open(f) for f in files]
    total = sum(len(h.keys()) for h in handles)
    with tqdm(total=total, desc=desc, unit="tensor", leave=False) as bar:
        for handle in handles:
            for name in handle.keys():
                if lazy and not isinstance(handle, _PickledCheckpoint):
                    yield name, LazyTensor(handle.get_slice(name))
                else:  # a pickled checkpoint is mmapped: narrowing it reads only the slice too
                    yield name, handle.get_tensor(name)
                bar.update(1)


class LazyTensor:
    """A checkpoint tensor not read yet: `shape`, `read()` (all of it), `read_slice(dim, start, n)`."""

    def __init__(self, safe_slice):
        self._slice = safe_slice
        self.shape = tuple(safe_slice.get_shape())

    def read(self) -> torch.Tensor:
        return self._slice[:] if self.shape else self._slice[()]

    def read_slice(self, dim: int, start: int, length: int) -> torch.Tensor:
        index = tuple(slice(start, start + length) if i == dim else slice(None) for i in range(len(self.shape)))
        return self._slice[index]


class _PickledCheckpoint:
    """A `pytorch_model.bin` read lazily through mmap, with the safetensors handle's two methods."""

    def __init__(self, path: str):
        self.state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)

    def keys(self):
        return list(self.state.keys())

    def get_tensor(self, name):
        return self.state[name]


def _open(path: str):
    if path.endswith(".bin"):
        return _PickledCheckpoint(path)
    return safe_open(path, framework="pt", device="cpu")


def load_weights(
    model: nn.Module,
    tensors,
    packed_modules: dict[str, tuple[str, object]],
    skip: frozenset[str] = frozenset(),
    rename=None,
) -> None:
    """Copies every (name, tensor) into `model`; raises naming missing, unexpected or mis-shaped tensors.

    `packed_modules` maps a checkpoint name fragment to (our fragment, shard id) for merged layers;
    `skip` lists checkpoint names to ignore; `rename` optionally maps a checkpoint name to ours.
    """
    params = dict(model.named_parameters())
    expected = set()
    for pname, p in params.items():
        for shard in getattr(p, "shard_ids", (None,)):
            expected.add((pname, shard))
    loaded, unexpected = set(), []
    for name, tensor in tensors:
        if name in skip or name.endswith(IGNORED_SUFFIXES):
            continue
        target = rename(name) if rename else name
        if target is None:
            continue
        pname, shard = target, None
        for fragment, (merged, shard_id) in packed_modules.items():
            if f".{fragment}." in target:
                pname, shard = target.replace(f".{fragment}.", f".{merged}."), shard_id
                break
        param = params.get(pname)
        if param is None:
            unexpected.append(name)
            continue
        try:
            with torch.no_grad():
                getattr(param, "weight_loader", default_weight_loader)(param, tensor, shard)
        except WeightShapeError as e:
            raise WeightShapeError(f"checkpoint tensor {name!r}: {e}") from None
        loaded.add((pname, shard))
    if unexpected:
        raise ValueError(f"checkpoint has tensors this model does not use: {sorted(unexpected)}")
    missing = expected - loaded
    if missing:
        names = sorted(_checkpoint_name(p, s, packed_modules) for p, s in missing)
        raise ValueError(f"checkpoint is missing tensors: {names}")


def _checkpoint_name(pname: str, shard, packed_modules) -> str:
    for fragment, (merged, shard_id) in packed_modules.items():
        if shard == shard_id and f".{merged}." in pname:
            return pname.replace(f".{merged}.", f".{fragment}.")
    return pname


def init_dummy_weights(model: nn.Module, seed: int) -> None:
    """Random weights in the real shapes (benchmarks only): small normal values, norms at one.
    Drawn on the parameters' own device, so an 8B model initialises in a fraction of a second."""
    gens = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not p.dtype.is_floating_point:
                p.zero_()
            elif "norm" in name:
                p.fill_(1.0)
            else:
                gen = gens.get(p.device)
                if gen is None:
                    gen = gens[p.device] = torch.Generator(device=p.device).manual_seed(seed)
                p.normal_(0.0, 0.02, generator=gen)
