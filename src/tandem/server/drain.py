"""Graceful shutdown: on SIGTERM (or the first Ctrl-C) the server stops taking requests (503 with
Retry-After, and /health says so, while the port stays open), gives the requests in flight
`--shutdown-timeout` seconds to finish, ends the rest with a `server_shutdown` error (a last
`data: {"error": ...}` event for streams, a 503 otherwise), and only then lets uvicorn close the
connections and stop the engine cores. A second signal skips the wait.
"""

from __future__ import annotations

import asyncio
import logging

import uvicorn

from tandem.server.errors import OpenAIError

logger = logging.getLogger(__name__)

FLUSH_S = 2.0  # after the timeout: time for the interrupted responses to reach their clients


def shutting_down() -> OpenAIError:
    return OpenAIError(503, "the server is shutting down; retry on another instance or later",
                       code="server_shutdown", headers={"Retry-After": "1"})


class Drain:
    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self.started = False
        self.active: set = set()  # serving.Generation objects in flight

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        logger.info("shutting down: %d requests in flight get up to %g s to finish; new requests get 503",
                    len(self.active), self.timeout_s)
        deadline = loop.time() + self.timeout_s
        while self.active and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if self.active:
            logger.warning("shutdown timeout: ending %d requests with a server_shutdown error", len(self.active))
            for gen in list(self.active):
                gen.interrupt(shutting_down())
            flushed = loop.time() + FLUSH_S
            while self.active and loop.time() < flushed:
                await asyncio.sleep(0.05)


class DrainingServer(uvicorn.Server):
    """uvicorn's server with a drain before its own shutdown."""

    def __init__(self, config: uvicorn.Config, drain: Drain):
        super().__init__(config)
        self.drain = drain
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig, frame) -> None:
        if self.drain.started or self._loop is None or not self.started:
            super().handle_exit(sig, frame)  # a second signal, or not serving yet: stop now
            return
        self.drain.started = True
        self._captured_signals.append(sig)  # uvicorn re-raises it once stopped (the exit status says so)
        self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._drain_then_exit()))

    async def _drain_then_exit(self) -> None:
        try:
            await self.drain.run()
        finally:
            self.should_exit = True
