"""Starts the tensor-parallel ranks and keeps ranks 1..N-1 in step with rank 0.

Rank 0 is the `Engine`'s process: it owns the scheduler and, before each step, broadcasts the
`SchedulerOutput` (pickled, on the gloo control group); every rank then runs the same model step, so
their collectives pair up. Ranks 1..N-1 run `worker_loop`: receive, launch, collect, until rank 0
sends None.

Rendezvous uses torch.distributed's standard environment variables (MASTER_ADDR, MASTER_PORT,
WORLD_SIZE, RANK). On one machine tandem sets them itself (a free local port) and starts the other
ranks as `python -m tandem.distributed.worker` subprocesses (distributed/rank_process.py); across
machines the user sets them and starts that same command on each rank other than 0. Workers get the engine configuration from rank 0, so they take no model flags.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from tandem import envs
from tandem.distributed.parallel_state import TPGroup, check_tp_shapes
from tandem.distributed.rank_process import RankProcess
from tandem.runtime.model_runner import ModelRunner
from tandem.runtime.step_result import StepResult

logger = logging.getLogger(__name__)

RENDEZVOUS_VARS = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK")
# Workers block on the control group while the engine is idle, for as long as it is idle.
WORKER_CONTROL_TIMEOUT = timedelta(days=30)


class TensorParallelError(RuntimeError):
    """A tensor-parallel rank died or stopped answering; the engine cannot continue."""


def init_tp_group(world_size: int, rank: int, device: torch.device, control_timeout: timedelta,
                  workers: list = ()) -> TPGroup:
    """Joins the process group described by the rendezvous environment variables. Rank 0 hosts the
    rendezvous store and waits for every other rank to check in there first, watching the rank
    processes it started (`workers`): one that dies is reported at once, with its exit code and last
    output, instead of after the rendezvous timeout."""
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    backend = "nccl" if device.type == "cuda" else "gloo"
    if dist.is_initialized():
        raise TensorParallelError("torch.distributed is already initialised in this process: one "
                                  "tensor-parallel engine per process")
    timeout = timedelta(seconds=envs.tp_timeout_s())
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                          is_master=rank == 0, timeout=timeout, wait_for_workers=False)
    if rank == 0:
        _wait_for_ranks(store, world_size, workers, timeout)
    else:
        store.set(f"{CHECK_IN_KEY}{rank}", "1")
    dist.init_process_group(backend, store=store, world_size=world_size, rank=rank, timeout=timeout)
    control = dist.new_group(backend="gloo", timeout=control_timeout)
    return TPGroup(rank, world_size, dist.group.WORLD, control)


CHECK_IN_KEY = "tandem/rank_up/"


def _wait_for_ranks(store, world_size: int, workers: list, timeout: timedelta) -> None:
    keys = [f"{CHECK_IN_KEY}{r}" for r in range(1, world_size)]
    deadline = time.monotonic() + timeout.total_seconds()
    while not store.check(keys):
        dead = [w for w in workers if not w.is_alive()]
        if dead:
            raise TensorParallelError("tensor-parallel startup failed: " + "; ".join(w.describe() for w in dead))
        if time.monotonic() > deadline:
            missing = [k.rsplit("/", 1)[1] for k in keys if not store.check([k])]
            raise TensorParallelError(f"tensor-parallel startup: ranks {', '.join(missing)} did not join within "
                                      f"{timeout.total_seconds():.0f} s (TANDEM_TP_TIMEOUT_S)")
        time.sleep(0.05)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rendezvous_env(tp_size: int) -> tuple[dict, bool]:
    """The rendezvous variables, and whether tandem must spawn the other ranks on this machine."""
    if "WORLD_SIZE" in os.environ:  # launched by the user (several machines, or torchrun)
        env = {k: os.environ.get(k) for k in RENDEZVOUS_VARS}
        missing = [k for k, v in env.items() if v is None]
        if missing:
            raise ValueError(f"WORLD_SIZE is set, so tensor parallelism expects {missing} too")
        if int(env["WORLD_SIZE"]) != tp_size:
            raise ValueError(f"WORLD_SIZE={env['WORLD_SIZE']} but tp_size={tp_size}")
        if int(env["RANK"]) != 0:
            raise ValueError(f"the engine runs on rank 0 (RANK={env['RANK']}); start the other ranks "
                             "with `python -m tandem.distributed.worker`")
        return env, False
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": os.environ.get("MASTER_PORT") or str(_free_port()),
           "WORLD_SIZE": str(tp_size), "RANK": "0"}
    return env, True


def start_tensor_parallel(tp_size: int, config, arch, max_model_len: int, seed: int, **runner_hooks):
    """Rank 0: starts (or joins) the other ranks and returns its runner."""
    check_tp_shapes(arch, tp_size)
    env, spawn = _rendezvous_env(tp_size)
    workers = []
    device = torch.device(config.load.device)
    if spawn and device.type == "cuda" and torch.cuda.device_count() < tp_size:
        raise ValueError(f"tp_size={tp_size} needs {tp_size} GPUs on this machine, found {torch.cuda.device_count()}")
    if spawn:
        for rank in range(1, tp_size):
            workers.append(RankProcess(rank, {**env, "RANK": str(rank), "LOCAL_RANK": str(rank),
                                              "TANDEM_TP_DEVICE": device.type,
                                              "TANDEM_TP_NUM_THREADS": str(torch.get_num_threads())}))
    saved = {k: os.environ.get(k) for k in RENDEZVOUS_VARS}
    os.environ.update(env)
    tp = None
    try:
        tp = init_tp_group(tp_size, 0, device, timedelta(seconds=envs.tp_timeout_s()), workers)
        tp.broadcast_object((config, arch, max_model_len, seed))
        runner = ModelRunner(config, arch, max_model_len, tp=tp, **runner_hooks)
    except BaseException as e:
        lead = TensorParallelRunner(None, tp, workers)
        dead = lead.dead_ranks(wait_s=2.0)
        lead.close()
        if dead:
            raise TensorParallelError(f"tensor-parallel startup failed: {dead}") from e
        raise
    finally:
        for k, v in saved.items():  # the variables described this engine only
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    logger.info("tensor parallelism: %d ranks (%s)", tp_size, "spawned here" if spawn else "external")
    return TensorParallelRunner(runner, tp, workers)


class TensorParallelRunner:
    """Rank 0's runner: sends each step to the other ranks, runs it, and turns a dead rank into a
    clear error instead of a hang. Everything else is the local `ModelRunner`'s."""

    def __init__(self, runner, tp: TPGroup | None, workers: list):
        self.runner = runner
        self.tp = tp
        self.workers = workers  # processes of the ranks spawned here (none when launched externally)
        self._closed = False
        self._broken: TensorParallelError | None = None  # set by the first failure: the group is unusable

    def __getattr__(self, name):  # num_pages, spec, model, ...
        runner = self.__dict__.get("runner")
        if runner is None:
            raise AttributeError(name)
        return getattr(runner, name)

    def dead_ranks(self, wait_s: float = 0.0) -> str:
        """'' if every spawned rank is alive; else which ones died and how. Waits up to `wait_s` for
        a rank that is dying (its sockets closed before its process was reaped)."""
        deadline = time.monotonic() + wait_s
        while True:
            dead = [p.describe() for p in self.workers if not p.is_alive()]
            if dead or time.monotonic() >= deadline:
                return "; ".join(dead)
            time.sleep(0.05)

    def _check(self) -> None:
        if self._closed:
            raise TensorParallelError("the tensor-parallel group is shut down")
        if self._broken is not None:
            raise TensorParallelError(str(self._broken))
        dead = self.dead_ranks()
        if dead:
            self._broken = TensorParallelError(f"tensor-parallel {dead}; the engine cannot continue")
            raise self._broken

    def _failed(self, e: RuntimeError) -> RuntimeError:
        """The error to raise for `e`: which rank died, if one did; else `e` itself, unless it came
        from a collective (then the group is unusable)."""
        dead = self.dead_ranks(wait_s=2.0)
        if dead:
            self._broken = TensorParallelError(f"tensor-parallel {dead}; the engine cannot continue")
        elif isinstance(e, dist.DistError) or "gloo" in str(e).lower() or "nccl" in str(e).lower():
            self._broken = TensorParallelError(f"a tensor-parallel collective failed ({e}); "
                                               "the engine cannot continue")
        else:
            return e
        return self._broken

    def launch(self, sched):
        self._check()  # before the broadcast: a dead peer would make it (or the step) hang or fail
        try:
            # Rank 0 picks the draft shape (its own timings): every rank must run the same graphs.
            shape = self.runner.choose_draft_shape(sched)
            self.tp.broadcast_object((sched, shape))
            return self.runner.launch(sched, shape)
        except RuntimeError as e:  # torch.distributed's errors (DistBackendError, gloo's) are RuntimeErrors
            err = self._failed(e)
            if err is e:
                raise
            raise err from e

    def collect(self, handle):
        try:
            return self.runner.collect(handle)
        except RuntimeError as e:
            err = self._failed(e)
            if err is e:
                raise
            raise err from e

    def execute(self, sched):
        handle = self.launch(sched)
        return StepResult() if handle is None else self.collect(handle)

    def close(self, timeout_s: float = 5.0) -> None:
        """Tells the other ranks to exit (if they are all alive), then ends the process group."""
        if self._closed:
            return
        self._closed = True
        if self.tp is not None and self._broken is None and not self.dead_ranks():
            try:
                self.tp.broadcast_object(None)
                # Every rank has the message before this one closes its sockets (else a worker
                # could read the close first and report rank 0 as lost).
                self.tp.control_barrier()
            except Exception:  # a rank died meanwhile: it is ended below either way
                pass
        if dist.is_initialized() and dist.get_backend() == "nccl":
            # NCCL's teardown waits for every rank's: take ours down while the workers take down theirs
            # (waiting for them to exit first left them blocked in theirs until they were killed).
            _destroy_process_group(timeout_s)
        for p in self.workers:
            p.join(timeout_s)
            if p.is_alive():
                logger.warning("tensor-parallel rank process %d did not exit; killing it", p.pid)
                p.kill()
                p.join()
        if dist.is_initialized():  # gloo: after the workers have gone (its teardown races theirs)
            _destroy_process_group(timeout_s)


