"""The one module that owns every cross-stream edge (DESIGN §3, stream discipline).

The speculative pipeline runs on two streams: `main` (draft, verify, extend) and `plan` (page-table
upload, verify metadata, extend metadata). Whenever one stream produces a tensor another stream
reads, or overwrites a tensor another stream may still read, the code goes through this module:

    event = streams.record("plan", "verify_plan")   # after the producer's last write
    streams.wait("main", event)                      # before the consumer's first read

and annotates each access of a shared buffer with `streams.read(buffer, stream)` /
`streams.write(buffer, stream)` (placed just before the access). With `TANDEM_STREAM_CHECK=1` a
checker replays these calls as vector clocks and raises `StreamOrderError` on any read or overwrite
that is not ordered after the last conflicting access of another stream. Events belong to one
iteration's data (its handle), never to a long-lived attribute, so an iteration launched early
cannot overwrite an event the previous one still waits on.

Streams and events come from `torch.get_device_module(device)`; on a CPU those are no-op stubs, and
tests swap in a recording stand-in to drive the checker through the real pipeline.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from tandem import envs

STREAM_NAMES = ("main", "plan", "host")


class StreamOrderError(RuntimeError):
    """A cross-stream access with no event ordering it after the conflicting access."""


@dataclass(frozen=True)
class FaultInjection:
    """Test-only faults for negative controls: `drop` skips the waits of the named edges; `move`
    records the named edges' events at the producer's start instead of after its last write."""

    drop: frozenset[str] = frozenset()
    move: frozenset[str] = frozenset()


@dataclass
class Edge:
    """A recorded event plus what the checker needs to know about it."""

    name: str
    producer: str
    event: object
    clock: dict[str, int] = field(default_factory=dict)


class StreamChecker:
    """Vector clocks over streams. Every access ticks its stream's own counter; recording an event
    snapshots the stream's clock; waiting merges the snapshot into the waiting stream's clock.
    Access A (stream S, tick t) happens before access B on stream T iff T's clock has S >= t."""

    def __init__(self):
        self.clocks = {s: {s: 0} for s in STREAM_NAMES}
        self.last_write: dict[str, tuple[str, int]] = {}
        self.reads: dict[str, dict[str, int]] = {}

    def _tick(self, stream: str) -> int:
        self.clocks[stream][stream] += 1
        return self.clocks[stream][stream]

    def _ordered(self, stream: str, other: str, tick: int) -> bool:
        return other == stream or self.clocks[stream].get(other, 0) >= tick

    def snapshot(self, stream: str) -> dict[str, int]:
        self._tick(stream)
        return dict(self.clocks[stream])

    def merge(self, stream: str, clock: dict[str, int]) -> None:
        mine = self.clocks[stream]
        for s, t in clock.items():
            mine[s] = max(mine.get(s, 0), t)

    def enqueue(self, stream: str) -> None:
        """Device work is enqueued by the host, so it happens after everything the host did before."""
        if stream != "host":
            self.merge(stream, self.snapshot("host"))

    def read(self, buffer: str, stream: str) -> None:
        self.enqueue(stream)
        tick = self._tick(stream)
        writer = self.last_write.get(buffer)
        if writer is not None and not self._ordered(stream, *writer):
            raise StreamOrderError(f"{stream} stream reads {buffer!r} with no event after the {writer[0]} "
                                   f"stream's last write of it (read-after-write race)")
        self.reads.setdefault(buffer, {})[stream] = tick

    def write(self, buffer: str, stream: str) -> None:
        self.enqueue(stream)
        tick = self._tick(stream)
        writer = self.last_write.get(buffer)
        if writer is not None and not self._ordered(stream, *writer):
            raise StreamOrderError(f"{stream} stream overwrites {buffer!r} with no event after the {writer[0]} "
                                   f"stream's last write of it (write-after-write race)")
        for reader, read_tick in self.reads.get(buffer, {}).items():
            if not self._ordered(stream, reader, read_tick):
                raise StreamOrderError(f"{stream} stream overwrites {buffer!r} while the {reader} stream may "
                                       f"still read it (write-after-read race)")
        self.last_write[buffer] = (stream, tick)
        self.reads[buffer] = {}


