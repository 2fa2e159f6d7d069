"""The front end's side of the ZMQ boundary to one engine core (one replica): starts the process,
sends it requests and aborts, and routes each token delta to the queue of the HTTP request waiting
for it. `replicas.ReplicaSet` holds one per data-parallel replica and picks where a request goes.

Sends go through a plain PUSH socket with no high-water mark, so `abort` is an ordinary call: it has
to run in `finally:` blocks of cancelled tasks, where awaiting is not possible. They never block: a
PUSH socket whose peer is gone has nowhere to queue a message, and a blocking send there would stop
the event loop (every replica's streams, /health, the watchdog) for good. See `_send`.
"""

from __future__ import annotations

import asyncio
import logging
import time

import zmq
import zmq.asyncio

from tandem.distributed.data_parallel import Env
from tandem.engine import ipc
from tandem.engine.core import EngineCoreProcess
from tandem.request import SamplingParams

logger = logging.getLogger(__name__)

WATCHDOG_INTERVAL_S = 0.25  # how soon a dead engine core is noticed
# How long a send may wait for a live core's input socket (it is connected long before the core says
# it is ready, so a wait means the core has closed it): past this the core is failed.
SEND_WAIT_S = 2.0


class EngineDead(Exception):
    """Put in a request's queue when the engine core is gone."""


