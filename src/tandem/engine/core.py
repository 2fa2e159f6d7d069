"""The engine core process: an `Engine` behind two ZMQ pipes (DESIGN §3).

Loop: take every pending message (add / abort), run one `engine.step()` if there is work, push
its token deltas and a stats snapshot. With no work it blocks on the input socket (no spin),
waking once a second only to notice that its parent died.

`EngineCoreProcess` is the front end's handle: it spawns the process and ends it. With data-parallel
replicas the front end has one per replica, each with the environment that gives it its own GPUs.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import shutil
import signal
import tempfile
import traceback

import zmq

from tandem.distributed.data_parallel import Env, apply_env
from tandem.engine import ipc

logger = logging.getLogger(__name__)

PARENT_CHECK_MS = 1000  # how often an idle core checks that its parent is alive


class EngineCore:
    def __init__(self, engine, inputs: zmq.Socket, outputs: zmq.Socket, parent_pid: int):
        self.engine = engine
        self.inputs = inputs
        self.outputs = outputs
        self.parent_pid = parent_pid

    def run(self) -> None:
        self._send(self._ready())
        self._send(ipc.CoreOutputs([], self.stats()))
        while True:
            busy = self.engine.has_unfinished()
            handled = self._receive(block=not busy)
            if handled is None:
                return  # Shutdown, or the parent is gone
            if self.engine.has_unfinished():
                out = self.engine.step()
                self._send(ipc.CoreOutputs(out.deltas, self.stats()))
            elif handled:
                self._send(ipc.CoreOutputs([], self.stats()))  # e.g. pages freed by an abort

    def _receive(self, block: bool) -> int | None:
        """Handles every pending message; waits for the first one if `block`. Returns how many
        were handled, or None when the core should exit."""
        if block:
            while not self.inputs.poll(PARENT_CHECK_MS):
                if os.getppid() != self.parent_pid:
                    logger.warning("front end process is gone; engine core exiting")
                    return None
        elif os.getppid() != self.parent_pid:
            return None
        handled = 0
        while True:
            try:
                raw = self.inputs.recv(zmq.NOBLOCK)
            except zmq.Again:
                return handled
            handled += 1
            try:
                msg = ipc.decode(raw)  # rebuilding SamplingParams validates them again
            except Exception as e:
                self._reject_undecodable(raw, e)
                continue
            if isinstance(msg, ipc.AddRequest):
                self._add(msg)
            elif isinstance(msg, ipc.AbortRequest):
                for rid in msg.request_ids:
                    self.engine.abort(rid)
            elif isinstance(msg, ipc.FlushCache):
                flushed = self.engine.flush_cache()
                holding = 0 if flushed else self.engine.scheduler.num_running
                self._send(ipc.CacheFlushed(msg.flush_id, flushed, holding))
            elif isinstance(msg, ipc.Shutdown):
                return None

    def _add(self, msg: ipc.AddRequest) -> None:
        """Admits one request. Whatever goes wrong while admitting it fails that request alone: the
        loop, the KV pool and every other request carry on (only a failing step ends the core)."""
        try:
            self.engine.add_request(msg.prompt_token_ids, msg.sampling_params, request_id=msg.request_id)
        except ValueError as e:
            self._send(ipc.RequestRejected(msg.request_id, str(e)))
        except Exception as e:
            logger.exception("request %s failed while being admitted", msg.request_id)
            self.engine.abort(msg.request_id)  # in case it got as far as the scheduler
            self._send(ipc.RequestRejected(msg.request_id, f"the engine could not admit the request "
                                                           f"({type(e).__name__}: {e})", internal=True))

    def _reject_undecodable(self, raw: bytes, error: Exception) -> None:
        """A message that does not rebuild (an AddRequest whose parameters fail their check) fails its
        request, if it names one, and nothing else."""
        rid = ipc.request_id_of(raw)
        logger.warning("undecodable message%s: %s", f" for request {rid}" if rid else "", error)
        if rid is not None:
            self._send(ipc.RequestRejected(rid, str(error), internal=not isinstance(error, ValueError)))

    def stats(self) -> ipc.EngineStats:
        sched = self.engine.scheduler
        stats = ipc.EngineStats(sched.num_running, sched.num_waiting, sched.allocator.num_used,
                                sched.allocator.num_total, kv_pages_cached=sched.allocator.num_cached,
                                prefix_cache_queries=sched.prefix_stats.queries,
                                prefix_cache_hits=sched.prefix_stats.hits)
        spec = getattr(self.engine.runner, "spec", None)
        if spec is not None:
            s = spec.stats
            policy = spec.policy
            stats.spec = ipc.SpecCounters(s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens,
                                          list(s.accepted_per_position), s.mean_accept_length, list(s.steps_by_depth),
                                          policy.effective_acceptance() if policy is not None else [],
                                          s.catch_ups, s.dormant_admitted)
        return stats

    def _ready(self) -> ipc.CoreReady:
        e = self.engine
        return ipc.CoreReady(pid=os.getpid(), model_path=e.args.model_path, max_model_len=e.max_model_len,
                             vocab_size=e.arch.vocab_size, page_size=e.args.page_size,
                             num_pages=e.scheduler.allocator.num_total,
                             speculative_algorithm=e.args.speculative_algorithm,
                             max_running_requests=e.args.max_running_requests)

    def _send(self, msg) -> None:
        self.outputs.send(ipc.encode(msg))


def run_engine_core(engine_kwargs: dict, input_addr: str, output_addr: str, parent_pid: int,
                    log_level: str = "INFO", env: Env | None = None, name: str = "engine core") -> None:
    """Entry point of the spawned process. `env`: a replica's devices, applied before CUDA starts."""
    apply_env(env or {})
    # Ctrl-C reaches the whole process group; the front end decides when the core stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=log_level.upper(),
                        format=f"%(asctime)s %(levelname)s [{name}] %(name)s: %(message)s")
    ctx = zmq.Context()
    inputs = ctx.socket(zmq.PULL)
    inputs.connect(input_addr)
    outputs = ctx.socket(zmq.PUSH)
    outputs.setsockopt(zmq.LINGER, 2000)  # let a final CoreFailed reach the front end
    outputs.connect(output_addr)
    try:
        from tandem.engine.engine import Engine

        engine = Engine(**engine_kwargs)
        EngineCore(engine, inputs, outputs, parent_pid).run()
        engine.shutdown()  # tensor parallelism: lets the other ranks exit
    except BaseException as e:
        logger.exception("engine core failed")
        outputs.send(ipc.encode(ipc.CoreFailed(f"{type(e).__name__}: {e}\n{traceback.format_exc()}")))
        raise SystemExit(1)
    finally:
        inputs.close(linger=0)
        outputs.close()
        ctx.term()


