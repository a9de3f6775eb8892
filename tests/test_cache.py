"""CacheManager on its own: prefix sharing, LRU eviction, and the page invariant under a random
sequence of admissions, growth, publication and releases."""

from __future__ import annotations

import random
from collections.abc import Callable

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


# ---- hybrid models: recurrent-state snapshots on radix nodes ---------------------------------

def _run_prompt(cm: CacheManager, tokens: list[int], chunk: int) -> tuple[RequestCache, list]:
    """Admit `tokens` and prefill them in chunks as the scheduler does; returns the request
    and the (slot, snapshot) copies its chunks asked for."""
    rc = cm.admit(tokens, len(tokens) + 1)
    assert rc is not None
    saves = []
    done = len(rc.shared) * cm.page_size
    while done < len(tokens):
        n = min(chunk, len(tokens) - done)
        cm.reached(rc, done, n)
        done += n
        cm.publish(rc, tokens, done)
        snap = cm.snapshot(rc, tokens, done)
        if snap is not None:
            saves.append((rc.slot, snap))
    return rc, saves


def test_a_hybrid_match_ends_at_the_deepest_snapshot() -> None:
    cm = CacheManager(num_pages=32, page_size=4, num_slots=4, hybrid=True, num_snapshots=4)
    tokens = list(range(22))  # 5 full pages + 2
    a, saves = _run_prompt(cm, tokens, chunk=8)
    # chunks end at 8, 16 and 22: snapshots at boundaries 8, 16 and 20 (22's last page start)
    nodes = cm.radix.match(tokens)
    assert [n.snapshot is not None for n in nodes] == [False, True, False, True, True]
    assert [s for _, s in saves] == [nodes[1].snapshot, nodes[3].snapshot, nodes[4].snapshot]
    cm.release(a, tokens, len(tokens))
    assert cm.take_saves() == []  # boundary 20 was saved already
    # another request with the first 18 tokens: pages up to 16 match, and 16 has a snapshot
    b = cm.admit(tokens[:18] + [99], 20)
    assert b is not None and len(b.shared) == 4 and b.restore == nodes[3].snapshot
    assert b.boundary == b.saved == 16
    cm.release(b, tokens[:18] + [99], 19)
    # a prefix that ends between snapshots is cut back to the one before it
    c = cm.admit(tokens[:13] + [98], 15)
    assert c is not None and len(c.shared) == 2 and c.restore == nodes[1].snapshot
    cm.release(c, tokens[:13] + [98], 14)
    cm.check([])


def test_a_released_request_snapshots_its_last_boundary_for_the_next_step() -> None:
    cm = CacheManager(num_pages=32, page_size=4, num_slots=4, hybrid=True, num_snapshots=4)
    prompt = list(range(6))
    a, saves = _run_prompt(cm, prompt, chunk=16)
    assert len(saves) == 1  # boundary 4
    tokens = prompt + [50, 51, 52, 53, 54]  # decoded 5 more: positions 6..10
    for p in range(6, 11):
        cm.grow(a, p + 1)
        cm.reached(a, p, 1)
    assert a.boundary == 8
    cm.release(a, tokens, len(tokens))
    (slot, snap), = cm.take_saves()
    assert slot == a.slot and cm.radix.match(tokens[:8])[-1].snapshot == snap
    assert cm.take_saves() == []
    # turn 2 of a chat: the whole first turn is a prefix; its state at 8 is restored
    b = cm.admit(tokens + [60, 61], len(tokens) + 3)
    assert b is not None and len(b.shared) == 2 and b.restore == snap
    cm.release(b, tokens + [60, 61], len(tokens) + 2)
    cm.check([])


def test_snapshots_have_their_own_budget_and_follow_their_pages() -> None:
    cm = CacheManager(num_pages=12, page_size=4, num_slots=4, hybrid=True, num_snapshots=2)
    firsts = []
    for i in range(3):  # three prompts of 2 pages + 1: a snapshot each, budget 2
        tokens = [100 * i + t for t in range(9)]
        rc, _ = _run_prompt(cm, tokens, chunk=16)
        firsts.append(tokens)
        cm.release(rc, tokens, len(tokens))
        cm.check([])
    held = [cm.radix.match(t)[-1].snapshot for t in firsts]
    assert held[0] is None and None not in held[1:]  # the least recently used gave its entry
    # pages run out: evicting a node frees its snapshot too
    big = cm.admit(list(range(1000, 1047)), 48)
    assert big is not None
    cm.check([big])
    assert all(n.snapshot is None for n in cm.radix.all_nodes())
    cm.release(big, list(range(1000, 1047)), 47)
    cm.check([])


