"""Live-server fixtures: a tiny chat checkpoint, `tandem serve` subprocesses, an in-process
reference Engine. The two servers start together at the beginning of the session (their model
loads overlap); each test waits only for the one it uses."""

from __future__ import annotations

import os

import pytest

from tests.server.helpers import ServerProcess, make_chat_checkpoint, started_together

API_KEY = "sk-tandem-test"
MODEL_NAME = "tiny-chat"
MAX_MODEL_LEN = 4096  # the checkpoint's max_position_embeddings: long requests run for seconds
MAX_RUNNING = 4
MAX_QUEUED = 4
MAX_REQUEST_BYTES = 64 << 10


@pytest.fixture(scope="session")
def chat_ckpt(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("server") / "tiny-chat")
    make_chat_checkpoint(path, max_position_embeddings=MAX_MODEL_LEN)
    return os.path.abspath(path)


@pytest.fixture(scope="session")
def _servers(chat_ckpt, tmp_path_factory):
    logs = tmp_path_factory.mktemp("server-logs")
    common = ["--model-path", chat_ckpt, "--device", "cpu", "--dtype", "float32"]
    main = ServerProcess(common + ["--served-model-name", MODEL_NAME, "--api-key", API_KEY,
                                   "--max-running-requests", str(MAX_RUNNING),
                                   "--max-queued-requests", str(MAX_QUEUED),
                                   "--max-request-bytes", str(MAX_REQUEST_BYTES)], logs / "main.log")
    # the draft is the target itself (STANDALONE): every draft token is accepted
    spec = ServerProcess(common + ["--max-total-tokens", "65536", "--speculative-algorithm", "STANDALONE",
                                   "--speculative-draft-model-path", chat_ckpt, "--speculative-num-steps", "3",
                                   "--speculative-num-draft-tokens", "4",
                                   "--speculative-adaptive", "off"], logs / "spec.log")
    # Structured output and tool calls (the spec server above is killed by a test): drafting every step
    # (on a CPU the adaptive policy would rightly stop: a self-draft costs a whole target forward), so
    # every tree node's grammar mask is exercised.
    structured = ServerProcess(common + ["--max-total-tokens", "65536", "--speculative-algorithm", "STANDALONE",
                                         "--speculative-draft-model-path", chat_ckpt, "--speculative-num-steps", "3",
                                         "--speculative-num-draft-tokens", "4", "--speculative-adaptive", "off"],
                               logs / "structured.log")
    with started_together({"main": main, "spec": spec, "structured": structured}) as servers:
        yield servers


@pytest.fixture(scope="session")
def server(_servers) -> ServerProcess:
    """The main server (API key, small queue); stopped with SIGTERM at the end, checked for orphans."""
    srv = _servers["main"]
    srv.wait_ready()
    srv.engine_pid = srv.health()["engine_pid"]
    yield srv
    srv.sigterm_and_check()


@pytest.fixture(scope="session")
def spec_server(_servers) -> ServerProcess:
    srv = _servers["spec"]
    srv.wait_ready()
    return srv


@pytest.fixture(scope="session")
def ref_engine(chat_ckpt):
    from tandem import Engine

    with Engine(chat_ckpt, device="cpu", dtype="float32") as engine:
        yield engine


@pytest.fixture(scope="session")
def structured_server(_servers) -> ServerProcess:
    srv = _servers["structured"]
    srv.wait_ready()
    return srv
