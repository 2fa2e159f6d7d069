"""SIGTERM with requests in flight (server/drain.py): new requests get 503 + Retry-After while the
port stays open, a request that can finish within --shutdown-timeout finishes, the rest end with a
`server_shutdown` error (streams: a last error event, no cut-off chunked read), the log has no
traceback, and the engine core stops with the server."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx

from tests.server.helpers import ServerProcess, pid_alive, wait_for

SHUTDOWN_TIMEOUT_S = 3


def stream_events(url: str, body: dict, events: list, done: threading.Event) -> None:
    """Reads an SSE stream to its end; events gets every data payload, or ("broken", error)."""
    try:
        with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
            events.append(("status", r.status_code))
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
    except httpx.HTTPError as e:
        events.append(("broken", repr(e)))
    finally:
        done.set()


def test_sigterm_drains_then_ends_the_rest_with_an_error(chat_ckpt, tmp_path):
    srv = ServerProcess(["--model-path", chat_ckpt, "--device", "cpu", "--dtype", "float32",
                         "--max-running-requests", "4", "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S)],
                        tmp_path / "server.log")
    srv.start()
    try:
        srv.wait_ready()
        engine_pid = srv.health()["engine_pid"]
        long = {"prompt": "tick tock", "max_tokens": 4000, "ignore_eos": True}
        short = {"prompt": "tick", "max_tokens": 24, "ignore_eos": True}
        streams = [([], threading.Event()) for _ in range(2)]
        for events, done in streams:
            threading.Thread(target=stream_events, args=(srv.url, long, events, done), daemon=True).start()
        assert wait_for(lambda: all(len(e) > 3 for e, _ in streams), timeout=20), "the streams did not start"
        plain: dict = {}
        plain_thread = threading.Thread(target=lambda: plain.update(r=httpx.post(
            srv.url + "/v1/completions", json=long, timeout=60)), daemon=True)
        plain_thread.start()
        finishing: list = []
        finishing_done = threading.Event()
        threading.Thread(target=stream_events, args=(srv.url, short, finishing, finishing_done), daemon=True).start()
        time.sleep(0.3)

        srv.proc.send_signal(signal.SIGTERM)
        sent_at = time.monotonic()
        refused = wait_for(lambda: (r := httpx.post(srv.url + "/v1/completions", json=short, timeout=5)).status_code
                           == 503 and r, timeout=2)
        assert refused, "new requests were not refused while draining"
        assert refused.json()["error"]["code"] == "server_shutdown" and refused.headers["retry-after"] == "1"
        assert httpx.get(srv.url + "/health", timeout=5).status_code == 503

        # The short stream finishes normally inside the timeout.
        assert finishing_done.wait(SHUTDOWN_TIMEOUT_S + 5)
        assert finishing[-1] == "[DONE]", finishing[-3:]
        assert json.loads(finishing[-2])["choices"][0]["finish_reason"] == "length"
        # The long ones end with the error event once the timeout has passed.
        for events, done in streams:
            assert done.wait(SHUTDOWN_TIMEOUT_S + 10)
            assert not any(isinstance(e, tuple) and e[0] == "broken" for e in events), events[-3:]
            last = json.loads(events[-1])
            assert last["error"]["code"] == "server_shutdown", events[-3:]
        assert time.monotonic() - sent_at >= SHUTDOWN_TIMEOUT_S - 0.5
        plain_thread.join(15)
        assert plain["r"].status_code == 503 and plain["r"].json()["error"]["code"] == "server_shutdown"

        srv.proc.wait(20)
        assert srv.proc.returncode in (0, -signal.SIGTERM)
        assert not pid_alive(engine_pid), "the engine core outlived the server"
        assert "Traceback" not in srv.log(), srv.log()[-3000:]
    finally:
        srv.terminate()
