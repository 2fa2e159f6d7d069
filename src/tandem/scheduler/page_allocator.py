"""Free-list of KV-cache pages. Pure bookkeeping: page ids only, no memory."""

from __future__ import annotations


class OutOfPagesError(RuntimeError):
    """Raised when an allocation asks for more pages than are free."""


class PageAllocator:
    """Hands out page ids 0..num_pages-1.

    Reuse order is LIFO: the pages freed last are handed out first (a fresh
    allocator hands out 0, 1, 2, ...). Pages freed together come back in the
    order they were given, so `free(allocate(n)); allocate(n)` returns the same
    list. The order is deterministic, which keeps tests and runs reproducible.
    """

    def __init__(self, num_pages: int) -> None:
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1 (got {num_pages})")
        self._num_pages = num_pages
        # A stack whose top (the end) is the next page handed out.
        self._free_stack: list[int] = list(range(num_pages - 1, -1, -1))
        self._is_free = [True] * num_pages

    @property
    def num_total(self) -> int:
        return self._num_pages

    @property
    def num_free(self) -> int:
        return len(self._free_stack)

    @property
    def num_used(self) -> int:
        return self._num_pages - len(self._free_stack)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free_stack)

    def allocate(self, n: int) -> list[int]:
        """Take `n` pages; all or nothing (raises OutOfPagesError, state unchanged)."""
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of pages ({n})")
        if n > len(self._free_stack):
            raise OutOfPagesError(f"asked for {n} pages, only {len(self._free_stack)} of {self._num_pages} are free")
        if n == 0:
            return []
        pages = self._free_stack[-n:][::-1]
        del self._free_stack[-n:]
        for p in pages:
            self._is_free[p] = False
        return pages

    def free(self, page_ids: list[int] | tuple[int, ...]) -> None:
        """Return pages to the pool. Raises ValueError on unknown ids or a double free
        (checked for every id before any is freed, so a bad call changes nothing)."""
        seen: set[int] = set()
        for p in page_ids:
            if not isinstance(p, int) or not 0 <= p < self._num_pages:
                raise ValueError(f"unknown page id {p!r} (pool has pages 0..{self._num_pages - 1})")
            if self._is_free[p] or p in seen:
                raise ValueError(f"page {p} freed twice")
            seen.add(p)
        for p in page_ids:
            self._is_free[p] = True
        # Reversed so that the first page of `page_ids` ends on top and is reused first.
        self._free_stack.extend(reversed(page_ids))
