"""Cache-aware routing for data-parallel replicas: which replica most likely holds a prompt's prefix.

Each replica has its own prefix cache, indexed by full KV pages. The front end keeps, per replica, the
page hashes of the token sequences it has sent there (prompts when routed, prompt + output when they
finish), in least-recently-used order and no more than the replica's page count, so the index forgets
roughly as the replica's cache evicts. The hash of page i chains the hash of page i-1, so a page
matches only under the same whole prefix, as in the engine's own cache.

The rule (`choose`): among the live replicas whose load is within `slack` of the least loaded one,
the one with the longest cached prefix wins; ties, and prompts no replica holds, go by load. Routing a
turn to its history saves a prefill of the history; sending it to a busier replica costs queueing, so
the longest match wins only while the load gap stays small.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


def page_hashes(token_ids: Sequence[int], page_size: int) -> list[int]:
    """The chained hash of each full page of `token_ids`. Python's hash is enough here: a collision can
    only send a request to the wrong replica, never serve wrong KV (the engine's cache confirms tokens)."""
    hashes, parent = [], 0
    for start in range(0, len(token_ids) - page_size + 1, page_size):
        parent = hash((parent, tuple(token_ids[start:start + page_size])))
        hashes.append(parent)
    return hashes


class ReplicaPrefixIndex:
    """Page hashes a replica is believed to hold, least recently used first."""

    def __init__(self, capacity_pages: int):
        self.capacity = max(1, capacity_pages)
        self._pages: OrderedDict[int, None] = OrderedDict()

    def matched_pages(self, hashes: list[int]) -> int:
        n = 0
        for h in hashes:
            if h not in self._pages:
                break
            n += 1
        return n

    def record(self, hashes: list[int]) -> None:
        for h in hashes:
            self._pages[h] = None
            self._pages.move_to_end(h)
        while len(self._pages) > self.capacity:
            self._pages.popitem(last=False)

    def __len__(self) -> int:
        return len(self._pages)


class PrefixRouter:
    def __init__(self, num_replicas: int, page_size: int, capacity_pages: int, slack: int = 2):
        self.page_size = page_size
        self.slack = slack  # in-flight requests a replica may be above the least loaded and still win on its cache
        self.indexes = [ReplicaPrefixIndex(capacity_pages) for _ in range(num_replicas)]

    def hashes(self, prompts: Sequence[Sequence[int]]) -> list[list[int]]:
        return [page_hashes(p, self.page_size) for p in prompts]

    def choose(self, live: list[int], loads: dict[int, int], hashes: list[list[int]]) -> int | None:
        """The replica whose cache should take these prompts, or None to route by load alone."""
        if not hashes or not any(hashes):
            return None
        floor = min(loads[r] for r in live)
        near = [r for r in live if loads[r] <= floor + self.slack]
        matched = {r: sum(self.indexes[r].matched_pages(h) for h in hashes) for r in near}
        best = max(matched.values())
        if best == 0:
            return None
        winners = [r for r in near if matched[r] == best]
        return min(winners, key=lambda r: loads[r])

    def record(self, replica: int, hashes: list[list[int]]) -> None:
        for h in hashes:
            self.indexes[replica].record(h)
