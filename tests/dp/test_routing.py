"""Data parallelism without engines: the routing rule of `ReplicaSet`, each replica's devices, and
the offline Engine's refusal. Fast (no model, no process)."""

from __future__ import annotations

import asyncio
import os
from types import SimpleNamespace

import pytest

from tandem.distributed import data_parallel
from tandem.distributed.data_parallel import apply_env, replica_envs, replica_gpus
from tandem.server.engine_client import EngineDead
from tandem.server.replicas import ReplicaSet


class FakeReplica:
    """The parts of `EngineClient` that routing reads."""

    def __init__(self, name: str):
        self.name = name
        self.alive = True
        self.dead_reason = None
        self.num_in_flight = 0
        self.queued_tokens = 0
        self.num_queued = 0
        self.stats = None
        self.process = SimpleNamespace(pid=None)


def replica_set(n: int) -> tuple[ReplicaSet, list[FakeReplica]]:
    fakes = [FakeReplica(f"replica {r} engine core") for r in range(n)]
    return ReplicaSet(fakes), fakes


def send(rs: ReplicaSet, fakes: list[FakeReplica], num_requests: int = 1, prompt_len: int = 10) -> int:
    """Routes one HTTP request and books it on the chosen fake as EngineClient.add would."""
    c = rs.pick(num_requests)
    c.num_in_flight += num_requests
    c.queued_tokens += num_requests * prompt_len
    return fakes.index(c)


def test_fewest_in_flight_wins():
    rs, fakes = replica_set(3)
    fakes[0].num_in_flight, fakes[1].num_in_flight, fakes[2].num_in_flight = 5, 2, 4
    assert send(rs, fakes) == 1
    assert fakes[1].num_in_flight == 3
    assert send(rs, fakes) == 1  # 3 in flight < 4
    assert send(rs, fakes) == 2  # 4 and 4 in flight: replica 2 has fewer prompt tokens queued (0 < 20)
    assert [s.routed for s in rs.statuses()] == [0, 2, 1]


def test_ties_go_to_fewer_queued_tokens_then_least_recently_picked():
    rs, fakes = replica_set(2)
    fakes[0].queued_tokens = 100
    assert rs.pick(1) is fakes[1]
    # nothing booked: still tied on in-flight requests, replica 1 has fewer queued tokens
    assert rs.pick(1) is fakes[1]
    fakes[0].queued_tokens = 0
    # all tied: the least recently picked (replica 0 was never picked)
    assert rs.pick(1) is fakes[0]
    # a client sending one request at a time (each done before the next) alternates
    assert [fakes.index(rs.pick(1)) for _ in range(4)] == [1, 0, 1, 0]


def test_a_group_stays_on_one_replica_and_counts_as_its_size():
    rs, fakes = replica_set(2)
    assert send(rs, fakes, num_requests=6) == 0  # e.g. 2 prompts x n=3
    assert [s.routed for s in rs.statuses()] == [6, 0]
    assert [send(rs, fakes) for _ in range(3)] == [1, 1, 1]  # until replica 1 has as many in flight
    assert [s.in_flight for s in rs.statuses()] == [6, 3]


def test_dead_replica_is_skipped_and_all_dead_raises():
    rs, fakes = replica_set(2)
    assert rs.unhealthy_reason is None and rs.dead_reason is None
    fakes[0].alive = False
    fakes[0].dead_reason = "replica 0 engine core process exited (exit code -9)"
    assert [send(rs, fakes) for _ in range(3)] == [1, 1, 1]  # even though replica 0 looks idle
    assert rs.unhealthy_reason == fakes[0].dead_reason
    assert rs.dead_reason is None  # replica 1 still serves
    fakes[1].alive = False  # died, watchdog has not written a reason yet
    assert rs.dead_reason == f"{fakes[0].dead_reason}; replica 1 engine core is not running"
    with pytest.raises(EngineDead, match="exit code -9"):
        rs.pick(1)


