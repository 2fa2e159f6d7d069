"""A tensor-parallel rank that tandem starts on this machine: `python -m tandem.distributed.worker` in a
subprocess (the same entry point a multi-machine launch uses), so the user's script is never imported
again in the rank (a script that builds an `Engine` at module level needs no `__main__` guard). Its
stderr is relayed to ours line by line, and the last lines are kept for the error if it dies.
"""

from __future__ import annotations

import collections
import os
import subprocess
import sys
import threading

import tandem

# What a rank runs (tests substitute a command that fails on purpose).
WORKER_COMMAND = (sys.executable, "-m", "tandem.distributed.worker")
TAIL_LINES = 20


class RankProcess:
    def __init__(self, rank: int, env: dict[str, str]):
        self.rank = rank
        # The rank imports tandem from where this process did, whatever put it on sys.path.
        package_root = os.path.dirname(os.path.dirname(os.path.abspath(tandem.__file__)))
        path = os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p)
        self._proc = subprocess.Popen(list(WORKER_COMMAND), env={**os.environ, **env, "PYTHONPATH": path},
                                      stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, errors="replace")
        self._tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self._relay = threading.Thread(target=self._copy_stderr, name=f"tp-rank{rank}-stderr", daemon=True)
        self._relay.start()

    def _copy_stderr(self) -> None:
        for line in self._proc.stderr:
            self._tail.append(line.rstrip("\n"))
            sys.stderr.write(line)

    @property
    def pid(self) -> int:
        return self._proc.pid

    @property
    def exitcode(self) -> int | None:
        return self._proc.poll()

    def is_alive(self) -> bool:
        return self._proc.poll() is None

    def join(self, timeout: float | None = None) -> None:
        try:
            self._proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def kill(self) -> None:
        self._proc.kill()

    def describe(self) -> str:
        """How it ended, with the last lines it wrote to stderr."""
        self._relay.join(1.0)  # the last lines are still on their way after the exit
        tail = "\n".join(f"    {line}" for line in self._tail)
        return (f"rank {self.rank} (pid {self.pid}) exited with code {self.exitcode}"
                + (f"; its last output:\n{tail}" if tail else ""))
