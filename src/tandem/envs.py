"""Every TANDEM_* environment variable, read in one place."""

from __future__ import annotations

import os


def stream_check() -> bool:
    """TANDEM_STREAM_CHECK=1 turns on the run-time checker of cross-stream ordering."""
    return os.environ.get("TANDEM_STREAM_CHECK", "0") == "1"


def stream_delay_cycles() -> int:
    """TANDEM_STREAM_DELAY_CYCLES=N spins N GPU cycles before each cross-stream write (delay injection)."""
    return int(os.environ.get("TANDEM_STREAM_DELAY_CYCLES", "0"))


def stream_delay_buffers() -> frozenset[str]:
    """TANDEM_STREAM_DELAY_BUFFERS=a,b limits delay injection to writes of those buffers (names
    without the [iteration] suffix); empty means every cross-stream write."""
    raw = os.environ.get("TANDEM_STREAM_DELAY_BUFFERS", "")
    return frozenset(b for b in raw.split(",") if b)


def tp_timeout_s() -> float:
    """TANDEM_TP_TIMEOUT_S: how long rank 0 and the model collectives wait for a tensor-parallel peer
    before failing (a rank that dies outright is noticed sooner: its sockets close, or its process
    is found dead before the next step)."""
    return float(os.environ.get("TANDEM_TP_TIMEOUT_S", "120"))


def tp_device() -> str | None:
    """TANDEM_TP_DEVICE=cpu|cuda: the device type of a tensor-parallel worker rank (set by tandem
    for the ranks it spawns; for ranks started by hand, default: cuda if available)."""
    return os.environ.get("TANDEM_TP_DEVICE") or None


def tp_num_threads() -> int | None:
    """TANDEM_TP_NUM_THREADS=N (set by tandem for the ranks it starts): CPU threads of a worker rank,
    as many as rank 0 uses."""
    raw = os.environ.get("TANDEM_TP_NUM_THREADS")
    return int(raw) if raw else None


def cuda_graph_emulate() -> bool:
    """TANDEM_CUDA_GRAPH_EMULATE=1 (tests only): on a CPU, run the CUDA-graph code path with the
    "replay" being a plain call on the static, padded inputs, so the padding logic is tested
    without a GPU."""
    return os.environ.get("TANDEM_CUDA_GRAPH_EMULATE", "0") == "1"


def disable_fused_kernels() -> bool:
    """TANDEM_DISABLE_FUSED_KERNELS=1: on a GPU, run RMSNorm, rotary and SiLU-and-mul as plain torch
    ops instead of the fused triton kernels (layers/fused_kernels.py): for comparisons and bisecting."""
    return os.environ.get("TANDEM_DISABLE_FUSED_KERNELS", "0") == "1"


def cache_dir() -> str:
    """TANDEM_CACHE: where `tandem pull` keeps models fetched by name (default: ~/.cache/tandem)."""
    return os.path.expanduser(os.environ.get("TANDEM_CACHE") or os.path.join("~", ".cache", "tandem"))


def record_commit() -> str | None:
    """TANDEM_RECORD_COMMIT names the commit a benchmark record measured, for a checkout whose git history
    is not the code's (a copy of the working tree sent to another machine)."""
    return os.environ.get("TANDEM_RECORD_COMMIT") or None