class EngineCoreProcess:
    """Spawns the engine core (multiprocessing "spawn": no inherited threads or CUDA state)."""

    def __init__(self, engine_kwargs: dict, log_level: str = "INFO", env: Env | None = None,
                 name: str = "engine core"):
        self._dir = tempfile.mkdtemp(prefix="tandem-")  # short path: ipc:// names are length-limited
        self.input_addr = f"ipc://{self._dir}/input"
        self.output_addr = f"ipc://{self._dir}/output"
        ctx = multiprocessing.get_context("spawn")
        self.process = ctx.Process(target=run_engine_core, name="tandem-" + name.replace(" ", "-"),
                                   args=(engine_kwargs, self.input_addr, self.output_addr, os.getpid(),
                                         log_level, env, name))

    def start(self) -> None:
        self.process.start()
        logger.info("engine core process started (pid %d)", self.process.pid)

    @property
    def pid(self) -> int | None:
        return self.process.pid

    def is_alive(self) -> bool:
        return self.process.pid is not None and self.process.is_alive()

    @property
    def exitcode(self) -> int | None:
        return self.process.exitcode

    def stop(self, timeout: float = 5.0) -> None:
        """Waits up to `timeout` for an exit already asked for, then terminates, then kills."""
        if self.process.pid is not None:
            self.process.join(timeout)
            if self.process.is_alive():
                logger.warning("engine core did not exit; terminating it")
                self.process.terminate()
                self.process.join(2.0)
            if self.process.is_alive():
                self.process.kill()
                self.process.join()
        shutil.rmtree(self._dir, ignore_errors=True)
