"""The overlapped pipeline under the stream-order checker, driven by a recording stand-in for the
device module: the real code passes; removing or moving any cross-stream edge fails."""

import pytest

from tandem import Engine, SamplingParams
from tandem.runtime.streams import FaultInjection, StreamOrderError
from tests.models.tiny_checkpoints import prompts
from tests.speculative.conftest import CHAIN, ENGINE, TREE


class RecordingStream:
    def __init__(self, log, name):
        self.log, self.name = log, name

    def wait_event(self, event):
        self.log.append(("wait_event", self.name, event.recorded_on))

    def wait_stream(self, other):  # a blanket wait: the pipeline must never do this
        self.log.append(("wait_stream", self.name, other.name))


class RecordingEvent:
    count = 0

    def __init__(self, log):
        self.log, self.recorded_on = log, None
        RecordingEvent.count += 1
        self.serial = RecordingEvent.count

    def record(self, stream=None):
        self.recorded_on = stream.name
        self.log.append(("record", stream.name, self.serial))

    def synchronize(self):
        self.log.append(("event_synchronize", self.recorded_on, self.serial))


class RecordingDeviceModule:
    """Streams and events that do nothing but log what the pipeline asks of them."""

    def __init__(self):
        self.log = []
        self._main = RecordingStream(self.log, "main")
        self._count = 0

    def current_stream(self, device=None):
        return self._main

    def Stream(self):  # noqa: N802 (mirrors torch.cuda.Stream)
        self._count += 1
        return RecordingStream(self.log, f"side{self._count}")

    def Event(self):  # noqa: N802
        return RecordingEvent(self.log)

    def stream(self, s):
        import contextlib

        return contextlib.nullcontext()

    def synchronize(self, device=None):
        self.log.append(("device_synchronize",))


def _run(spec_models, shape, faults=FaultInjection(), plan=True, overlap=True, n=6, batch=16, **kw):
    module = RecordingDeviceModule()
    engine = Engine(spec_models["target"], speculative_algorithm="EAGLE3",
                    speculative_draft_model_path=spec_models["EAGLE3"], **shape, **ENGINE,
                    max_running_requests=batch, disable_plan_stream=not plan, disable_overlap_schedule=not overlap,
                    _runner_hooks={"device_module": module, "stream_faults": faults}, **kw)
    params = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    # Staggered arrivals: prefill chunks and verify steps share iterations.
    ids = prompts(n, seed=21)
    outs = []
    rids = [engine.add_request(p, params) for p in ids[: n // 2]]
    engine.step()
    rids += [engine.add_request(p, params) for p in ids[n // 2:]]
    done = {}
    while engine.has_unfinished():
        for out in engine.step().finished:
            done[out.request_id] = out
    outs = [done[r].token_ids for r in rids]
    return outs, module.log


@pytest.fixture(autouse=True)
def stream_check(monkeypatch):
    monkeypatch.setenv("TANDEM_STREAM_CHECK", "1")


@pytest.mark.parametrize("shape", [CHAIN, TREE], ids=["chain", "tree"])
def test_pipeline_passes_the_checker(spec_models, shape):
    _, log = _run(spec_models, shape)
    kinds = {entry[0] for entry in log}
    assert "wait_event" in kinds
    assert "wait_stream" not in kinds and "device_synchronize" not in kinds
    # The plan stream really is a second stream, and it waits on main-stream events.
    assert ("wait_event", "side1", "main") in log
    assert ("wait_event", "main", "side1") in log


# staging_released is the write-after-read edge on the page table's upload buffer.
EDGES = ["page_table", "verify_plan", "extend_plan", "seq_lens_ready", "staging_released"]


@pytest.mark.parametrize("edge", EDGES)
def test_removing_an_edge_is_caught(spec_models, edge):
    with pytest.raises(StreamOrderError):
        _run(spec_models, CHAIN, faults=FaultInjection(drop=frozenset({edge})))


@pytest.mark.parametrize("edge", ["page_table", "verify_plan", "extend_plan"])
def test_moving_an_edge_before_the_write_is_caught(spec_models, edge):
    with pytest.raises(StreamOrderError):
        _run(spec_models, CHAIN, faults=FaultInjection(move=frozenset({edge})))


def test_without_plan_stream_everything_is_one_stream(spec_models):
    _, log = _run(spec_models, CHAIN, plan=False)
    assert not any(e[0] == "wait_event" and "side" in e[1] for e in log)
    assert "wait_stream" not in {e[0] for e in log}


@pytest.mark.parametrize("shape", [CHAIN, TREE], ids=["chain", "tree"])
@pytest.mark.parametrize("batch", [1, 16])
def test_four_combinations_give_identical_greedy_output(spec_models, shape, batch):
    results = {}
    for overlap in (True, False):
        for plan in (True, False):
            results[(overlap, plan)], _ = _run(spec_models, shape, plan=plan, overlap=overlap, n=8, batch=batch)
    reference = Engine(spec_models["target"], **ENGINE).generate(
        input_ids=prompts(8, seed=21), sampling_params=SamplingParams(max_new_tokens=12, temperature=0.0,
                                                                      ignore_eos=True))
    want = [o.token_ids for o in reference]
    for combo, outs in results.items():
        assert outs == want, f"overlap={combo[0]} plan_stream={combo[1]} differs from plain decoding"


def test_first_tokens_do_not_wait_for_the_draft_prefill(spec_models, monkeypatch):
    """A prompt-only step hands its sampled tokens to the host at an event queued before the draft's
    prefill, so time to first token is plain decoding's (the draft prefill runs while they are sent)."""
    from tandem.speculative.drafter import Drafter

    logs = []
    real_prefill = Drafter.prefill

    def logged_prefill(self, *args, **kwargs):
        logs[0].append(("draft_prefill",))
        return real_prefill(self, *args, **kwargs)

    monkeypatch.setattr(Drafter, "prefill", logged_prefill)
    module = RecordingDeviceModule()
    logs.append(module.log)
    engine = Engine(spec_models["target"], speculative_algorithm="EAGLE3",
                    speculative_draft_model_path=spec_models["EAGLE3"], **CHAIN, **ENGINE,
                    _runner_hooks={"device_module": module})
    params = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    engine.add_request(prompts(1, seed=3)[0], params)
    first = None
    while first is None:
        first = next((d for d in engine.step().deltas), None)
    log = module.log
    draft_prefill = log.index(("draft_prefill",))
    waited = next(e for e in log if e[0] == "event_synchronize")
    recorded = log.index(("record", waited[1], waited[2]))
    assert recorded < draft_prefill, "the first token waited for the draft's prefill"
    assert log.index(waited) > draft_prefill  # (the draft prefill was queued before the host waited)
