"""The front end's engine replicas (data parallelism, `--dp-size N`): one `EngineClient` each, and
the rule that picks the replica of each HTTP request.

Routing (`--load-balance-method cache_aware`, the default with several replicas): a prompt goes to
the replica that most likely holds its longest cached prefix, while that replica's load stays within
a small gap of the least loaded one (server/prefix_routing.py), so the turns of a conversation land
where their history is. Otherwise, and with `shortest_queue`: the live replica with the fewest
in-flight engine requests (sent, not finished or aborted); ties go to the one with fewer prompt tokens still waiting for their first
token, then to the one picked least recently (so a client sending one request at a time alternates
between idle replicas). All engine requests of one HTTP request (its prompts times `n`) go to that
one replica, and the HTTP request keeps its replica: deltas come from it and aborts go to it.

A replica that dies fails its own in-flight requests (503, `engine_unavailable`); the others keep
theirs and keep taking new requests, while `/health` answers 200 with status "degraded" and each
replica's state. Only when no replica is left do `/health` and every new request get 503.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools

from tandem.distributed.data_parallel import replica_envs
from tandem.engine import ipc
from tandem.server.engine_client import EngineClient, EngineDead
from tandem.server.metrics import ReplicaStatus
from tandem.server.prefix_routing import PrefixRouter


LOAD_BALANCE_METHODS = ("cache_aware", "shortest_queue")


class ReplicaSet:
    def __init__(self, clients: list, load_balance_method: str = "cache_aware"):
        """`clients`: one `EngineClient` (or a stand-in with its interface) per replica, in order.
        `load_balance_method`: cache_aware (a prompt goes where its prefix is cached, within a small
        load gap: server/prefix_routing.py) or shortest_queue (load alone)."""
        if not clients:
            raise ValueError("a ReplicaSet needs at least one replica")
        if load_balance_method not in LOAD_BALANCE_METHODS:
            raise ValueError(f"load_balance_method must be one of {LOAD_BALANCE_METHODS} (got {load_balance_method!r})")
        self.replicas = list(clients)
        self.load_balance_method = load_balance_method
        self.router: PrefixRouter | None = None  # made once the replicas say their page size (`start`)
        self.info: ipc.CoreReady | None = None
        self._routed = [0] * len(clients)  # engine requests sent to each, since start
        self._last_pick = [-1] * len(clients)
        self._picks = itertools.count()

    @classmethod
    def spawn(cls, engine_kwargs: dict, log_level: str = "INFO",
              load_balance_method: str = "cache_aware") -> "ReplicaSet":
        """One engine core per replica (`engine_kwargs["dp_size"]`), each a one-replica engine with
        its own devices. Raises ValueError before starting anything if they cannot be laid out."""
        dp_size = engine_kwargs.get("dp_size", 1)
        envs = replica_envs(dp_size, engine_kwargs.get("tp_size", 1), engine_kwargs.get("device"))
        kwargs = {**engine_kwargs, "dp_size": 1}
        names = ["engine core"] if dp_size == 1 else [f"replica {r} engine core" for r in range(dp_size)]
        if engine_kwargs.get("disable_prefix_caching"):
            load_balance_method = "shortest_queue"  # no cache to aim for
        return cls([EngineClient(kwargs, log_level, env, name) for env, name in zip(envs, names)],
                   load_balance_method)

    # ---- lifecycle ----------------------------------------------------------------------------
    def launch(self) -> None:
        for c in self.replicas:
            c.launch()

    async def start(self) -> ipc.CoreReady:
        """Starts every replica (their model loads overlap); raises if any fails to start."""
        infos = await asyncio.gather(*(c.start() for c in self.replicas))
        # Replicas share one configuration; a KV pool sized from free memory may cap one's context
        # lower, and a request must fit whichever replica it lands on.
        self.info = dataclasses.replace(infos[0], max_model_len=min(i.max_model_len for i in infos))
        self.use_page_size(self.info.page_size, min(i.num_pages for i in infos))
        return self.info

    def use_page_size(self, page_size: int, num_pages: int) -> None:
        """Sets up cache-aware routing for replicas of `num_pages` KV pages of `page_size` tokens."""
        if self.load_balance_method == "cache_aware" and len(self.replicas) > 1:
            self.router = PrefixRouter(len(self.replicas), page_size, num_pages)

    async def shutdown(self) -> None:
        await asyncio.gather(*(c.shutdown() for c in self.replicas))

    def kill(self) -> None:
        for c in self.replicas:
            c.kill()

    # ---- state --------------------------------------------------------------------------------
    @property
    def dead_reason(self) -> str | None:
        """Why no request can be served (every replica is gone), or None."""
        if any(c.alive for c in self.replicas):
            return None
        return "; ".join(self._reason(c) for c in self.replicas)

    @property
    def unhealthy_reason(self) -> str | None:
        """Why the deployment is not whole (some replica is gone), or None."""
        dead = [self._reason(c) for c in self.replicas if not c.alive]
        return "; ".join(dead) or None

    @staticmethod
    def _reason(client) -> str:
        return client.dead_reason or f"{client.name} is not running"

    @property
    def num_queued(self) -> int:
        return sum(c.num_queued for c in self.replicas)

    @property
    def pids(self) -> list[int | None]:
        return [c.process.pid for c in self.replicas]

    def states(self) -> list[dict]:
        """Each replica's state for `/health`: serving, or dead with the reason."""
        out = []
        for r, c in enumerate(self.replicas):
            state = {"replica": r, "state": "serving" if c.alive else "dead", "pid": c.process.pid,
                     "queued_requests": c.num_queued}
            if not c.alive:
                state["reason"] = self._reason(c)
            out.append(state)
        return out

    def statuses(self) -> list[ReplicaStatus]:
        return [ReplicaStatus(r, c.alive, c.stats, c.num_in_flight, self._routed[r])
                for r, c in enumerate(self.replicas)]

    # ---- routing ------------------------------------------------------------------------------
    def pick(self, num_requests: int, prompts: list[list[int]] | None = None) -> EngineClient:
        """The replica for an HTTP request of `num_requests` engine requests over `prompts` (see the
        module doc); raises EngineDead if none is alive."""
        live = [r for r, c in enumerate(self.replicas) if c.alive]
        if not live:
            raise EngineDead(self.dead_reason)

        def load(r: int) -> tuple:
            c = self.replicas[r]
            return c.num_in_flight, c.queued_tokens, self._last_pick[r]

        hashes = self.router.hashes(prompts) if self.router is not None and prompts else []
        r = None
        if hashes:
            r = self.router.choose(live, {i: self.replicas[i].num_in_flight for i in live}, hashes)
        if r is None:
            r = min(live, key=load)
        if hashes:
            self.router.record(r, hashes)
        self._last_pick[r] = next(self._picks)
        self._routed[r] += num_requests
        return self.replicas[r]

    def remember(self, client, token_ids: list[list[int]]) -> None:
        """Notes sequences (prompt + output) whose pages `client` now holds in its cache."""
        if self.router is not None and client in self.replicas:
            self.router.record(self.replicas.index(client), self.router.hashes(token_ids))