def test_start_takes_the_smallest_context_of_all_replicas():
    from tandem.engine import ipc

    class Starting(FakeReplica):
        def __init__(self, name, max_model_len):
            super().__init__(name)
            self.info = ipc.CoreReady(pid=1, model_path="/m", max_model_len=max_model_len, vocab_size=10,
                                      page_size=4, num_pages=8, speculative_algorithm=None)

        async def start(self):
            return self.info

    rs = ReplicaSet([Starting("a", 4096), Starting("b", 3000)])
    assert asyncio.run(rs.start()).max_model_len == 3000


# ---- devices ----------------------------------------------------------------------------------------


def test_replica_r_gets_gpus_r_times_t_onwards():
    gpus = [str(i) for i in range(8)]
    assert replica_gpus(2, 1, gpus) == [["0"], ["1"]]
    assert replica_gpus(2, 2, gpus) == [["0", "1"], ["2", "3"]]
    assert replica_gpus(4, 2, gpus) == [["0", "1"], ["2", "3"], ["4", "5"], ["6", "7"]]
    # whatever the parent may use (CUDA_VISIBLE_DEVICES), in its order
    assert replica_gpus(2, 1, ["5", "3", "7"]) == [["5"], ["3"]]
    with pytest.raises(ValueError, match="needs 6 GPUs, found 4"):
        replica_gpus(3, 2, gpus[:4])


def test_replica_envs_on_gpus(monkeypatch):
    monkeypatch.setattr(data_parallel, "uses_cuda", lambda device: True)
    monkeypatch.setattr(data_parallel, "visible_gpus", lambda: ["4", "5", "6", "7"])
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    envs = replica_envs(2, 2, "cuda")
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["4,5", "6,7"]
    assert all(e["MASTER_PORT"] is None for e in envs)  # each TP group picks its own port
    assert replica_envs(1, 4, "cuda") == [{}]  # one replica: nothing changes
    with pytest.raises(ValueError, match="needs 6 GPUs, found 4"):
        replica_envs(3, 2, None)
    with pytest.raises(ValueError, match="cuda:1"):
        replica_envs(2, 1, "cuda:1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="WORLD_SIZE"):
        replica_envs(2, 2, "cuda")


def test_visible_gpus_follow_cuda_visible_devices(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3, 1,9")  # 9 does not exist: CUDA stops before it
    assert data_parallel.visible_gpus() == ["3", "1"]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert data_parallel.visible_gpus() == ["0", "1"]


def test_replica_envs_on_cpu_split_the_threads(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(data_parallel.os, "cpu_count", lambda: 16)
    assert [e["OMP_NUM_THREADS"] for e in replica_envs(2, 1, "cpu")] == ["8", "8"]
    assert [e["OMP_NUM_THREADS"] for e in replica_envs(4, 2, "cpu")] == ["2"] * 4
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # the user's choice stands
    assert replica_envs(2, 1, "cpu") == [{"MASTER_PORT": None}] * 2
    with pytest.raises(ValueError, match="dp_size must be >= 1"):
        replica_envs(0, 1, "cpu")


def test_apply_env_sets_and_unsets(monkeypatch):
    import torch

    for name in ("MASTER_PORT", "CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS"):
        monkeypatch.setenv(name, "1")  # monkeypatch puts the originals back afterwards
    threads = torch.get_num_threads()
    try:
        apply_env({"MASTER_PORT": None, "CUDA_VISIBLE_DEVICES": "6,7", "OMP_NUM_THREADS": "2"})
        assert "MASTER_PORT" not in os.environ and os.environ["CUDA_VISIBLE_DEVICES"] == "6,7"
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)


# ---- where dp_size is refused -----------------------------------------------------------------------


def test_offline_engine_refuses_dp_and_names_the_server():
    from tandem import Engine

    with pytest.raises(ValueError, match="tandem serve --dp-size"):
        Engine(dp_size=2, device="cpu")


def test_cli_reports_an_impossible_layout_before_starting_anything(capsys):
    from tandem.cli import main

    assert main(["serve", "--model-path", "demo", "--dp-size", "1000", "--device", "cuda", "--port", "0"]) == 2
    assert "needs 1000 GPUs" in capsys.readouterr().err
    assert main(["generate", "--model-path", "demo", "--dp-size", "2", "--device", "cpu"]) == 2
    assert "tandem serve --dp-size" in capsys.readouterr().err


# ---- cache-aware routing --------------------------------------------------------------------------

from tandem.server.prefix_routing import PrefixRouter, ReplicaPrefixIndex, page_hashes  # noqa: E402

PAGE = 4


def cache_aware_set(n: int, capacity_pages: int = 1000) -> tuple[ReplicaSet, list[FakeReplica]]:
    fakes = [FakeReplica(f"replica {r} engine core") for r in range(n)]
    rs = ReplicaSet(fakes, "cache_aware")
    rs.use_page_size(PAGE, capacity_pages)
    return rs, fakes


def test_page_hashes_chain_over_the_whole_prefix():
    a = page_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], PAGE)
    assert len(a) == 2  # the partial third page is not a page
    assert page_hashes([1, 2, 3, 4, 5, 6, 7, 8], PAGE) == a
    # The same second page under another first page is another page.
    b = page_hashes([9, 9, 9, 9, 5, 6, 7, 8], PAGE)
    assert b[1] != a[1]


