import pytest

from tandem.scheduler import OutOfPagesError, PageAllocator


def test_fresh_allocator_hands_out_pages_in_order():
    a = PageAllocator(8)
    assert (a.num_total, a.num_free, a.num_used) == (8, 8, 0)
    assert a.allocate(3) == [0, 1, 2]
    assert a.allocate(2) == [3, 4]
    assert (a.num_free, a.num_used) == (3, 5)


def test_allocate_zero_is_empty():
    a = PageAllocator(2)
    assert a.allocate(0) == []
    assert a.num_free == 2


def test_freed_pages_are_reused_lifo_in_their_order():
    a = PageAllocator(8)
    first = a.allocate(3)
    second = a.allocate(2)
    a.free(first)
    a.free(second)
    assert a.allocate(2) == second  # freed last, reused first
    assert a.allocate(3) == first
    assert a.allocate(3) == [5, 6, 7]


def test_out_of_pages_is_all_or_nothing():
    a = PageAllocator(4)
    a.allocate(3)
    assert not a.can_allocate(2)
    with pytest.raises(OutOfPagesError):
        a.allocate(2)
    assert a.num_free == 1  # nothing was taken
    assert a.allocate(1) == [3]
    with pytest.raises(OutOfPagesError):
        a.allocate(1)


def test_double_free_and_unknown_ids_raise_without_changing_state():
    a = PageAllocator(4)
    pages = a.allocate(2)
    a.free(pages)
    with pytest.raises(ValueError, match="twice"):
        a.free([pages[0]])
    with pytest.raises(ValueError, match="unknown"):
        a.free([4])
    with pytest.raises(ValueError, match="unknown"):
        a.free([-1])
    b = a.allocate(2)
    with pytest.raises(ValueError, match="twice"):
        a.free([b[0], b[0]])  # duplicate within one call
    with pytest.raises(ValueError, match="twice"):
        a.free([b[0], 3])  # 3 is free: rejected before b[0] is freed
    assert a.num_free == 2
    a.free(b)
    assert a.num_free == 4


def test_invalid_sizes():
    with pytest.raises(ValueError):
        PageAllocator(0)
    with pytest.raises(ValueError):
        PageAllocator(2).allocate(-1)
