"""CPU-only scheduling: admission, chunked prefill, decode batching, preemption, KV pages, prefix cache.

Nothing in this package imports torch (tests/unit/test_scheduler.py checks it).
"""

from tandem.scheduler.outputs import NO_DRAFT_KV, ScheduledChunk, SchedulerOutput, SchedulerUpdate
from tandem.scheduler.page_allocator import OutOfPagesError, PageAllocator
from tandem.scheduler.prefix_cache import PrefixCache, PrefixCacheStats
from tandem.scheduler.scheduler import Scheduler

__all__ = [
    "NO_DRAFT_KV",
    "OutOfPagesError",
    "PageAllocator",
    "PrefixCache",
    "PrefixCacheStats",
    "ScheduledChunk",
    "Scheduler",
    "SchedulerOutput",
    "SchedulerUpdate",
]
