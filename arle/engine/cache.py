"""KV cache bookkeeping: a page allocator, a radix prefix cache over full pages, and what a
request holds. Pure Python: the executor owns the tensors, this decides which pages hold what.

Hybrid models (Gated DeltaNet layers) also need the recurrent state at the end of a cached
prefix: a radix node may carry a state snapshot (an entry of the executor's snapshot pool, with
its own budget and LRU), and a hybrid request reuses the deepest matched node that has one.

A host tier (`host_pages` > 0, `--kv-host-cache-gb`): device pages the radix tree evicts move
to a host pool instead of being dropped (the node stays, its page now a host page), and a
match that reaches host nodes brings their pages back to device pages as the request is
admitted. The copies are owed to the next step (`take_copies`): offloads (device -> host)
before restores (host -> device), both before the step's kernels. One LRU clock orders both
tiers: the device evicts its least recently used unreferenced pages that hold no device page
below them; the host drops its least recently used leaves. A hybrid node's snapshot moves to
the host's snapshots with its page, or when the device's snapshots run out, and a request
that matches it starts from it there (the copy goes straight into its slot's state).

NOTE (invariants, `check()` asserts them): every page is in exactly one state: free, published
in the radix tree (shared, read-only, possibly referenced by requests), or private to one
request; so is every host page: free, a host node's, or read by a restore not yet run. A node
holds a device page or a host page, never both; a host node's children are host nodes. Every
snapshot, on either tier, is free or carried by exactly one node, which carries one at most.
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
    page: int  # -1: on the host
    parent: RadixNode | None
    children: dict[tuple[int, ...], RadixNode] = field(default_factory=dict)
    refs: int = 0
    last_used: int = 0
    #: the recurrent state after this page's last token (hybrid models), an executor snapshot
    snapshot: int | None = None
    #: the host page holding this node's K/V while it is off the device (-1: on the device)
    host: int = -1
    #: the snapshot's entry in the host tier, where it moved (-1: none)
    host_snapshot: int = -1

    @property
    def has_snapshot(self) -> bool:
        return self.snapshot is not None or self.host_snapshot >= 0

    @property
    def on_device(self) -> bool:
        return self.page >= 0


class RadixCache:
    """Prefix tree over page-sized chunks of token ids; each node owns one page.

    Pages are shared read-only: a node referenced by a running request (refs > 0) is never
    evicted; unreferenced nodes with no device page below them are evicted least recently used
    first (`evict`: dropped, or moved to the host by `on_evict`).
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
            if n.refs == 0 and n.on_device:
                self.num_evictable -= 1
            n.refs += 1
            n.last_used = now

    def unlock(self, nodes: list[RadixNode]) -> None:
        now = next(_clock)
        for n in nodes:
            n.refs -= 1
            assert n.refs >= 0
            n.last_used = now
            if n.refs == 0 and n.on_device:
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

    def evict(self, n: int, on_evict: Callable[[RadixNode], bool] | None = None) -> list[int]:
        """Free up to n unreferenced device pages, least recently used first, each of a node
        with no device page below it. `on_evict(node)` True: the node moved to the host (it
        stays in the tree, off the device); else (or without it) the node is dropped."""
        heap = [(x.last_used, id(x), x) for x in self.all_nodes() if self._evictable(x)]
        heapq.heapify(heap)
        freed: list[int] = []
        while heap and len(freed) < n:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            assert parent is not None
            freed.append(node.page)
            self.num_evictable -= 1
            if on_evict is not None and on_evict(node):
                node.page = -1
            else:
                assert not node.children, "a dropped node takes its subtree's pages with it"
                self._detach(node)
            if parent is not self.root and self._evictable(parent):
                heapq.heappush(heap, (parent.last_used, id(parent), parent))
        return freed

    @staticmethod
    def _evictable(node: RadixNode) -> bool:
        return (node.on_device and node.refs == 0
                and not any(c.on_device for c in node.children.values()))

    def drop_host(self, n: int, on_drop: Callable[[RadixNode], None]) -> int:
        """Drop up to n host nodes, leaves first, least recently used first (`on_drop` sees
        each); -> how many."""
        heap = [(x.last_used, id(x), x) for x in self.all_nodes()
                if not x.on_device and not x.children and x.refs == 0]
        heapq.heapify(heap)
        dropped = 0
        while heap and dropped < n:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            assert parent is not None
            self._detach(node)
            on_drop(node)
            dropped += 1
            if (parent is not self.root and not parent.on_device and not parent.children
                    and parent.refs == 0):
                heapq.heappush(heap, (parent.last_used, id(parent), parent))
        return dropped

    def drop_subtree(self, node: RadixNode, on_drop: Callable[[RadixNode], None]) -> None:
        """A host node and everything below it (host nodes) leave the tree (`on_drop` sees
        each, children first)."""
        assert not node.on_device and node.refs == 0
        for child in list(node.children.values()):
            self.drop_subtree(child, on_drop)
        self._detach(node)
        on_drop(node)

    def _detach(self, node: RadixNode) -> None:
        assert node.parent is not None
        del node.parent.children[node.key]
        self.num_pages -= 1

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
    #: hybrid models: the snapshot the slot's state starts from (None: zero), or the host
    #: tier's
    restore: int | None = None
    restore_host: int | None = None
    #: hybrid models: the last page boundary its scheduled rows reached (the executor keeps
    #: the state there), and the last one a snapshot was taken at
    boundary: int = 0
    saved: int = 0
    #: of `shared`, the pages its admission brought back from the host tier
    restored: int = 0


