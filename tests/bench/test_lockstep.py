"""Engines taking turns step by step (`run_in_lockstep`) and the busy clock each is timed on."""

import time

import pytest
import torch

from tandem.bench.measure import BatchRun, random_prompts, run_batch, run_in_lockstep


class FakeRun:
    """A run that finishes after `steps` steps and records each step in a shared log."""

    def __init__(self, name: str, steps: int, log: list):
        self.name, self.left, self.log, self.busy_clock = name, steps, log, True

    def start(self):
        self.log.append(("start", self.name))

    def step(self) -> bool:
        self.log.append(self.name)
        self.left -= 1
        return self.left == 0

    def result(self):
        return self.name


def test_rounds_alternate_and_reverse_until_each_run_finishes():
    log = []
    out = run_in_lockstep([FakeRun("a", 2, log), FakeRun("b", 5, log), FakeRun("c", 3, log)])
    assert out == ["a", "b", "c"]
    assert log[:3] == [("start", "a"), ("start", "b"), ("start", "c")]
    # Round 0 a b c; round 1 reversed; a is done after its second step, c after its third.
    assert log[3:] == ["a", "b", "c", "c", "b", "a", "b", "c", "b", "b"]


def test_lockstep_refuses_runs_on_the_wall_clock():
    run = FakeRun("a", 1, [])
    run.busy_clock = False
    with pytest.raises(ValueError, match="busy clock"):
        run_in_lockstep([run])


def test_a_busy_clock_refuses_a_gpu_engine():
    class Engine:
        class runner:
            device = torch.device("cuda")
            spec = None

    with pytest.raises(ValueError, match="GPU"):
        BatchRun(Engine(), [[1, 2]], 4, busy_clock=True)


def test_the_busy_clock_leaves_out_time_between_steps(tiny_pair):
    """A run on its busy clock counts only its own engine calls; on the wall clock the pauses between
    steps count too. The tokens are the same either way."""
    from tandem import Engine

    target, head, _ = tiny_pair
    engine = Engine(target, speculative_algorithm="EAGLE3", speculative_draft_model_path=head, device="cpu",
                    dtype="float32")
    prompts = random_prompts(2, 6, engine.arch.vocab_size, seed=3)
    _, want = run_batch(engine, prompts, 8)
    pause = 0.02
    totals = {}
    for busy in (True, False):
        run = BatchRun(engine, prompts, 8, busy_clock=busy)
        run.start()
        steps = 0
        while not run.step():
            time.sleep(pause)
            steps += 1
        metrics, tokens = run.result()
        assert tokens == want and steps >= 2
        totals[busy] = metrics.total_s
        paused = steps * pause
    assert totals[False] >= paused
    assert totals[True] < totals[False] - 0.9 * paused
    engine.shutdown()