class StreamSet:
    def __init__(self, device: torch.device, use_plan_stream: bool = True, check: bool | None = None,
                 device_module=None, faults: FaultInjection = FaultInjection(), delay_cycles: int | None = None):
        self.device = device
        self.module = device_module or torch.get_device_module(device)
        self.main = self.module.current_stream()
        self.use_plan_stream = use_plan_stream
        self.plan = self.module.Stream() if use_plan_stream else self.main
        self.checker = StreamChecker() if (envs.stream_check() if check is None else check) else None
        self.faults = faults
        # GPU delay injection: spin this many cycles on the producer stream before each cross-stream
        # write, so a missing wait shows up as stale data instead of hiding behind lucky timing.
        self.delay_cycles = envs.stream_delay_cycles() if delay_cycles is None else delay_cycles
        self.delay_buffers = envs.stream_delay_buffers()
        self._early: dict[str, Edge] = {}

    def _stream(self, name: str):
        return self.main if name == "main" or not self.use_plan_stream else self.plan

    def _checked_name(self, name: str) -> str:
        # Without a plan stream, plan work runs on main: the checker must see one stream, not two.
        return "main" if name == "plan" and not self.use_plan_stream else name

    @contextlib.contextmanager
    def on(self, name: str):
        """Run the enclosed work on the named stream."""
        with self.module.stream(self._stream(name)):
            yield

    def begin(self, stream: str, edge: str) -> None:
        """Marks where a producer starts; only used to *move* an edge's record there (fault injection)."""
        if edge in self.faults.move:
            self._early[edge] = self._record(stream, edge)

    def record(self, stream: str, edge: str) -> Edge:
        """Event after the producer's last write of the data behind `edge`."""
        early = self._early.pop(edge, None)
        return early if early is not None else self._record(stream, edge)

    def _record(self, stream: str, edge: str) -> Edge:
        event = self.module.Event()
        event.record(self._stream(stream))
        clock = self.checker.snapshot(self._checked_name(stream)) if self.checker else {}
        return Edge(edge, stream, event, clock)

    def wait(self, stream: str, edge: Edge | None) -> None:
        """The consumer stream waits for exactly that producer event (never a blanket stream wait)."""
        if edge is None or edge.name in self.faults.drop:
            return
        self._stream(stream).wait_event(edge.event)
        if self.checker:
            self.checker.merge(self._checked_name(stream), edge.clock)

    def host_wait(self, edge: Edge) -> None:
        """The CPU waits for one event (results copied to pinned memory), not for the whole device."""
        if edge.name in self.faults.drop:
            return
        edge.event.synchronize()
        if self.checker:
            self.checker.merge("host", edge.clock)

    def done(self, edge: Edge) -> bool:
        """Whether the event has completed, without waiting for it."""
        query = getattr(edge.event, "query", None)
        finished = query() if query is not None else True
        if finished and self.checker:
            self.checker.merge("host", edge.clock)
        return finished

    def read(self, buffer: str, stream: str) -> None:
        if self.checker:
            self.checker.read(buffer, self._checked_name(stream))

    def write(self, buffer: str, stream: str) -> None:
        if (self.delay_cycles and self.device.type == "cuda" and stream != "host"
                and (not self.delay_buffers or buffer.split("[")[0] in self.delay_buffers)):
            with self.on(stream):
                torch.cuda._sleep(self.delay_cycles)
        if self.checker:
            self.checker.write(buffer, self._checked_name(stream))

    def keep_alive(self, tensor: torch.Tensor, stream: str) -> None:
        """A tensor allocated on one stream and used on another must not be recycled early."""
        if tensor.device.type == "cuda" and self.use_plan_stream:
            tensor.record_stream(self._stream(stream))