class CacheManager:
    """Hands out pages and slots, shares prefixes, evicts, and takes it all back."""

    def __init__(self, num_pages: int, page_size: int, num_slots: int,
                 enable_prefix_cache: bool = True, hybrid: bool = False,
                 num_snapshots: int = 0, host_pages: int = 0, host_snapshots: int = 0) -> None:
        self.page_size = page_size
        self.num_pages = num_pages
        self.pages = PageAllocator(num_pages)
        self.radix = RadixCache(page_size)
        self.num_host_pages = host_pages if enable_prefix_cache else 0
        self.host = PageAllocator(self.num_host_pages)
        #: copies owed to the next step: (device page, host page) offloads, (host page, device
        #: page) restores; host pages the restores read, free once those copies are queued
        self._offloads: list[tuple[int, int]] = []
        self._restores: list[tuple[int, int]] = []
        self._restore_reads: list[int] = []
        #: pages moved each way, and tokens admitted from each tier (`stats`)
        self.stats = {"offloaded_pages": 0, "restored_pages": 0, "device_hit_tokens": 0,
                      "host_hit_tokens": 0, "offloaded_snapshots": 0, "host_snapshot_hits": 0}
        self.enable_prefix_cache = enable_prefix_cache
        self._free_slots = list(range(num_slots - 1, -1, -1))
        self.num_slots = num_slots
        self.hybrid = hybrid
        self.num_snapshots = num_snapshots if hybrid and enable_prefix_cache else 0
        self._free_snapshots = list(range(self.num_snapshots - 1, -1, -1))
        self._snapshot_nodes: dict[int, RadixNode] = {}
        self.num_host_snapshots = host_snapshots if self.num_snapshots and self.num_host_pages else 0
        self._free_host_snapshots = list(range(self.num_host_snapshots - 1, -1, -1))
        self._host_snapshot_nodes: dict[int, RadixNode] = {}
        #: (snapshot, host snapshot) copies owed to the next step, before its saves
        self._snapshot_offloads: list[tuple[int, int]] = []
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
            if self.num_host_pages and short > self.host.num_free:
                # NOTE: room for the pages moving down, made in one pass over the tree
                self.radix.drop_host(short - self.host.num_free, self._dropped_host)
            self.pages.free(self.radix.evict(short, self._evicted))
        return self.pages.alloc(n)

    def _evicted(self, node: RadixNode) -> bool:
        """A device page the radix tree gives up: to the host tier where it has (or can make)
        room -> True; else the node is dropped (its snapshot, and any host nodes below it)."""
        if self.num_host_pages and (self.host.num_free
                                    or self.radix.drop_host(1, self._dropped_host)):
            node.host = self.host.alloc(1)[0]
            self._offloads.append((node.page, node.host))
            self.stats["offloaded_pages"] += 1
            self._demote_snapshot(node)
            return True
        for child in list(node.children.values()):
            self.radix.drop_subtree(child, self._dropped_host)
        self._drop_snapshot(node)
        return False

    def _dropped_host(self, node: RadixNode) -> None:
        self.host.free([node.host])
        node.host = -1
        self._drop_snapshot(node)

    def take_copies(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]],
                                   list[tuple[int, int]]]:
        """The copies owed to the next step: (page offloads, page restores, snapshot
        offloads). NOTE: the pages' in that order, before the step's kernels: a restore may
        write a device page an offload of the same step reads; the host pages the restores
        read are free from now on, as the next copies into them run after these. The
        snapshots' before the step's saves (`StepPlan.snapshot_offloads`)."""
        copies = (self._offloads, self._restores, self._snapshot_offloads)
        self._offloads, self._restores, self._snapshot_offloads = [], [], []
        self.host.free(self._restore_reads)
        self._restore_reads = []
        return copies

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
            while nodes and not nodes[-1].has_snapshot:
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
        # a host node's page comes back to a device page of its own
        on_host = [n for n in shared if not n.on_device]
        need = self.pages_for(reserve_tokens) - len(shared) + len(on_host)
        # Locking the prefix makes its evictable pages unavailable: count them out first.
        locked_evictable = sum(1 for n in shared if n.refs == 0 and n.on_device)
        if need + headroom_pages > self.num_available - locked_evictable:
            return None
        self.radix.lock(shared)  # NOTE: the host nodes too: no eviction drops them meanwhile
        new = self._take(max(need, 0))
        assert new is not None
        self._restore(on_host, new[:len(on_host)])
        new = new[len(on_host):]
        last = shared[-1] if self.hybrid and shared else None
        restore, restore_host = (last.snapshot, last.host_snapshot) if last else (None, -1)
        if last is not None:
            last.last_used = next(_clock)
            self.stats["host_snapshot_hits"] += restore_host >= 0
        reached = len(shared) * self.page_size
        self.stats["device_hit_tokens"] += (len(shared) - len(on_host)) * self.page_size
        self.stats["host_hit_tokens"] += len(on_host) * self.page_size
        return RequestCache(slot=self._free_slots.pop(), pages=[n.page for n in shared] + new,
                            shared=shared, restore=restore,
                            restore_host=restore_host if restore_host >= 0 else None,
                            boundary=reached, saved=reached, restored=len(on_host))

    def _restore(self, nodes: list[RadixNode], pages: list[int]) -> None:
        """Host nodes (locked) back onto these device pages, by copies owed to the next step."""
        for node, page in zip(nodes, pages, strict=True):
            self._restores.append((node.host, page))
            self._restore_reads.append(node.host)
            node.page, node.host = page, -1
        self.stats["restored_pages"] += len(nodes)

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
        if len(nodes) * self.page_size != b or nodes[-1].has_snapshot:
            return None
        if not self._free_snapshots:
            self._demote_snapshot(min(self._snapshot_nodes.values(), key=lambda n: n.last_used))
        snapshot = self._free_snapshots.pop()
        nodes[-1].snapshot = snapshot
        nodes[-1].last_used = next(_clock)
        self._snapshot_nodes[snapshot] = nodes[-1]
        return snapshot

    def take_saves(self) -> list[tuple[int, int]]:
        """The snapshot copies owed by released requests, for the next step to run first."""
        saves, self._pending_saves = self._pending_saves, []
        return saves

    def _demote_snapshot(self, node: RadixNode) -> None:
        """A node's device snapshot gives up its entry: to the host tier where it has (or can
        make) room, by a copy owed to the next step; else dropped. NOTE: a host entry read by
        a request admitted this step (its node locked) is never the one made room in."""
        if node.snapshot is None:
            return
        if self.num_host_snapshots and not self._free_host_snapshots:
            idle = [n for n in self._host_snapshot_nodes.values() if n.refs == 0]
            if idle:
                self._drop_host_snapshot(min(idle, key=lambda n: n.last_used))
        if not self._free_host_snapshots:
            self._drop_snapshot(node)
            return
        node.host_snapshot = self._free_host_snapshots.pop()
        self._host_snapshot_nodes[node.host_snapshot] = node
        self._snapshot_offloads.append((node.snapshot, node.host_snapshot))
        self.stats["offloaded_snapshots"] += 1
        self._drop_device_snapshot(node)

    def _drop_snapshot(self, node: RadixNode) -> None:
        """The node's snapshot, on either tier, is gone."""
        self._drop_device_snapshot(node)
        self._drop_host_snapshot(node)

    def _drop_device_snapshot(self, node: RadixNode) -> None:
        if node.snapshot is not None:
            del self._snapshot_nodes[node.snapshot]
            self._free_snapshots.append(node.snapshot)
            node.snapshot = None

    def _drop_host_snapshot(self, node: RadixNode) -> None:
        if node.host_snapshot >= 0:
            del self._host_snapshot_nodes[node.host_snapshot]
            self._free_host_snapshots.append(node.host_snapshot)
            node.host_snapshot = -1

    # ---- checks -----------------------------------------------------------------------------
    def check(self, live: Sequence[RequestCache] = ()) -> None:
        """Assert the page invariant. With no live requests: every page free or cached."""
        nodes = self.radix.all_nodes()
        free = self.pages._free
        cached = [n.page for n in nodes if n.on_device]
        private = [p for rc in live for p in rc.pages[len(rc.shared):]]
        everything = free + cached + private
        assert len(everything) == len(set(everything)), "a page is in two states"
        assert sorted(everything) == list(range(self.num_pages)), "a page is lost"
        hosted = self.host._free + [n.host for n in nodes if not n.on_device] + self._restore_reads
        assert sorted(hosted) == list(range(self.num_host_pages)), "a host page lost or doubled"
        for n in nodes:
            assert n.on_device != (n.host >= 0), "a node on both tiers or on none"
            assert n.on_device or all(not c.on_device for c in n.children.values()), \
                "a device page below a host page"
        refs: dict[int, int] = {}
        for rc in live:
            for n in rc.shared:
                refs[id(n)] = refs.get(id(n), 0) + 1
        for n in nodes:
            assert n.refs == refs.get(id(n), 0), "radix ref count out of step"
        assert self.radix.num_evictable == sum(1 for n in nodes if n.refs == 0 and n.on_device)
        assert len(self._free_slots) + len(live) == self.num_slots
        carried = [n.snapshot for n in nodes if n.snapshot is not None]
        assert sorted(carried) == sorted(self._snapshot_nodes), "a snapshot lost its node"
        assert (sorted(self._free_snapshots + carried) == list(range(self.num_snapshots))), \
            "a snapshot is lost or in two states"
        hosted_snaps = [n.host_snapshot for n in nodes if n.host_snapshot >= 0]
        assert sorted(hosted_snaps) == sorted(self._host_snapshot_nodes), \
            "a host snapshot lost its node"
        assert (sorted(self._free_host_snapshots + hosted_snaps)
                == list(range(self.num_host_snapshots))), "a host snapshot lost or doubled"
        assert not any(n.snapshot is not None and n.host_snapshot >= 0 for n in nodes), \
            "a node carries two snapshots"