def test_a_conversation_follows_its_history_within_the_load_gap():
    rs, fakes = cache_aware_set(2)
    history = list(range(100, 124))  # six pages
    first = fakes.index(rs.pick(1, [history]))
    other = 1 - first
    # The next turn extends the history: it goes back although the other replica is idle, and while
    # its replica runs up to `slack` (2) more requests than the other.
    fakes[first].num_in_flight = 2
    turn2 = history + [7, 8, 9, 10, 11]
    assert fakes.index(rs.pick(1, [turn2])) == first
    # Three more than the other: the gap is too large, load decides.
    fakes[first].num_in_flight = 3
    assert fakes.index(rs.pick(1, [turn2])) == other
    # A prompt nobody holds goes by load (the idle replica), and is then remembered there.
    fakes[first].num_in_flight = 0
    fakes[other].num_in_flight = 1
    fresh = list(range(500, 512))
    assert fakes.index(rs.pick(1, [fresh])) == first


def test_finished_outputs_are_remembered_where_they_ran():
    rs, fakes = cache_aware_set(2)
    prompt, answer = list(range(10, 18)), list(range(60, 68))
    where = rs.pick(1, [prompt])
    rs.remember(where, [prompt + answer])
    fakes[fakes.index(where)].num_in_flight = 1  # busier, but within the gap
    assert rs.pick(1, [prompt + answer + [1, 2, 3, 4]]) is where


def test_the_index_forgets_least_recently_used_pages_first():
    index = ReplicaPrefixIndex(capacity_pages=3)
    old, new = page_hashes(list(range(8)), PAGE), page_hashes(list(range(50, 58)), PAGE)
    index.record(old)
    index.record(new)  # four pages recorded, three kept: the oldest page of `old` went first
    assert len(index) == 3 and index.matched_pages(old) == 0 and index.matched_pages(new) == 2


def test_shortest_queue_ignores_prefixes():
    fakes = [FakeReplica(f"replica {r} engine core") for r in range(2)]
    rs = ReplicaSet(fakes, "shortest_queue")
    rs.use_page_size(PAGE, 100)
    history = list(range(100, 124))
    first = rs.pick(1, [history])
    first.num_in_flight = 1
    assert rs.pick(1, [history]) is not first
    with pytest.raises(ValueError, match="load_balance_method"):
        ReplicaSet(fakes, "random")


def test_router_choice_prefers_the_longest_match_among_near_loads():
    router = PrefixRouter(3, PAGE, 100, slack=1)
    long_prompt = list(range(40))
    router.record(0, router.hashes([long_prompt[:8]]))
    router.record(1, router.hashes([long_prompt[:32]]))
    router.record(2, router.hashes([long_prompt]))
    hashes = router.hashes([long_prompt])
    assert router.choose([0, 1, 2], {0: 0, 1: 1, 2: 5}, hashes) == 1  # 2 holds more but is 5 behind
    assert router.choose([0, 1, 2], {0: 0, 1: 0, 2: 1}, hashes) == 2
    assert router.choose([0, 1], {0: 0, 1: 0}, router.hashes([[7] * 12])) is None  # nobody holds it