def test_dense_models_and_a_disabled_cache_take_no_snapshots() -> None:
    for cm in (CacheManager(32, 4, 4, hybrid=False, num_snapshots=4),
               CacheManager(32, 4, 4, enable_prefix_cache=False, hybrid=True, num_snapshots=4)):
        rc, saves = _run_prompt(cm, list(range(10)), chunk=4)
        assert saves == [] and rc.restore is None
        cm.release(rc, list(range(10)), 10)
        assert cm.take_saves() == []
        cm.check([])


def test_a_match_can_be_capped() -> None:
    """A request that must compute the logits of early positions (prompt scoring) takes at
    most `max_match` tokens from the cache, in whole pages."""
    cm = CacheManager(num_pages=16, page_size=4, num_slots=4)
    tokens = list(range(17))
    a = cm.admit(tokens, 18)
    assert a is not None
    cm.publish(a, tokens, len(tokens))
    assert len(cm.match(tokens)) == 4
    assert len(cm.match(tokens, max_match=9)) == 2  # 9 tokens: two whole pages
    assert cm.match(tokens, max_match=0) == []
    b = cm.admit(tokens, 18, max_match=0)
    assert b is not None and not b.shared
    cm.release(a, tokens, len(tokens))
    cm.release(b, tokens, 0)
    cm.check([])


def _run_copies(cm: CacheManager, device: dict[int, tuple[int, ...]],
                host: dict[int, tuple[int, ...]]) -> None:
    """A step's page copies, as the executor runs them: offloads, then restores."""
    offloads, restores, snapshots = cm.take_copies()
    assert snapshots == []  # a dense model's
    for d, h in offloads:
        host[h] = device[d]
    for h, d in restores:
        device[d] = host[h]


def test_host_tier_moves_pages_down_and_back() -> None:
    """An evicted page moves to the host (its node stays); a later match brings it back to a
    device page, with its contents; the host's oldest leaf goes when the host is full."""
    cm = CacheManager(num_pages=4, page_size=4, num_slots=2, host_pages=2)
    device: dict[int, tuple[int, ...]] = {}
    host: dict[int, tuple[int, ...]] = {}
    a_tokens = list(range(9))  # 2 full pages + 1
    a = cm.admit(a_tokens, 10)
    assert a is not None
    for i, p in enumerate(a.pages[:2]):
        device[p] = tuple(a_tokens[4 * i:4 * i + 4])
    cm.release(a, a_tokens, 9)
    b = cm.admit(list(range(100, 116)), 16)  # all 4 device pages: a's two move down
    assert b is not None and cm.stats["offloaded_pages"] == 2
    _run_copies(cm, device, host)
    assert sorted(host.values()) == [(0, 1, 2, 3), (4, 5, 6, 7)]
    cm.check([b])
    cm.release(b, list(range(100, 116)), 0)
    c = cm.admit(a_tokens, 10)  # a's prefix: from the host
    assert c is not None and c.restored == 2 and len(c.shared) == 2
    _run_copies(cm, device, host)
    assert [device[p] for p in c.pages[:2]] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert cm.stats["host_hit_tokens"] == 8
    cm.check([c])
    cm.release(c, a_tokens, 9)
    cm.check([])


