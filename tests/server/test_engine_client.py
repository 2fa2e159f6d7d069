"""The front end's sends to an engine core whose process is gone must fail at once, not block: a
PUSH socket with no peer has nowhere to queue a message, and a blocking send there would freeze the
server's event loop. Real ZMQ sockets and a real child process; no model."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import time

import pytest
import zmq

from tandem.request import SamplingParams
from tandem.server import engine_client
from tandem.server.engine_client import EngineClient, EngineDead


def _read_forever(addr: str) -> None:
    sock = zmq.Context().socket(zmq.PULL)
    sock.connect(addr)
    while True:
        sock.recv()


def _sleep_forever() -> None:
    while True:
        time.sleep(1)


class ChildCore:
    """Stands in for `EngineCoreProcess`: a spawned child with the same liveness interface."""

    def __init__(self, target, *args):
        self.process = multiprocessing.get_context("spawn").Process(target=target, args=args, daemon=True)
        self.process.start()

    pid = property(lambda self: self.process.pid)
    exitcode = property(lambda self: self.process.exitcode)

    def is_alive(self) -> bool:
        return self.process.is_alive()

    def stop(self, timeout: float = 0) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(5)


def bound_client(tmp_path) -> tuple[EngineClient, str]:
    """An EngineClient with its request socket bound as `start` binds it, and no core started."""
    client = EngineClient({}, name="replica 0 engine core")
    addr = f"ipc://{tmp_path}/input"
    client._push = client._ctx.socket(zmq.PUSH)
    client._push.setsockopt(zmq.SNDHWM, 0)
    client._push.setsockopt(zmq.LINGER, 0)
    # So that a blocking send fails the test with zmq.Again instead of hanging it.
    client._push.setsockopt(zmq.SNDTIMEO, 3000)
    client._push.bind(addr)
    return client, addr


def add(client: EngineClient, rid: str, queue: asyncio.Queue) -> None:
    client.add(rid, [1, 2, 3], SamplingParams(max_new_tokens=2), queue)


def test_a_send_to_a_killed_core_fails_its_requests_at_once(tmp_path):
    client, addr = bound_client(tmp_path)
    client.process = ChildCore(_read_forever, addr)
    try:
        # The socket is writable once the child has connected (the child takes seconds to start).
        assert client._push.poll(60_000, zmq.POLLOUT), "the child never connected"
        waiting = asyncio.Queue()
        add(client, "a", waiting)
        assert client.num_in_flight == 1

        os.kill(client.process.pid, signal.SIGKILL)
        client.process.process.join(10)
        assert not client.process.is_alive()
        # ZMQ drops the dead peer on its own thread, a moment later (a send before that is queued and
        # lost, and the watchdog fails the request): wait until the socket has no peer.
        deadline = time.monotonic() + 10
        while client._push.poll(0, zmq.POLLOUT):
            assert time.monotonic() < deadline, "the dead peer was never dropped"
            time.sleep(0.01)
        started = time.monotonic()
        with pytest.raises(EngineDead, match="replica 0 engine core process exited"):
            add(client, "b", asyncio.Queue())
        assert time.monotonic() - started < 1.0
        # The request already in flight is told, nothing stays booked, and an abort is a no-op.
        assert isinstance(waiting.get_nowait(), EngineDead)
        assert client.num_in_flight == 0 and client.queued_tokens == 0
        client.abort(["a", "b"])
        assert not client.alive
    finally:
        client.process.stop()
        client._close_sockets()


def test_a_live_core_that_stopped_reading_is_failed_after_a_bounded_wait(tmp_path, monkeypatch):
    monkeypatch.setattr(engine_client, "SEND_WAIT_S", 0.2)
    client, _ = bound_client(tmp_path)
    client.process = ChildCore(_sleep_forever)  # alive, never connects
    try:
        started = time.monotonic()
        with pytest.raises(EngineDead, match="stopped reading requests"):
            add(client, "a", asyncio.Queue())
        assert 0.2 <= time.monotonic() - started < 2.0
        assert client.num_in_flight == 0
    finally:
        client.process.stop()
        client._close_sockets()
