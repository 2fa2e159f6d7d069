"""The KV page pool with a prefix cache: full pages stay indexed by their content after their request ends.

One record per page: a reference count (requests holding it), and once indexed the page's key, its
tokens, and the token after the page that a draft model's KV in it was made with (None: the page holds
no usable draft KV). The key chains a page to everything before it (its parent page's key and its own
tokens), so equal keys mean equal prefixes; a hit is still confirmed by comparing the page's tokens.
With a draft model, pages of one prefix can differ in their last draft entry (it pairs the page's last
position with the next token), so a key may hold one page per next token. Pages nobody references but
that are indexed wait in a least-recently-released queue and are evicted (unindexed, handed out as fresh
pages) only when the free list is short. Pure bookkeeping: page ids, no memory.

A hash chain (vLLM's automatic prefix caching) rather than a radix tree (SGLang's RadixAttention):
docs/architecture.md says why.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from tandem.scheduler.page_allocator import OutOfPagesError, PageAllocator


def page_hash(parent: bytes | None, tokens: Sequence[int]) -> bytes:
    """The content key of a full page: its parent page's key and its content (16 bytes of blake2b, so two
    different prefixes never share a key in practice, unlike Python's `hash`, which a prompt can collide)."""
    h = hashlib.blake2b(parent or b"", digest_size=16)
    h.update(array("q", tokens).tobytes())
    return h.digest()


@dataclass
class PrefixCacheStats:
    """Counted in prompt tokens, over requests' first admissions (a recompute after preemption is not a query)."""

    queries: int = 0  # prompt tokens of admitted requests
    hits: int = 0  # of those, tokens whose KV came from the cache
    cached_pages: int = 0  # cached pages no request holds (filled in by Engine.prefix_cache_stats)


@dataclass
class _Page:
    refs: int = 0
    key: bytes | None = None  # set while the page is indexed
    tokens: tuple[int, ...] = ()
    next_token: int | None = None  # the token its draft KV's last entry was made with (None: no draft KV)


