"""Live data-parallel servers (`tandem serve --dp-size 2`, two engine-core processes each) on a tiny
chat checkpoint, and an in-process single `Engine` as the independent reference. Both servers start
together at the beginning of the session (their model loads overlap)."""

from __future__ import annotations

import os

import pytest

from tests.server.helpers import ServerProcess, make_chat_checkpoint, started_together

MAX_MODEL_LEN = 4096  # long requests run for seconds
MAX_RUNNING = 4


@pytest.fixture(scope="session")
def dp_ckpt(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("dp") / "tiny-chat")
    make_chat_checkpoint(path, max_position_embeddings=MAX_MODEL_LEN)
    return os.path.abspath(path)


@pytest.fixture(scope="session")
def _dp_servers(dp_ckpt, tmp_path_factory):
    logs = tmp_path_factory.mktemp("dp-logs")
    args = ["--model-path", dp_ckpt, "--device", "cpu", "--dtype", "float32", "--dp-size", "2",
            "--max-running-requests", str(MAX_RUNNING)]
    # "kill": its replicas get killed
    with started_together({"main": ServerProcess(args, logs / "main.log"),
                           "kill": ServerProcess(args, logs / "kill.log")}) as servers:
        yield servers


@pytest.fixture(scope="session")
def dp_server(_dp_servers) -> ServerProcess:
    srv = _dp_servers["main"]
    srv.wait_ready()
    return srv


@pytest.fixture(scope="session")
def dp_kill_server(_dp_servers) -> ServerProcess:
    srv = _dp_servers["kill"]
    srv.wait_ready()
    return srv


@pytest.fixture(scope="session")
def dp_ref_engine(dp_ckpt):
    from tandem import Engine

    with Engine(dp_ckpt, device="cpu", dtype="float32") as engine:
        yield engine