def _destroy_process_group(timeout_s: float) -> None:
    """Ends the process group without letting a teardown hang stop the engine's shutdown. On two
    H200s NCCL's teardown on rank 0 can hang once rank 1 has exited; the workers tear their NCCL group
    down too (worker_main), and this bounds the wait either way."""
    done = threading.Event()

    def destroy() -> None:
        try:
            dist.destroy_process_group()
        finally:
            done.set()

    threading.Thread(target=destroy, name="tp-teardown", daemon=True).start()
    if not done.wait(timeout_s):
        logger.warning("tensor-parallel process group teardown did not finish in %.0f s; "
                       "leaving it to process exit", timeout_s)


# ---- ranks 1..N-1 -------------------------------------------------------------------------------
WORKER_TEARDOWN_S = 10.0
def worker_main() -> None:
    """A rank other than 0, described by the rendezvous environment variables."""
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device_type = envs.tp_device() or ("cuda" if torch.cuda.is_available() else "cpu")
    # The device type must match rank 0's before the config arrives: the backend depends on it.
    tp = init_tp_group(world_size, rank, torch.device(device_type), WORKER_CONTROL_TIMEOUT)
    config, arch, max_model_len, seed = tp.broadcast_object()
    if torch.device(config.load.device).type != device_type:
        raise TensorParallelError(f"rank 0 runs on {config.load.device!r}, rank {rank} found {device_type!r}")
    torch.manual_seed(seed)
    runner = ModelRunner(config, arch, max_model_len, tp=tp)
    worker_loop(runner, tp)
    if device_type == "cuda":
        # NCCL expects every rank to take its communicator down; rank 0 hung in its teardown when
        # this rank just exited. Bounded, like rank 0's.
        _destroy_process_group(WORKER_TEARDOWN_S)
    # Then exit at once: gloo's teardown races with rank 0's (it can hang, or abort when rank 0
    # closes its sockets first), and nothing is left to save.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def worker_loop(runner, tp: TPGroup) -> None:
    inflight = None
    while True:
        try:
            msg = tp.broadcast_object()
        except RuntimeError as e:  # rank 0's sockets closed: it died; nothing left to serve
            raise TensorParallelError(f"rank {tp.rank}: lost rank 0 ({e})") from None
        if msg is None:
            tp.control_barrier()  # pairs with rank 0's close()
            break
        sched, shape = msg
        handle = runner.launch(sched, shape)
        # Like rank 0's overlap loop: collect the previous step once the next is launched; the
        # handle keeps that step's inputs alive until then.
        if inflight is not None:
            runner.collect(inflight)
        inflight = handle
    if inflight is not None:
        runner.collect(inflight)