class PrefixCache:
    """Hands out pages like a PageAllocator; pages indexed by `insert` outlive their holders."""

    def __init__(self, num_pages: int) -> None:
        self._free = PageAllocator(num_pages)  # pages with no content worth keeping
        self._pages = [_Page() for _ in range(num_pages)]
        self._by_key: dict[bytes, dict[int | None, int]] = {}  # key -> {next_token: page}
        # Indexed pages nobody holds, oldest release first: the eviction order.
        self._unreferenced: OrderedDict[int, None] = OrderedDict()

    # ---- counts ----------------------------------------------------------------------------------
    @property
    def num_total(self) -> int:
        return self._free.num_total

    @property
    def num_free(self) -> int:
        """Pages holding nothing (cached pages not included)."""
        return self._free.num_free

    @property
    def num_cached(self) -> int:
        """Indexed pages no request holds: evictable."""
        return len(self._unreferenced)

    @property
    def num_used(self) -> int:
        """Pages some request holds (a shared page counts once)."""
        return self.num_total - self.num_free - self.num_cached

    @property
    def num_indexed(self) -> int:
        return sum(len(pages) for pages in self._by_key.values())

    def refs(self, page: int) -> int:
        return self._pages[page].refs

    def key_of(self, page: int) -> bytes | None:
        return self._pages[page].key

    # ---- allocation ------------------------------------------------------------------------------
    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free + self.num_cached

    def allocate(self, n: int) -> list[int]:
        """`n` fresh pages, each held once; evicts cached pages (oldest release first) when the free list
        is short. All or nothing."""
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of pages ({n})")
        if not self.can_allocate(n):
            raise OutOfPagesError(f"asked for {n} pages, only {self.num_free} free and {self.num_cached} "
                                  f"cached of {self.num_total}")
        short = n - self.num_free
        if short > 0:
            evicted = [self._unreferenced.popitem(last=False)[0] for _ in range(short)]
            for p in evicted:
                self._unindex(p)
            self._free.free(evicted)
        pages = self._free.allocate(n)
        for p in pages:
            self._pages[p].refs = 1
        return pages

    def free(self, page_ids: Sequence[int]) -> None:
        """Drops one reference to each page. A page nobody holds goes to the cache if it is indexed
        (the request's last page first in the eviction order: the deepest prefix is the least shared),
        else to the free list. Unknown ids or a page freed more often than held: ValueError, nothing changed."""
        counts: dict[int, int] = {}
        for p in page_ids:
            if not isinstance(p, int) or not 0 <= p < self.num_total:
                raise ValueError(f"unknown page id {p!r} (pool has pages 0..{self.num_total - 1})")
            counts[p] = counts.get(p, 0) + 1
            if counts[p] > self._pages[p].refs:
                raise ValueError(f"page {p} freed twice")
        released = []
        for p in page_ids:
            rec = self._pages[p]
            rec.refs -= 1
            if rec.refs == 0:
                released.append(p)
        for p in reversed(released):
            if self._pages[p].key is not None:
                self._unreferenced[p] = None
        self._free.free([p for p in released if self._pages[p].key is None])

    # ---- the cache -------------------------------------------------------------------------------
    def match(self, keys: Sequence[bytes], token_ids: Sequence[int], page_size: int) -> tuple[list[int], int]:
        """The indexed pages holding the longest prefix (page i: key keys[i] and the tokens
        token_ids[i * page_size : (i + 1) * page_size]), and how many of them, from the first, hold draft KV
        made with the same next token as token_ids has (a page with it is preferred). Looks only: nothing
        is held or reordered."""
        pages, with_draft = [], 0
        for i, key in enumerate(keys):
            candidates = self._by_key.get(key)
            if not candidates:
                break
            end = (i + 1) * page_size
            nxt = token_ids[end] if end < len(token_ids) else None
            p = candidates.get(nxt) if nxt is not None and nxt in candidates else next(iter(candidates.values()))
            if self._pages[p].tokens != tuple(token_ids[i * page_size:end]):
                break
            if with_draft == i and nxt is not None and self._pages[p].next_token == nxt:
                with_draft += 1
            pages.append(p)
        return pages, with_draft

    def num_unheld(self, pages: Sequence[int]) -> int:
        """How many of these pages are cached and held by nobody (holding them takes them out of the
        pages `allocate` may evict)."""
        return sum(1 for p in pages if self._pages[p].refs == 0)

    def hold(self, pages: Sequence[int]) -> None:
        """One more reference to each page (a cache hit); held pages are never evicted."""
        for p in pages:
            rec = self._pages[p]
            if rec.key is None and rec.refs == 0:
                raise ValueError(f"page {p} is neither held nor cached")
            if rec.refs == 0:
                del self._unreferenced[p]
            rec.refs += 1

    def insert(self, page: int, key: bytes, tokens: Sequence[int], next_token: int | None = None) -> bool:
        """Indexes a held, full page whose KV is computed. `next_token`: the token after the page that the
        draft KV in it was made with (None: no draft KV, or no draft model). False (nothing indexed) when
        another page already holds that content: the copy stays private and returns to the free list when
        released."""
        rec = self._pages[page]
        if rec.refs == 0:
            raise ValueError(f"page {page} is not held: only a request's own computed page can be indexed")
        if rec.key is not None:
            return rec.key == key
        candidates = self._by_key.setdefault(key, {})
        if next_token in candidates:
            return False
        rec.key, rec.tokens, rec.next_token = key, tuple(tokens), next_token
        candidates[next_token] = page
        return True

    def flush(self) -> bool:
        """Drops every cached page nobody holds (their content is forgotten). True when no page is held
        either, so every page is free now; held pages stay indexed."""
        pages = list(self._unreferenced)
        self._unreferenced.clear()
        for p in pages:
            self._unindex(p)
        self._free.free(pages)
        return self.num_used == 0

    def _unindex(self, page: int) -> None:
        rec = self._pages[page]
        candidates = self._by_key[rec.key]
        del candidates[rec.next_token]
        if not candidates:
            del self._by_key[rec.key]
        rec.key, rec.tokens, rec.next_token = None, (), None
