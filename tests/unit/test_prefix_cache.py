"""The page pool's prefix cache alone (scheduler/prefix_cache.py): hand-made cases, page ids only."""

import pytest

from tandem.scheduler import OutOfPagesError, PrefixCache
from tandem.scheduler.prefix_cache import page_hash

PS = 4


def keys_of(tokens: list[int]) -> list[bytes]:
    keys, parent = [], None
    for i in range(len(tokens) // PS):
        parent = page_hash(parent, tokens[i * PS:(i + 1) * PS])
        keys.append(parent)
    return keys


def match(cache: PrefixCache, keys, tokens) -> list[int]:
    return cache.match(keys, tokens, PS)[0]


def cache_sequence(cache: PrefixCache, tokens: list[int]) -> list[int]:
    """Allocates pages for `tokens`, indexes every full one, and releases them (a finished request)."""
    pages = cache.allocate(len(tokens) // PS)
    for page, key, i in zip(pages, keys_of(tokens), range(len(pages))):
        assert cache.insert(page, key, tokens[i * PS:(i + 1) * PS])
    cache.free(pages)
    return pages


def test_match_walks_full_pages_until_the_first_miss():
    cache = PrefixCache(8)
    seq = list(range(100, 112))
    pages = cache_sequence(cache, seq)
    assert (cache.num_free, cache.num_cached, cache.num_used) == (5, 3, 0)
    assert match(cache, keys_of(seq), seq) == pages
    other = seq[:6] + [0] + seq[7:]  # differs in page 1: only page 0 matches
    assert match(cache, keys_of(other), other) == pages[:1]
    assert match(cache, keys_of([1] + seq[1:]), [1] + seq[1:]) == []
    # A page depends on everything before it: page 1's tokens after a different page 0 are no hit.
    shifted = [7, 7, 7, 7] + seq[4:]
    assert match(cache, keys_of(shifted), shifted) == []


def test_a_hit_is_confirmed_by_the_tokens_not_the_key():
    cache = PrefixCache(4)
    seq = [1, 2, 3, 4]
    cache_sequence(cache, seq)
    # The right key with other tokens (what a hash collision would look like) is no hit.
    assert match(cache, keys_of(seq), [1, 2, 3, 5]) == []
    assert match(cache, keys_of(seq), seq) != []


def test_hold_and_free_count_references():
    cache = PrefixCache(8)
    seq = list(range(12))
    pages = cache_sequence(cache, seq)
    hit = match(cache, keys_of(seq), seq)
    assert cache.num_unheld(hit) == 3
    cache.hold(hit)
    cache.hold(hit[:1])  # a second request sharing page 0
    assert [cache.refs(p) for p in pages] == [2, 1, 1]
    assert (cache.num_cached, cache.num_used) == (0, 3)
    assert cache.num_unheld(hit) == 0
    cache.free(hit)
    assert [cache.refs(p) for p in pages] == [1, 0, 0] and cache.num_cached == 2
    with pytest.raises(ValueError, match="twice"):
        cache.free([pages[1]])  # cached, held by nobody
    with pytest.raises(ValueError, match="twice"):
        cache.free([pages[0], pages[0]])  # held once
    cache.free([pages[0]])
    assert cache.num_free + cache.num_cached == cache.num_total
    with pytest.raises(ValueError, match="neither held nor cached"):
        cache.hold([7])


def test_eviction_takes_the_least_recently_released_page_and_a_request_tail_first():
    cache = PrefixCache(6)
    a = list(range(12))
    b = list(range(50, 58))
    a_pages = cache_sequence(cache, a)  # released: a2, a1, a0 (the deepest page first)
    b_pages = cache_sequence(cache, b)
    assert cache.num_free == 1
    got = cache.allocate(3)  # the free page, then a's last two pages
    assert set(got) == {5, a_pages[2], a_pages[1]}
    assert match(cache, keys_of(a), a) == a_pages[:1]
    assert match(cache, keys_of(b), b) == b_pages
    assert [cache.refs(p) for p in got] == [1, 1, 1]
    # A hit refreshes its pages: released again now, b's pages go before a0.
    cache.hold(a_pages[:1])
    cache.free(a_pages[:1])
    more = cache.allocate(2)
    assert set(more) == set(b_pages)
    assert match(cache, keys_of(a), a) == a_pages[:1]


def test_held_pages_are_never_evicted():
    cache = PrefixCache(4)
    seq = list(range(12))
    pages = cache_sequence(cache, seq)
    cache.hold(pages)
    assert not cache.can_allocate(2)
    with pytest.raises(OutOfPagesError):
        cache.allocate(2)
    assert cache.allocate(1) == [3]
    assert [cache.refs(p) for p in pages] == [1, 1, 1]
    assert match(cache, keys_of(seq), seq) == pages


def test_a_duplicate_page_stays_private_and_returns_to_the_free_list():
    cache = PrefixCache(4)
    seq = [1, 2, 3, 4]
    first = cache_sequence(cache, seq)
    copy = cache.allocate(1)
    assert not cache.insert(copy[0], keys_of(seq)[0], seq)  # the content is indexed already
    cache.free(copy)
    assert cache.num_cached == 1 and cache.num_free == 3
    assert match(cache, keys_of(seq), seq) == first


def test_only_a_held_page_can_be_indexed():
    cache = PrefixCache(2)
    with pytest.raises(ValueError, match="not held"):
        cache.insert(0, keys_of([1, 2, 3, 4])[0], [1, 2, 3, 4])


def test_flush_drops_unheld_pages_and_says_whether_any_are_held():
    cache = PrefixCache(8)
    a, b = list(range(8)), list(range(20, 28))
    a_pages = cache_sequence(cache, a)
    cache_sequence(cache, b)
    cache.hold(a_pages)
    assert not cache.flush()  # a's pages are held: they stay
    assert cache.num_cached == 0 and cache.num_free == 6
    assert match(cache, keys_of(b), b) == []
    assert match(cache, keys_of(a), a) == a_pages
    cache.free(a_pages)
    assert cache.num_cached == 2
    assert cache.flush()
    assert cache.num_free == cache.num_total and cache.num_indexed == 0
    assert match(cache, keys_of(a), a) == []


def test_pages_of_one_prefix_with_different_next_tokens_are_kept_apart():
    """With a draft model a page's last draft entry depends on the token after it: one key holds a page per
    next token, and a match prefers the page made with the request's own next token, counting how many
    leading pages hold draft KV for it."""
    cache = PrefixCache(8)
    seq = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    keys = keys_of(seq[:8])
    a = cache.allocate(2)
    assert cache.insert(a[0], keys[0], seq[:4], next_token=5) and cache.insert(a[1], keys[1], seq[4:8], next_token=9)
    b = cache.allocate(1)
    assert cache.insert(b[0], keys[1], seq[4:8], next_token=0)  # same tokens, another next token
    assert not cache.insert(cache.allocate(1)[0], keys[1], seq[4:8], next_token=0)  # that one is taken
    t = cache.allocate(1)
    assert cache.insert(t[0], keys[1], seq[4:8])  # no draft KV (a dormant request's)
    assert cache.match(keys, seq, PS) == (a, 2)
    assert cache.match(keys, seq[:8] + [0], PS) == ([a[0], b[0]], 2)
    assert cache.match(keys, seq[:8] + [4], PS) == ([a[0], a[1]], 1)  # no page made with 4: target only
    assert cache.match(keys, seq[:8], PS)[1] == 1  # the token after page 1 is unknown
    assert cache.num_indexed == 4
