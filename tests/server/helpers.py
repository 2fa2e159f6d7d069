"""Helpers for the server tests: a tiny chat checkpoint, a `tandem serve` subprocess, /metrics parsing."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time

import httpx

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
# Tool definitions render as JSON lines, an assistant's tool calls as Hermes <tool_call> blocks. (A newline
# right after a block tag is trimmed by the templates' trim_blocks: it is written as an expression.)
CHAT_TEMPLATE = ("{% if tools %}<|tools|>{% for t in tools %}{{ t | tojson }}\n{% endfor %}{% endif %}"
                 "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
                 "{% for c in m.get('tool_calls', []) %}<tool_call>{{ c['function'] | tojson }}</tool_call>{% endfor %}"
                 "{{ '\\n' }}{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")
STARTUP_TIMEOUT_S = 120


def make_chat_checkpoint(path: str, max_position_embeddings: int = 1024, seed: int = 0) -> None:
    """A tiny random Llama with a real (byte-level) tokenizer and a chat template."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tandem.demo import byte_level_tokenizer
    from tests.models.tiny_checkpoints import INIT_RANGE

    tok = byte_level_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    config = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, initializer_range=INIT_RANGE,
                         max_position_embeddings=max_position_embeddings, bos_token_id=0, eos_token_id=1,
                         pad_token_id=2)
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`python -m tandem serve ...` on a free loopback port."""

    def __init__(self, args: list[str], log_path):
        self.port = free_port()
        self.args = ["--port", str(self.port), *args]
        self.log_path = str(log_path)
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.engine_pid: int | None = None

    def start(self) -> None:
        env = {**os.environ, "PYTHONPATH": os.path.join(REPO, "src") + os.pathsep + os.environ.get("PYTHONPATH", ""),
               "OMP_NUM_THREADS": "1"}  # two servers and the test share the CPU cores
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "tandem", "serve", *self.args], cwd=REPO, env=env,
                                     stdout=self._log, stderr=subprocess.STDOUT)

    def log(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()[-4000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"server not ready after {STARTUP_TIMEOUT_S}s:\n{self.log()[-4000:]}")

    def health(self) -> dict:
        """The full /health answer (with the server's API key, if it has one)."""
        key = self.args[self.args.index("--api-key") + 1] if "--api-key" in self.args else None
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.get(self.url + "/health", headers=headers, timeout=5).json()

    def sigterm_and_check(self, timeout: float = 20) -> None:
        """SIGTERM must stop the server and its engine core (no orphan)."""
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout)
        # uvicorn re-raises the captured SIGTERM after its graceful shutdown
        assert self.proc.returncode in (0, -signal.SIGTERM), self.log()[-4000:]
        if self.engine_pid is not None:
            assert not pid_alive(self.engine_pid), f"engine core {self.engine_pid} outlived the server"

    def terminate(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc is not None:
            self._log.close()


def pid_alive(pid: int) -> bool:
    """True if `pid` runs (a zombie, dead but not yet reaped, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*(?:\{[^}]*\})?) (\S+)$")


def scrape(url: str, api_key: str | None = None) -> dict[str, float]:
    """/metrics as {'name{labels}': value}."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    r = httpx.get(url + "/metrics", headers=headers, timeout=5)
    r.raise_for_status()
    return parse_metrics(r.text)


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text as {'name{labels}': value} (labels as the exporter wrote them)."""
    out = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def wait_for(predicate, timeout: float = 15, interval: float = 0.1):
    """Polls until predicate() returns something truthy; returns it (or the last value on timeout)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval)


@contextlib.contextmanager
def started_together(servers: dict[str, ServerProcess]):
    """Starts every server at once, so their model loads overlap (each test then waits only for
    the one it uses), and terminates them all at the end."""
    for s in servers.values():
        s.start()
    try:
        yield servers
    finally:
        for s in servers.values():
            s.terminate()
