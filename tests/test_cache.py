"""CacheManager on its own: prefix sharing, LRU eviction, and the page invariant under a random
sequence of admissions, growth, publication and releases."""

from __future__ import annotations

import random

from arle.engine.cache import CacheManager, RequestCache


def test_shared_prefix_is_matched_locked_and_evicted_lru() -> None:
    cm = CacheManager(num_pages=8, page_size=4, num_slots=4)
    a_tokens = list(range(12)) + [99]  # 3 full pages + 1
    a = cm.admit(a_tokens, len(a_tokens) + 1)
    assert a is not None and len(a.pages) == 4 and not a.shared
    cm.publish(a, a_tokens, len(a_tokens))
    assert len(a.shared) == 3  # the partial last page stays private
    b_tokens = list(range(8)) + [50, 51, 52, 53, 54]
    b = cm.admit(b_tokens, len(b_tokens) + 1)
    assert b is not None and b.pages[:2] == a.pages[:2]  # shared read-only
    assert cm.radix.num_evictable == 0
    cm.check([a, b])
    cm.release(a, a_tokens, len(a_tokens))
    assert cm.radix.num_evictable == 1  # page 3 of a; pages 1-2 still locked by b
    cm.release(b, b_tokens, len(b_tokens))
    cm.check([])
    assert cm.num_available == cm.num_pages
    # the oldest unreferenced leaf goes first; a fresh request can take every page
    c = cm.admit(list(range(100, 131)), 32)
    assert c is not None and len(c.pages) == 8
    cm.check([c])


def test_admission_refuses_what_does_not_fit() -> None:
    cm = CacheManager(num_pages=4, page_size=4, num_slots=2)
    a = cm.admit(list(range(10)), 11)
    assert a is not None and len(a.pages) == 3
    assert cm.admit(list(range(20, 30)), 11) is None  # needs 3, 1 left
    assert cm.admit([1, 2], 3, headroom_pages=1) is None  # fits only without the headroom
    cm.check([a])


def test_random_operations_keep_the_invariant() -> None:
    rng = random.Random(0)
    cm = CacheManager(num_pages=40, page_size=4, num_slots=6)
    live: list[tuple[RequestCache, list[int], int]] = []
    vocab = [1, 2, 3]  # a tiny vocabulary makes prefixes collide often
    for _ in range(3000):
        op = rng.random()
        if op < 0.3 and len(live) < 6:
            tokens = [rng.choice(vocab) for _ in range(rng.randint(1, 30))]
            rc = cm.admit(tokens, len(tokens) + 1)
            if rc is not None:
                live.append((rc, tokens, len(rc.shared) * cm.page_size))
        elif op < 0.6 and live:
            i = rng.randrange(len(live))
            rc, tokens, valid = live[i]
            tokens = tokens + [rng.choice(vocab)]
            if cm.grow(rc, len(tokens) + 1):
                live[i] = (rc, tokens, len(tokens))
                cm.publish(rc, tokens, len(tokens))
        elif live:
            rc, tokens, valid = live.pop(rng.randrange(len(live)))
            cm.release(rc, tokens, valid)
        cm.check([rc for rc, _, _ in live])
    for rc, tokens, valid in live:
        cm.release(rc, tokens, valid)
    cm.check([])
    assert cm.num_available == cm.num_pages
