"""Data-parallel replicas: which devices (and CPU threads) each replica's process gets.

A replica is a whole engine in its own process (its own scheduler and KV cache), possibly tensor-
parallel itself. Replica r of a deployment with tensor-parallel size T gets GPUs r*T .. r*T+T-1 of
the GPUs this process sees: its process sees only those (CUDA_VISIBLE_DEVICES), so inside it the
tensor-parallel launcher's rank i takes its GPU i exactly as it does without replicas.

The changes are computed in the parent (`replica_envs`) and applied by the replica's own process
first thing (`apply_env`), before anything there initialises CUDA.
"""

from __future__ import annotations

import os

Env = dict[str, str | None]  # variable -> value; None unsets it


def visible_gpus() -> list[str]:
    """The GPUs this process may hand out, as CUDA_VISIBLE_DEVICES entries (indices or UUIDs)."""
    import torch

    count = torch.cuda.device_count()
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is None:
        return [str(i) for i in range(count)]
    # CUDA stops at the first invalid entry, and device_count() counts only the valid ones.
    return [d.strip() for d in listed.split(",") if d.strip()][:count]


def replica_gpus(dp_size: int, tp_size: int, gpus: list[str]) -> list[list[str]]:
    """Replica r gets gpus[r*tp_size : (r+1)*tp_size]."""
    need = dp_size * tp_size
    if len(gpus) < need:
        raise ValueError(f"dp_size={dp_size} x tp_size={tp_size} needs {need} GPUs, found {len(gpus)}")
    return [gpus[r * tp_size:(r + 1) * tp_size] for r in range(dp_size)]


def uses_cuda(device: str | None) -> bool:
    import torch

    return torch.cuda.is_available() if device is None else torch.device(device).type == "cuda"


def replica_envs(dp_size: int, tp_size: int, device: str | None) -> list[Env]:
    """The environment changes of each replica's process. Raises ValueError for a deployment that
    cannot be laid out (too few GPUs, a pinned GPU index, an external tensor-parallel launch)."""
    if dp_size < 1:
        raise ValueError(f"dp_size must be >= 1 (got {dp_size})")
    if tp_size < 1:
        raise ValueError(f"tp_size must be >= 1 (got {tp_size})")
    if dp_size == 1:
        return [{}]  # one engine runs exactly as it does without replicas
    if "WORLD_SIZE" in os.environ:
        raise ValueError("dp_size > 1 cannot join an externally launched tensor-parallel group "
                         "(WORLD_SIZE is set); unset the rendezvous variables")
    # Each replica's tensor-parallel group picks its own free port: a shared MASTER_PORT would clash.
    common: Env = {"MASTER_PORT": None}
    if not uses_cuda(device):
        if "OMP_NUM_THREADS" not in os.environ:
            # torch takes every core in every process; replicas sharing them would oversubscribe.
            threads = max(1, (os.cpu_count() or 1) // (dp_size * tp_size))
            common["OMP_NUM_THREADS"] = str(threads)
        return [dict(common) for _ in range(dp_size)]
    if device is not None and ":" in device:
        raise ValueError(f"device={device!r} pins one GPU; with dp_size > 1 pass device='cuda' "
                         "(replica r uses GPUs r*tp_size .. r*tp_size+tp_size-1)")
    return [{**common, "CUDA_VISIBLE_DEVICES": ",".join(gpus)}
            for gpus in replica_gpus(dp_size, tp_size, visible_gpus())]


def apply_env(env: Env) -> None:
    """Applies `env` to this process; call it before anything initialises CUDA."""
    for name, value in env.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    threads = env.get("OMP_NUM_THREADS")
    if threads is not None:
        # torch read OMP_NUM_THREADS when it was imported (possibly already): set it explicitly.
        import torch

        torch.set_num_threads(int(threads))
