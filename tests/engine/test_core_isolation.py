"""A request whose admission fails, however it fails, is the only request that fails: the engine
core's loop (driven here in a thread over in-process ZMQ sockets, the same loop the core process
runs) rejects it and keeps serving the others, whose outputs equal plain `Engine.generate`, and the
KV pool returns to full."""

from __future__ import annotations

import os
import threading

import pytest

zmq = pytest.importorskip("zmq")  # (the GPU machine lacks it)

from tandem import Engine, SamplingParams
from tandem.engine import ipc
from tandem.engine.core import EngineCore

PROMPTS = {"a": [1, 20, 30, 40], "bad": [1, 5, 6], "b": [1, 7, 8, 9, 10]}
GREEDY = SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def engine():
    with Engine(device="cpu", dtype="float32") as e:  # the demo pair, speculation on
        yield e


def run_core(engine, messages, until_finished: set[str]):
    """Feeds `messages` to an EngineCore and collects what it sends until every id in
    `until_finished` has finished or been rejected; then shuts it down."""
    ctx = zmq.Context.instance()
    to_core, core_in = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    core_out, from_core = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    name = f"inproc://core-{id(messages)}"
    core_in.bind(name + "-in")
    to_core.connect(name + "-in")
    from_core.bind(name + "-out")
    core_out.connect(name + "-out")
    core = EngineCore(engine, core_in, core_out, os.getppid())
    thread = threading.Thread(target=core.run, daemon=True)
    thread.start()
    for m in messages:
        to_core.send(ipc.encode(m))
    tokens: dict[str, list[int]] = {}
    rejected: dict[str, ipc.RequestRejected] = {}
    open_ids = set(until_finished)
    while open_ids:
        assert from_core.poll(30_000), "the engine core stopped answering"
        msg = ipc.decode(from_core.recv())
        assert not isinstance(msg, ipc.CoreFailed), msg.message
        if isinstance(msg, ipc.RequestRejected):
            rejected[msg.request_id] = msg
            open_ids.discard(msg.request_id)
        elif isinstance(msg, ipc.CoreOutputs):
            for d in msg.deltas:
                tokens.setdefault(d.request_id, []).extend(d.new_token_ids)
                if d.finish_reason is not None:
                    open_ids.discard(d.request_id)
    to_core.send(ipc.encode(ipc.Shutdown()))
    thread.join(10)
    assert not thread.is_alive()
    for s in (to_core, core_in, core_out, from_core):
        s.close(linger=0)
    return tokens, rejected


@pytest.mark.parametrize("where", ["scheduler", "grammar"])
def test_a_failing_admission_fails_only_its_request(engine, monkeypatch, where):
    expected = {rid: out.token_ids for rid, out in zip(
        ("a", "b"), engine.generate(input_ids=[PROMPTS["a"], PROMPTS["b"]], sampling_params=GREEDY))}
    params = dict(a=GREEDY, b=GREEDY, bad=GREEDY)
    if where == "scheduler":  # fails once the request is nearly admitted (the last step of add_request)
        real_add = engine.scheduler.add_request

        def add(req):
            if req.request_id == "bad":
                raise RuntimeError("injected admission failure")
            return real_add(req)

        monkeypatch.setattr(engine.scheduler, "add_request", add)
    else:  # fails while compiling the request's grammar
        params["bad"] = SamplingParams(max_new_tokens=10, regex="[ab]{1,3}")

        def compile_grammar(p):
            raise RuntimeError("injected admission failure")

        monkeypatch.setattr(engine, "_compile_grammar", compile_grammar)
    messages = [ipc.AddRequest(rid, PROMPTS[rid], params[rid]) for rid in ("a", "bad", "b")]
    tokens, rejected = run_core(engine, messages, {"a", "bad", "b"})
    assert set(rejected) == {"bad"} and rejected["bad"].internal
    assert "injected admission failure" in rejected["bad"].message
    assert tokens == expected
    alloc = engine.scheduler.allocator
    assert not engine.has_unfinished() and alloc.num_used == 0  # every page free or cached


def test_a_value_no_table_holds_is_rejected_and_the_core_keeps_serving(engine):
    # Built past SamplingParams' own check (as a client of the wire format could): the core must
    # still refuse it at admission, not fail in a step.
    bad = SamplingParams(max_new_tokens=2)
    bad.temperature = 1e39
    expected = engine.generate(input_ids=[PROMPTS["a"]], sampling_params=GREEDY)[0].token_ids
    messages = [ipc.AddRequest("bad", PROMPTS["bad"], bad), ipc.AddRequest("a", PROMPTS["a"], GREEDY)]
    tokens, rejected = run_core(engine, messages, {"bad", "a"})
    assert set(rejected) == {"bad"} and not rejected["bad"].internal
    assert "temperature" in rejected["bad"].message and "float32" in rejected["bad"].message
    assert tokens == {"a": expected}
