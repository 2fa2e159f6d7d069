"""A rank that dies takes the engine down with a clear error, quickly, instead of a hang; and the
multi-machine launch (rendezvous through the environment, workers started by hand) works."""

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from tandem import Engine, SamplingParams
from tandem.distributed.launcher import TensorParallelError
from tests.distributed.conftest import ENGINE
from tests.models.tiny_checkpoints import prompts

PARAMS = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("when", ["idle", "mid_generate"])
def test_killed_rank_gives_clear_error(tp_models, when):
    engine = Engine(tp_models["llama3"], tp_size=2, **ENGINE)
    try:
        want = engine.generate(input_ids=prompts(2), sampling_params=PARAMS)
        pid = engine.runner.workers[0].pid
        if when == "idle":
            os.kill(pid, signal.SIGKILL)
            start = time.monotonic()
            with pytest.raises(TensorParallelError, match=r"rank 1 \(pid \d+\) exited with code -9"):
                engine.generate(input_ids=prompts(2), sampling_params=PARAMS)
        else:
            # Kill it while rank 0 is between steps of a long generation.
            for p in prompts(2):
                engine.add_request(p, SamplingParams(max_new_tokens=400, temperature=0.0, ignore_eos=True))
            engine.step()
            os.kill(pid, signal.SIGKILL)
            start = time.monotonic()
            with pytest.raises(TensorParallelError, match="rank 1"):
                for _ in range(1000):
                    engine.step()
        assert time.monotonic() - start < 10
        assert want  # the engine worked before the kill
    finally:
        engine.shutdown()  # must not hang on the dead group either


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_environment_rendezvous_with_external_worker(tp_models, monkeypatch):
    """What a two-machine launch does, on one machine: rank 0 is the engine, rank 1 is
    `python -m tandem.distributed.worker`, both told MASTER_ADDR/MASTER_PORT/WORLD_SIZE/RANK."""
    with Engine(tp_models["llama3"], **ENGINE) as engine:
        want = [o.token_ids for o in engine.generate(input_ids=prompts(4), sampling_params=PARAMS)]
    env = dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE="2")
    src = os.path.join(os.path.dirname(__file__), "..", "..", "src")
    worker = subprocess.Popen(
        [sys.executable, "-c", "import torch; torch.set_num_threads(1); import runpy; "
                               "runpy.run_module('tandem.distributed.worker', run_name='__main__')"],
        env={**os.environ, **env, "RANK": "1", "PYTHONPATH": src})
    try:
        for k, v in {**env, "RANK": "0"}.items():
            monkeypatch.setenv(k, v)
        with Engine(tp_models["llama3"], tp_size=2, **ENGINE) as engine:
            assert engine.runner.workers == []  # nothing spawned: rank 1 came from the environment
            got = [o.token_ids for o in engine.generate(input_ids=prompts(4), sampling_params=PARAMS)]
        assert got == want
        assert worker.wait(timeout=20) == 0  # shutdown told it to exit
    finally:
        if worker.poll() is None:
            worker.kill()


RANK0_SCRIPT = """
import sys, time, torch
torch.set_num_threads(1)
from tandem import Engine, SamplingParams

def main():
    e = Engine(sys.argv[1], tp_size=2, device="cpu", dtype="float32", page_size=4, max_total_tokens=1024)
    e.generate(input_ids=[[5, 6, 7]], sampling_params=SamplingParams(max_new_tokens=2, temperature=0.0))
    print("WORKER", e.runner.workers[0].pid, flush=True)
    time.sleep(120)

if __name__ == "__main__":
    main()
"""


def test_worker_exits_when_rank0_dies(tp_models, tmp_path):
    """No orphans: a worker blocked waiting for the next step notices rank 0's death and exits."""
    script = tmp_path / "rank0.py"
    script.write_text(RANK0_SCRIPT)
    src = os.path.join(os.path.dirname(__file__), "..", "..", "src")
    rank0 = subprocess.Popen([sys.executable, str(script), tp_models["llama3"]], stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, env={**os.environ, "PYTHONPATH": src}, text=True)
    try:
        line = rank0.stdout.readline()
        assert line.startswith("WORKER"), line
        worker = int(line.split()[1])
        rank0.kill()
        rank0.wait()
        deadline = time.monotonic() + 10
        while _alive(worker) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(worker)
    finally:
        if rank0.poll() is None:
            rank0.kill()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"  # a zombie has exited (its parent is gone, init reaps it)
    except FileNotFoundError:
        return False


UNGUARDED_SCRIPT = """
import torch
torch.set_num_threads(1)
from tandem import Engine, SamplingParams
import sys
engine = Engine(sys.argv[1], tp_size=2, device="cpu", dtype="float32", page_size=4, max_total_tokens=1024)
out = engine.generate(input_ids=[[5, 6, 7]], sampling_params=SamplingParams(max_new_tokens=3, temperature=0.0))
print("TOKENS", out[0].token_ids, flush=True)
engine.shutdown()
"""


def test_script_without_main_guard_starts_tensor_parallelism(tp_models, tmp_path):
    """The ranks run `python -m tandem.distributed.worker`: the user's script is not imported again."""
    script = tmp_path / "unguarded.py"
    script.write_text(UNGUARDED_SCRIPT)
    src = os.path.join(os.path.dirname(__file__), "..", "..", "src")
    proc = subprocess.run([sys.executable, str(script), tp_models["llama3"]], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": src})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "TOKENS [" in proc.stdout


def test_rank_dying_at_startup_is_reported_at_once_with_its_output(tp_models, monkeypatch):
    from tandem.distributed import rank_process

    monkeypatch.setattr(rank_process, "WORKER_COMMAND", (
        sys.executable, "-c", "import sys; sys.stderr.write('worker: cannot open the model\\n'); sys.exit(3)"))
    start = time.monotonic()
    with pytest.raises(TensorParallelError) as e:
        Engine(tp_models["llama3"], tp_size=2, **ENGINE)
    assert time.monotonic() - start < 5
    message = str(e.value)
    assert "rank 1" in message and "exited with code 3" in message and "cannot open the model" in message
