"""CPU-only scheduling: admission, chunked prefill, decode batching, preemption, KV pages.

Nothing in this package imports torch (tests/unit/test_scheduler.py checks it).
"""

from tandem.scheduler.outputs import ScheduledChunk, SchedulerOutput, SchedulerUpdate
from tandem.scheduler.page_allocator import OutOfPagesError, PageAllocator
from tandem.scheduler.scheduler import Scheduler

__all__ = [
    "OutOfPagesError",
    "PageAllocator",
    "ScheduledChunk",
    "Scheduler",
    "SchedulerOutput",
    "SchedulerUpdate",
]
