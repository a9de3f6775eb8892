"""KV cache bookkeeping: a page allocator, a radix prefix cache over full pages, and what a
request holds. Pure Python: the executor owns the tensors, this decides which pages hold what.

Hybrid models (Gated DeltaNet layers) also need the recurrent state at the end of a cached
prefix: a radix node may carry a state snapshot (an entry of the executor's snapshot pool, with
its own budget and LRU), and a hybrid request reuses the deepest matched node that has one.

NOTE (invariants, `check()` asserts them): every page is in exactly one state: free, published
in the radix tree (shared, read-only, possibly referenced by requests), or private to one
request. Every snapshot is free or carried by exactly one node.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field


class PageAllocator:
    """Free page ids, lowest first (a heap): a fresh pool fills from the front, and a request
    gets consecutive pages wherever a free run allows, however others' pages were freed (the
    CPU's decode attention reads a run of consecutive pages in place, without a copy)."""

    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        self._free = list(range(num_pages))  # a heap: sorted

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int]:
        assert n <= len(self._free), "caller must check num_free (or evict) first"
        return [heapq.heappop(self._free) for _ in range(n)]

    def free(self, pages: list[int]) -> None:
        for p in pages:
            heapq.heappush(self._free, p)


_clock = itertools.count()


@dataclass(eq=False)
class RadixNode:
    """One full page of tokens, under the node of the page before it."""

    key: tuple[int, ...]
    page: int
    parent: RadixNode | None
    children: dict[tuple[int, ...], RadixNode] = field(default_factory=dict)
    refs: int = 0
    last_used: int = 0
    #: the recurrent state after this page's last token (hybrid models), an executor snapshot
    snapshot: int | None = None


class RadixCache:
    """Prefix tree over page-sized chunks of token ids; each node owns one page.

    Pages are shared read-only: a node referenced by a running request (refs > 0) is never
    evicted; unreferenced leaves are evicted least recently used first.
    """

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.root = RadixNode(key=(), page=-1, parent=None)
        self.num_pages = 0
        self.num_evictable = 0

    def match(self, tokens: list[int]) -> list[RadixNode]:
        """Nodes of the longest cached prefix of `tokens`, in whole pages."""
        ps, node, out = self.page_size, self.root, []
        for i in range(0, len(tokens) - ps + 1, ps):
            child = node.children.get(tuple(tokens[i:i + ps]))
            if child is None:
                break
            out.append(child)
            node = child
        return out

    def lock(self, nodes: list[RadixNode]) -> None:
        now = next(_clock)
        for n in nodes:
            if n.refs == 0:
                self.num_evictable -= 1
            n.refs += 1
            n.last_used = now

    def unlock(self, nodes: list[RadixNode]) -> None:
        now = next(_clock)
        for n in nodes:
            n.refs -= 1
            assert n.refs >= 0
            n.last_used = now
            if n.refs == 0:
                self.num_evictable += 1

    def insert(self, parent: RadixNode, key: tuple[int, ...], page: int) -> RadixNode | None:
        """Publish `page` holding `key` under `parent`, locked once for the caller.
        Returns None if an equal page is already there (the caller keeps its page private)."""
        if key in parent.children:
            return None
        node = RadixNode(key=key, page=page, parent=parent, refs=1, last_used=next(_clock))
        parent.children[key] = node
        self.num_pages += 1
        return node

    def evict(self, n: int, on_evict: Callable[[RadixNode], None] | None = None) -> list[int]:
        """Free up to n unreferenced pages, leaves first, least recently used first
        (`on_evict` sees each node as it goes)."""
        heap = [(x.last_used, id(x), x) for x in self._leaves() if x.refs == 0]
        heapq.heapify(heap)
        freed: list[int] = []
        while heap and len(freed) < n:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            assert parent is not None
            del parent.children[node.key]
            if on_evict is not None:
                on_evict(node)
            freed.append(node.page)
            self.num_pages -= 1
            self.num_evictable -= 1
            if parent is not self.root and not parent.children and parent.refs == 0:
                heapq.heappush(heap, (parent.last_used, id(parent), parent))
        return freed

    def _leaves(self) -> list[RadixNode]:
        out, stack = [], [self.root]
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            elif node is not self.root:
                out.append(node)
        return out

    def all_nodes(self) -> list[RadixNode]:
        out, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out