class EngineClient:
    def __init__(self, engine_kwargs: dict, log_level: str = "INFO", env: Env | None = None,
                 name: str = "engine core"):
        """`env`: the replica's devices (data parallelism); `name` goes into its errors and logs."""
        self.name = name
        self.process = EngineCoreProcess(engine_kwargs, log_level, env, name)
        self.info: ipc.CoreReady | None = None
        self.stats: ipc.EngineStats | None = None
        self.dead_reason: str | None = None
        self._queues: dict[str, asyncio.Queue] = {}  # request id -> where its deltas go (the in-flight ones)
        self._unstarted: dict[str, int] = {}  # sent, no token back yet (the "queued" requests) -> prompt length
        self._tasks: list[asyncio.Task] = []
        self._flushes: dict[int, asyncio.Future] = {}  # flush id -> its CacheFlushed, once it comes
        self._flush_ids = 0
        self._ctx = zmq.Context()
        self._actx = zmq.asyncio.Context()
        self._push = self._pull = None
        self._closed = False

    # ---- lifecycle ----------------------------------------------------------------------------
    def launch(self) -> None:
        """Spawns the core process. It may start before `start` binds the sockets (ZMQ connects
        retry), so the model loads while the front end is still importing and loading its tokenizer."""
        if self.process.pid is None:
            self.process.start()

    async def start(self) -> ipc.CoreReady:
        """Binds the sockets and waits until the core's engine is built; raises if it fails to start."""
        self._push = self._ctx.socket(zmq.PUSH)
        self._push.setsockopt(zmq.SNDHWM, 0)
        self._push.setsockopt(zmq.LINGER, 0)
        self._push.bind(self.process.input_addr)
        self._pull = self._actx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.bind(self.process.output_addr)
        self.launch()
        while self.info is None:
            if await self._pull.poll(500):
                msg = ipc.decode(await self._pull.recv())
                if isinstance(msg, ipc.CoreFailed):
                    raise RuntimeError(f"{self.name} failed to start: {msg.message}")
                if isinstance(msg, ipc.CoreReady):
                    self.info = msg
            elif not self.process.is_alive():
                raise RuntimeError(f"{self.name} exited during startup (exit code {self.process.exitcode})")
        self._tasks = [asyncio.create_task(self._output_loop(), name="engine-outputs"),
                       asyncio.create_task(self._watchdog(), name="engine-watchdog")]
        return self.info

    async def shutdown(self) -> None:
        for task in self._tasks:
            task.cancel()
        if self.process.is_alive() and self._push is not None and self.dead_reason is None:
            try:
                self._send(ipc.encode(ipc.Shutdown()))
            except EngineDead:
                pass  # gone already: nothing to ask
        await asyncio.to_thread(self.process.stop)
        self._close_sockets()

    def kill(self) -> None:
        """Last resort when the event loop is gone (no graceful path)."""
        self.process.stop(timeout=0)
        self._close_sockets()

    def _close_sockets(self) -> None:
        if self._closed:
            return
        self._closed = True
        for sock in (self._push, self._pull):
            if sock is not None and not sock.closed:
                sock.close(linger=0)
        self._actx.term()
        self._ctx.term()

    @property
    def alive(self) -> bool:
        return self.dead_reason is None and self.process.is_alive()

    @property
    def num_queued(self) -> int:
        return len(self._unstarted)

    @property
    def num_in_flight(self) -> int:
        """Requests sent and not finished or aborted."""
        return len(self._queues)

    @property
    def queued_tokens(self) -> int:
        """Prompt tokens of the requests with no token back yet (prefill still ahead of them)."""
        return sum(self._unstarted.values())

    # ---- requests -----------------------------------------------------------------------------
    def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
            queue: asyncio.Queue) -> None:
        """Deltas arrive in `queue` as (TokenDelta, arrival time); errors as RequestRejected or
        EngineDead."""
        if self.dead_reason is not None:
            raise EngineDead(self.dead_reason)
        message = ipc.encode(ipc.AddRequest(request_id, prompt_token_ids, params))  # may raise: count nothing yet
        self._send(message)  # may raise EngineDead: nothing booked
        self._queues[request_id] = queue
        self._unstarted[request_id] = len(prompt_token_ids)

    def abort(self, request_ids: list[str]) -> None:
        live = [rid for rid in request_ids if self._queues.pop(rid, None) is not None]
        for rid in live:
            self._unstarted.pop(rid, None)
        if live and self.dead_reason is None:
            try:
                self._send(ipc.encode(ipc.AbortRequest(live)))
            except EngineDead:
                pass  # the core is gone and its requests with it; `_fail` has told their waiters

    async def flush_cache(self) -> ipc.CacheFlushed:
        """Asks the core to drop every cached KV page no request holds; raises EngineDead if it is gone."""
        if self.dead_reason is not None:
            raise EngineDead(self.dead_reason)
        self._flush_ids += 1
        flush_id = self._flush_ids
        future = self._flushes[flush_id] = asyncio.get_running_loop().create_future()
        try:
            self._send(ipc.encode(ipc.FlushCache(flush_id)))
            return await future
        finally:
            self._flushes.pop(flush_id, None)

    def _send(self, message: bytes) -> None:
        """Sends to the core without blocking on a dead one. The socket refuses a message only when
        no peer is connected (no high-water mark): then a core whose process has exited is failed
        at once, and a live one gets `SEND_WAIT_S` to reconnect before it is failed too. Raises
        EngineDead in both cases."""
        deadline = time.monotonic() + SEND_WAIT_S
        while True:
            try:
                self._push.send(message, zmq.NOBLOCK)
                return
            except zmq.Again:
                pass
            if not self.process.is_alive():
                self._fail(self._exit_reason())
            elif time.monotonic() > deadline:
                self._fail(f"{self.name} stopped reading requests")
            if self.dead_reason is not None:
                raise EngineDead(self.dead_reason)
            self._push.poll(10, zmq.POLLOUT)

    # ---- background tasks ---------------------------------------------------------------------
    async def _output_loop(self) -> None:
        try:
            await self._receive_outputs()
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a bad message must not leave requests waiting forever
            logger.exception("engine output loop failed")
            self._fail(f"engine output loop failed: {e}")

    async def _receive_outputs(self) -> None:
        while True:
            msg = ipc.decode(await self._pull.recv())
            now = time.monotonic()
            if isinstance(msg, ipc.CoreOutputs):
                self.stats = msg.stats
                for delta in msg.deltas:
                    self._route(delta, now)
            elif isinstance(msg, ipc.RequestRejected):
                self._unstarted.pop(msg.request_id, None)
                queue = self._queues.pop(msg.request_id, None)
                if queue is not None:
                    queue.put_nowait(msg)
            elif isinstance(msg, ipc.CacheFlushed):
                future = self._flushes.get(msg.flush_id)
                if future is not None and not future.done():
                    future.set_result(msg)
            elif isinstance(msg, ipc.CoreFailed):
                self._fail(f"{self.name} failed: {msg.message.splitlines()[0]}")
                logger.error("%s failed:\n%s", self.name, msg.message)

    def _route(self, delta: ipc.TokenDelta, now: float) -> None:
        rid = delta.request_id
        self._unstarted.pop(rid, None)
        queue = self._queues.get(rid) if delta.finish_reason is None else self._queues.pop(rid, None)
        if queue is not None:  # else: aborted meanwhile
            queue.put_nowait((delta, now))

    async def _watchdog(self) -> None:
        while self.dead_reason is None:
            await asyncio.sleep(WATCHDOG_INTERVAL_S)
            if not self.process.is_alive():
                self._fail(self._exit_reason())

    def _exit_reason(self) -> str:
        return f"{self.name} process exited (exit code {self.process.exitcode})"

    def _fail(self, reason: str) -> None:
        if self.dead_reason is not None:
            return
        self.dead_reason = reason
        logger.error("%s; failing %d in-flight requests", reason, len(self._queues))
        for queue in {id(q): q for q in self._queues.values()}.values():
            queue.put_nowait(EngineDead(reason))
        for future in self._flushes.values():
            if not future.done():
                future.set_exception(EngineDead(reason))
        self._queues.clear()
        self._unstarted.clear()