def random_turns(cm: CacheManager, rng: random.Random,
                 step: Callable[[RequestCache, list[int]], None], partial: bool = False) -> None:
    """1500 random operations over 8 conversations that share 3 system prompts, at most 4
    requests live: a release (`partial`: a fifth publish only half their tokens), or a
    conversation's next turn admitted and its step run (`step`); the invariant after each."""
    prompts = [[1000 * s + i for i in range(rng.randrange(4, 13))] for s in range(3)]
    convs = [list(rng.choice(prompts)) for _ in range(8)]
    live: list[tuple[RequestCache, list[int]]] = []
    for _ in range(1500):
        if live and (rng.random() < 0.45 or len(live) == 4):
            rc, tokens = live.pop(rng.randrange(len(live)))
            half = partial and rng.random() >= 0.8
            cm.release(rc, tokens, len(tokens) // 2 if half else len(tokens))
        else:
            conv = rng.choice(convs)
            conv += [rng.randrange(50) for _ in range(rng.randrange(1, 7))]
            tokens = list(conv)
            admitted = cm.admit(tokens, len(tokens) + 1, headroom_pages=len(live))
            if admitted is None:
                continue
            step(admitted, tokens)
            live.append((admitted, tokens))
        cm.check([rc for rc, _ in live])


def test_host_tier_random_operations_keep_every_page_right() -> None:
    """Random conversations (shared system prompts, growing turns) over a small device pool
    and a smaller host pool: after every operation the invariant holds on both tiers, and
    every cached page a request is admitted with holds its tokens (the copies ran in order:
    nothing read twice, nothing overwritten while it is needed)."""
    ps = 4
    cm = CacheManager(num_pages=20, page_size=ps, num_slots=4, host_pages=12)
    device: dict[int, tuple[int, ...]] = {}
    host: dict[int, tuple[int, ...]] = {}

    def step(rc: RequestCache, tokens: list[int]) -> None:
        _run_copies(cm, device, host)  # the step's copies, before its kernels
        for i, node in enumerate(rc.shared):
            assert device[node.page] == tuple(tokens[i * ps:(i + 1) * ps])
        for i in range(len(rc.shared), len(tokens) // ps):  # the step computes the rest
            device[rc.pages[i]] = tuple(tokens[i * ps:(i + 1) * ps])
        cm.publish(rc, tokens, len(tokens))

    random_turns(cm, random.Random(3), step, partial=True)
    assert cm.stats["offloaded_pages"] > 20 and cm.stats["restored_pages"] > 10
    assert cm.stats["host_hit_tokens"] > 0


def test_a_snapshot_moves_down_with_its_page_and_restores_from_the_host() -> None:
    """Hybrid: a node whose page moves to the host takes its snapshot along (its device entry
    is free again); a later match of the prefix starts from the host's copy."""
    cm = CacheManager(num_pages=4, page_size=4, num_slots=2, hybrid=True, num_snapshots=1,
                      host_pages=4, host_snapshots=2)
    tokens = list(range(9))
    a, saves = _run_prompt(cm, tokens, chunk=16)
    (_, snap), = saves
    cm.release(a, tokens, 9)
    b = cm.admit(list(range(100, 116)), 16)  # every device page: a's move down
    assert b is not None
    offloads, _, snapshots = cm.take_copies()
    assert len(offloads) == 2 and snapshots == [(snap, 0)]
    node = cm.radix.match(tokens)[-1]
    assert node.snapshot is None and node.host_snapshot == 0
    assert cm.stats["offloaded_snapshots"] == 1
    cm.check([b])
    cm.release(b, list(range(100, 116)), 0)
    c = cm.admit(tokens, 10)
    assert c is not None and len(c.shared) == 2 and c.restored == 2
    assert c.restore is None and c.restore_host == 0
    assert cm.stats["host_snapshot_hits"] == 1
    cm.check([c])
    cm.release(c, tokens, 9)
    cm.check([])


def test_hybrid_host_tier_random_operations_restore_the_right_state() -> None:
    """Random conversations over small device pools (pages and snapshots) and host pools,
    run as a step runs its copies: page and snapshot offloads, page restores, the released
    requests' saves, the new requests' starts, the prefill, its saves. Every request starts
    from the state of exactly its cached prefix (a state here is the tokens it has seen),
    whichever tier holds it, and the invariant holds after every operation."""
    ps = 4
    cm = CacheManager(num_pages=20, page_size=ps, num_slots=4, hybrid=True, num_snapshots=3,
                      host_pages=12, host_snapshots=4)
    pages: dict[int, tuple[int, ...]] = {}
    host: dict[int, tuple[int, ...]] = {}
    snaps: dict[int, tuple[int, ...]] = {}
    host_snaps: dict[int, tuple[int, ...]] = {}
    boundary: dict[int, tuple[int, ...]] = {}  # each slot's state at its last page boundary

    def step(rc: RequestCache, tokens: list[int]) -> None:
        start = len(rc.shared) * ps
        cm.reached(rc, start, len(tokens) - start)  # one prefill of the rest
        cm.publish(rc, tokens, len(tokens))
        after = cm.snapshot(rc, tokens, len(tokens))
        offloads, restores, snapshot_offloads = cm.take_copies()
        for d, h in offloads:
            host[h] = pages[d]
        for h, d in restores:
            pages[d] = host[h]
        for d, h in snapshot_offloads:
            host_snaps[h] = snaps[d]
        for slot, snap in cm.take_saves():
            snaps[snap] = boundary[slot]
        state = (snaps[rc.restore] if rc.restore is not None else
                 host_snaps[rc.restore_host] if rc.restore_host is not None else ())
        assert state == tuple(tokens[:start])
        for i, node in enumerate(rc.shared[:start // ps]):
            assert pages[node.page] == tuple(tokens[i * ps:(i + 1) * ps])
        for i in range(start // ps, len(tokens) // ps):
            pages[rc.pages[i]] = tuple(tokens[i * ps:(i + 1) * ps])
        boundary[rc.slot] = tuple(tokens[:rc.boundary])
        if after is not None:
            snaps[after] = boundary[rc.slot]

    random_turns(cm, random.Random(5), step)
    assert cm.stats["offloaded_snapshots"] > 10 and cm.stats["host_snapshot_hits"] > 5