@dataclass
class RequestCache:
    """Everything a request holds in the cache; the executor reads it to build a step.

    `pages` is the page table; its first len(`shared`) pages are radix nodes this request has
    locked, the rest are private. `slot` is the request's row in per-request device buffers
    (the sampled-token buffer; a hybrid model's recurrent state).
    """

    slot: int
    pages: list[int] = field(default_factory=list)
    shared: list[RadixNode] = field(default_factory=list)
    #: hybrid models: the snapshot the slot's state starts from (None: zero)
    restore: int | None = None
    #: hybrid models: the last page boundary its scheduled rows reached (the executor keeps
    #: the state there), and the last one a snapshot was taken at
    boundary: int = 0
    saved: int = 0


class CacheManager:
    """Hands out pages and slots, shares prefixes, evicts, and takes it all back."""

    def __init__(self, num_pages: int, page_size: int, num_slots: int,
                 enable_prefix_cache: bool = True, hybrid: bool = False,
                 num_snapshots: int = 0) -> None:
        self.page_size = page_size
        self.num_pages = num_pages
        self.pages = PageAllocator(num_pages)
        self.radix = RadixCache(page_size)
        self.enable_prefix_cache = enable_prefix_cache
        self._free_slots = list(range(num_slots - 1, -1, -1))
        self.num_slots = num_slots
        self.hybrid = hybrid
        self.num_snapshots = num_snapshots if hybrid and enable_prefix_cache else 0
        self._free_snapshots = list(range(self.num_snapshots - 1, -1, -1))
        self._snapshot_nodes: dict[int, RadixNode] = {}
        #: (slot, snapshot) copies owed by requests released since the last step; the next
        #: step's plan takes them (`take_saves`)
        self._pending_saves: list[tuple[int, int]] = []

    # ---- capacity ---------------------------------------------------------------------
    @property
    def num_available(self) -> int:
        """Pages that can be had now: free ones plus evictable cached ones."""
        return self.pages.num_free + self.radix.num_evictable

    @property
    def num_used(self) -> int:
        return self.num_pages - self.pages.num_free

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def _take(self, n: int) -> list[int] | None:
        if n > self.num_available:
            return None
        short = n - self.pages.num_free
        if short > 0:
            self.pages.free(self.radix.evict(short, self._drop_snapshot))
        return self.pages.alloc(n)

    # ---- a request's life ---------------------------------------------------------------
    def match(self, tokens: list[int], max_match: int | None = None) -> list[RadixNode]:
        """Cached full pages usable by a request with these tokens (at most `max_match`
        tokens of them). At least one token is left uncached, so the request still computes
        the logits of its last token. A hybrid model's match ends at the deepest node with a
        state snapshot (KV without the state at its end is of no use)."""
        if not self.enable_prefix_cache or len(tokens) < 2:
            return []
        limit = len(tokens) - 1 if max_match is None else min(len(tokens) - 1, max_match)
        nodes = self.radix.match(tokens[:limit])
        if self.hybrid:
            while nodes and nodes[-1].snapshot is None:
                nodes.pop()
        return nodes

    def admit(self, tokens: list[int], reserve_tokens: int, headroom_pages: int = 0,
              max_match: int | None = None) -> RequestCache | None:
        """Take a slot, lock the cached prefix (at most `max_match` tokens of it) and reserve
        pages for `reserve_tokens` tokens. None (nothing taken) when it does not fit with
        `headroom_pages` to spare."""
        if not self._free_slots:
            return None
        shared = self.match(tokens, max_match)
        need = self.pages_for(reserve_tokens) - len(shared)
        # Locking the prefix makes its evictable pages unavailable: count them out first.
        locked_evictable = sum(1 for n in shared if n.refs == 0)
        if need + headroom_pages > self.num_available - locked_evictable:
            return None
        self.radix.lock(shared)
        new = self._take(max(need, 0))
        assert new is not None
        restore = shared[-1].snapshot if self.hybrid and shared else None
        if restore is not None:
            shared[-1].last_used = next(_clock)
        reached = len(shared) * self.page_size
        return RequestCache(slot=self._free_slots.pop(), pages=[n.page for n in shared] + new,
                            shared=shared, restore=restore, boundary=reached, saved=reached)

    def grow(self, rc: RequestCache, num_tokens: int) -> bool:
        """Make the page table cover `num_tokens` tokens; False if no page can be had."""
        need = self.pages_for(num_tokens) - len(rc.pages)
        if need <= 0:
            return True
        new = self._take(need)
        if new is None:
            return False
        rc.pages.extend(new)
        return True

    def shrink(self, rc: RequestCache, num_tokens: int) -> None:
        """Give back the private pages past the first `num_tokens` tokens (a verify step's
        rejected drafts)."""
        keep = max(self.pages_for(num_tokens), len(rc.shared))
        self.pages.free(rc.pages[keep:])
        del rc.pages[keep:]

    def publish(self, rc: RequestCache, tokens: list[int], num_valid: int) -> None:
        """Share the full pages among the first `num_valid` tokens (KV computed or queued on
        the device before any later reader). Stops at the first page someone else published."""
        if not self.enable_prefix_cache:
            return
        ps = self.page_size
        parent = rc.shared[-1] if rc.shared else self.radix.root
        for i in range(len(rc.shared), num_valid // ps):
            node = self.radix.insert(parent, tuple(tokens[i * ps:(i + 1) * ps]), rc.pages[i])
            if node is None:
                return
            rc.shared.append(node)
            parent = node

    def release(self, rc: RequestCache, tokens: list[int], num_valid: int) -> None:
        """A request is done (finished, aborted or preempted): publish what it computed (a
        hybrid model's state at its last page boundary too, copied by the next step), unlock
        its shared pages, free the private ones and its slot."""
        self.publish(rc, tokens, num_valid)
        snapshot = self.snapshot(rc, tokens, num_valid)
        if snapshot is not None:
            self._pending_saves.append((rc.slot, snapshot))
        self.radix.unlock(rc.shared)
        self.pages.free(rc.pages[len(rc.shared):])
        self._free_slots.append(rc.slot)
        rc.pages, rc.shared = [], []

    # ---- a hybrid model's state snapshots ---------------------------------------------------
    def reached(self, rc: RequestCache, start: int, num_tokens: int) -> None:
        """A row of the request covers positions [start, start + num_tokens): the executor keeps
        its state at the last page boundary in (start, end] (`StatePool.boundary_*`).
        NOTE: tracked only where snapshots are taken (a step's rows all pass here)."""
        if not self.num_snapshots:
            return
        boundary = (start + num_tokens) // self.page_size * self.page_size
        if boundary > start:
            rc.boundary = boundary

    def snapshot(self, rc: RequestCache, tokens: list[int], num_valid: int) -> int | None:
        """Attach a snapshot for the state at the request's last boundary to the radix node
        of that page, if it is published, has none yet and is within `num_valid` tokens; the
        caller queues the copy (slot's boundary state -> snapshot). None: nothing to copy."""
        b = rc.boundary
        if not self.num_snapshots or b <= rc.saved or b > num_valid:
            return None
        rc.saved = b
        nodes = self.radix.match(tokens[:b])
        if len(nodes) * self.page_size != b or nodes[-1].snapshot is not None:
            return None
        if not self._free_snapshots:
            oldest = min(self._snapshot_nodes.values(), key=lambda n: n.last_used)
            self._drop_snapshot(oldest)
        snapshot = self._free_snapshots.pop()
        nodes[-1].snapshot = snapshot
        nodes[-1].last_used = next(_clock)
        self._snapshot_nodes[snapshot] = nodes[-1]
        return snapshot

    def take_saves(self) -> list[tuple[int, int]]:
        """The snapshot copies owed by released requests, for the next step to run first."""
        saves, self._pending_saves = self._pending_saves, []
        return saves

    def _drop_snapshot(self, node: RadixNode) -> None:
        if node.snapshot is not None:
            del self._snapshot_nodes[node.snapshot]
            self._free_snapshots.append(node.snapshot)
            node.snapshot = None

    # ---- checks -----------------------------------------------------------------------------
    def check(self, live: Sequence[RequestCache] = ()) -> None:
        """Assert the page invariant. With no live requests: every page free or cached."""
        free = self.pages._free
        cached = [n.page for n in self.radix.all_nodes()]
        private = [p for rc in live for p in rc.pages[len(rc.shared):]]
        everything = free + cached + private
        assert len(everything) == len(set(everything)), "a page is in two states"
        assert sorted(everything) == list(range(self.num_pages)), "a page is lost"
        refs: dict[int, int] = {}
        for rc in live:
            for n in rc.shared:
                refs[id(n)] = refs.get(id(n), 0) + 1
        for n in self.radix.all_nodes():
            assert n.refs == refs.get(id(n), 0), "radix ref count out of step"
        assert self.radix.num_evictable == sum(1 for n in self.radix.all_nodes() if n.refs == 0)
        assert len(self._free_slots) + len(live) == self.num_slots
        carried = [n.snapshot for n in self.radix.all_nodes() if n.snapshot is not None]
        assert sorted(carried) == sorted(self._snapshot_nodes), "a snapshot lost its node"
        assert (sorted(self._free_snapshots + carried) == list(range(self.num_snapshots))), \
            "a snapshot is lost or in two states"
