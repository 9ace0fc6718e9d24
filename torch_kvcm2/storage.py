"""Storage (REQUIREMENTS §4, STO-1..9): pool groups, their memory, budgets and slot allocation.

Buffers that share (life cycle, sparse, page bytes) are coalesced into one pool group whose slot
holds one page of each (STO-1). Dense groups live in GPU memory; sparse groups in host memory
that, on CUDA, is pinned and device-mapped and reaches ops only as a CUDA view (STO-2). On a CPU
device everything is CPU memory and the same code paths run.

Every pool in CPU memory (the sparse groups; on a CPU device every group) is a contiguous,
page-aligned slice of one :class:`~torch_kvcm2.host_region.HostRegion`: reserved whole at start,
committed chunk by chunk as slots are first handed out (STO-6, docs/HOST_MEMORY.md).

Slots are reference-counted (PFX-4, docs/PREFIX.md): a committed slot without references stays
cached until an allocation that finds no free slot evicts it, least recently used first.

Dense pool groups may have a host tier (TIER-1, ``tiers.py``): one more pool group per dense
group, in the host region like the sparse ones and committed the same way, sized from
``HostOptions.tier_bytes`` of the host budget; it holds the dense pages of requests suspended
with ``offload=True``. Dense slots freed while a copy may still read them carry a *fence* (the
copy's event): an allocation that hands such a slot out makes the stream that will write it
wait for the event first (``PoolGroup.await_fences``).
"""
from __future__ import annotations

import heapq
import logging
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from ._util import cite
from .config import CacheConfig, INT32_MAX
from .host_region import (DEFAULT_CHUNK_BYTES, HUGE_PAGE, PAGE_SIZE, HostMemoryOps, HostRegion,
                          round_up)
from .prefix import PrefixIndex

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class HostOptions:
    """How the host region is reserved, committed and placed (``KVCacheManager`` keywords).

    ``chunk_bytes``: commit step (a positive page multiple); ``threads``: populate/register
    threads (None: the cores this process may use); ``numa_node``/``numa_strict``: placement
    (from ``numa``); ``prefill_bytes``: host-medium bytes committed at start; ``huge_pages``:
    back the region with transparent huge pages; ``ops``: the system-call object (tests inject
    faults through it); ``tier_bytes``: bytes of the host budget for the host tier of the dense
    pool groups (TIER-1; 0: no tier).
    """

    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    threads: Optional[int] = None
    numa_node: Optional[int] = None
    numa_strict: bool = False
    prefill_bytes: int = 0
    ops: Optional[HostMemoryOps] = None
    huge_pages: bool = True
    tier_bytes: int = 0


@dataclass(frozen=True)
class BufferPlace:
    """Where one buffer lives: its pool group (None for a zero-size buffer) and position."""

    layer: str
    role: str
    bytes_per_token: int
    chunks: int
    sparse: bool
    group: Optional[int]
    pos: int


@dataclass(frozen=True)
class BufferInfo:
    """Where one buffer lives (``KVCacheManager.buffer``). ``pool_group``: its pool group's
    index (``Batch.page_tables[pool_group]``, ``KVCache.pages(pool_group)``; None for a
    zero-size buffer); the page of slot ``s`` is page ``s * scale + pos`` of ``buffer_view``;
    ``medium`` the budget its pool draws from ("gpu": dense, "host": sparse); a page is ``chunks`` runs of ``P`` tokens
    of ``bytes_per_token / chunks`` bytes; ``selection_group`` the index of the sparse layer's
    selection group (None for a dense layer); ``window`` / ``sinks`` the layer's."""

    layer: str
    role: str
    bytes_per_token: int
    chunks: int
    sparse: bool
    pool_group: Optional[int]
    pos: int
    scale: int
    medium: Optional[str]
    selection_group: Optional[int]
    window: Optional[int]
    sinks: int


class PoolGroup:
    """One memory region whose slots each hold ``scale`` coalesced buffer pages.

    ``data`` is ``uint8[num_slots, scale, page_bytes]`` in the group's medium (what the host
    writes through); ``device_data`` is what ops see (the UVA CUDA view of a host group on CUDA,
    else ``data`` itself). Both addresses are fixed for the manager's lifetime (STO-3).

    A group in CPU memory is a slice of the host region starting at ``region_offset``; only its
    first ``committed_bytes`` are real memory. Slots are handed out lowest-free-first (STO-5), so
    the committed part is a prefix that grows one chunk (or more) at a time when an allocation
    first reaches past it. Free slots are the released ones below ``_next`` (a heap) plus every
    slot from ``_next`` on, so start-up never builds a list of all slots.

    Prefix sharing (PFX-4, docs/PREFIX.md): ``refs[s]`` counts the caches whose page lists hold
    slot ``s``; ``owner[s]`` is its committed entry + 1 (0: not committed); ``stamp[s]`` its last
    use. A slot is *free* (in the free list), *used* (refs > 0) or *cached* (refs == 0 and
    committed: reclaimable, least recently used first, through ``_lru``, a heap of (stamp,
    slot) checked lazily). The arrays are zero-filled, so start-up touches none of their memory.

    A host tier group (``tier_of``: the index of the dense group it serves, TIER-1) has that
    group's index, window, page bytes and buffers, lives in the host region and is never seen
    by ops, batches or the prefix index. Fences (CUDA): ``fence[s]`` names the event of a copy
    that may still read slot ``s`` (0: none); ``await_fences`` orders a writer after it.
    """

    def __init__(self, index: int, window: Optional[int], sparse: bool, page_bytes: int,
                 tier_of: Optional[int] = None, sinks: int = 0):
        self.index = index
        self.tier_of = tier_of
        self.window = window
        self.sinks = sinks  # tokens a windowed life cycle keeps at the start (TIER-3)
        self.sparse = sparse
        self.page_bytes = page_bytes
        self.buffers: list[tuple[str, str]] = []  # (layer, role) by pos
        self.num_slots = 0
        self.data: Optional[torch.Tensor] = None
        self.device_data: Optional[torch.Tensor] = None
        self.region: Optional[HostRegion] = None
        self.region_offset = 0
        self.committed_bytes = 0
        self._free: list[int] = []  # released slots below _next, a heap
        self._next = 0  # every slot from here on is free and was never handed out
        self.refs = self.owner = self.stamp = None
        self.cached_slots = 0
        self._lru: list[tuple[int, int]] = []
        self.fence: Optional[np.ndarray] = None  # int32[num_slots], made at the first fence
        self.fence_events: dict = {}  # fence id -> torch.cuda.Event
        self._fence_ids = 0

    @property
    def scale(self) -> int:
        return len(self.buffers)

    @property
    def slot_bytes(self) -> int:
        return self.scale * self.page_bytes

    @property
    def medium(self) -> str:
        return "host" if self.sparse or self.tier_of is not None else "gpu"

    @property
    def free_slots(self) -> int:
        return len(self._free) + self.num_slots - self._next

    def free_state(self) -> tuple[int, list[int]]:
        """(high-water mark, the released slots below it, sorted): every slot from the mark on
        is free and was never handed out. Two groups with equal ``free_slots`` can differ here
        (``KVCacheManager.check_ranks`` compares it across ranks)."""
        return self._next, sorted(self._free)

    @property
    def nbytes(self) -> int:
        return self.num_slots * self.slot_bytes

    @property
    def committed_slots(self) -> int:
        """Slots wholly inside the committed prefix."""
        return min(self.committed_bytes // self.slot_bytes, self.num_slots)

    def allocate_memory(self, num_slots: int, device: torch.device) -> None:
        """Dense memory in ``device`` (GPU pools on CUDA), all committed at once."""
        self.num_slots = num_slots
        self.data = torch.zeros((num_slots, self.scale, self.page_bytes), dtype=torch.uint8,
                                device=device)
        self.device_data = self.data
        self.committed_bytes = self.nbytes
        self._free, self._next = [], 0
        self._init_slots()

    def place_in_region(self, num_slots: int, region: HostRegion, offset: int,
                        device_view: Optional[torch.Tensor]) -> None:
        """Take the slice ``[offset, offset + num_slots * slot_bytes)`` of ``region`` (nothing
        committed); ``device_view`` is the region's UVA view on CUDA (None: ops see ``data``)."""
        self.num_slots, self.region, self.region_offset = num_slots, region, offset
        shape = (num_slots, self.scale, self.page_bytes)
        self.data = region.tensor[offset:offset + self.nbytes].view(shape)
        self.device_data = (self.data if device_view is None
                            else device_view[offset:offset + self.nbytes].view(shape))
        self.committed_bytes = 0
        self._free, self._next = [], 0
        self._init_slots()

    def _init_slots(self) -> None:
        """Every slot free, unreferenced and uncommitted."""
        self.refs = np.zeros(self.num_slots, dtype=np.int32)
        self.owner = np.zeros(self.num_slots, dtype=np.int32)
        self.stamp = np.zeros(self.num_slots, dtype=np.int64)
        self.cached_slots, self._lru = 0, []

    def commit_target(self, end_bytes: int) -> int:
        """The committed prefix needed to cover ``end_bytes`` of the slice: whole chunks from
        the slice start, capped at the slice (rounded up to a page)."""
        chunk = self.region.chunk_bytes
        return min(round_up(end_bytes, chunk), round_up(self.nbytes, PAGE_SIZE))

    def grow_range(self, end_bytes: int) -> Optional[tuple[int, int]]:
        """``(region offset, bytes)`` to commit so that ``end_bytes`` of the slice are
        committed, or None when they already are."""
        if self.region is None or end_bytes <= self.committed_bytes:
            return None
        target = self.commit_target(end_bytes)
        return self.region_offset + self.committed_bytes, target - self.committed_bytes

    def allocate(self, n: int) -> Optional[list[int]]:
        """``n`` slots, lowest free first (STO-5), or None with nothing taken: when too few are
        free, or when committing the memory they need fails (the commit then rolls back)."""
        if n > self.free_slots:
            return None
        taken = [heapq.heappop(self._free) for _ in range(min(n, len(self._free)))]
        fresh = n - len(taken)  # every released slot is below _next: fresh ones come last
        if fresh:
            grow = self.grow_range((self._next + fresh) * self.slot_bytes)
            if grow is not None:
                if not self.region.commit([grow]):
                    for slot in taken:
                        heapq.heappush(self._free, slot)
                    logger.warning("pool group %d: committing %d more bytes of the host region "
                                   "failed: %s", self.index, grow[1], self.region.last_error)
                    return None
                self.committed_bytes += grow[1]
                logger.debug("pool group %d: host region grew by %d bytes to %d committed",
                             self.index, grow[1], self.committed_bytes)
            taken.extend(range(self._next, self._next + fresh))
            self._next += fresh
        if taken:
            self.refs[taken] = 1
        return taken

    def release(self, slots) -> None:
        """Drop one reference to each of ``slots`` (distinct). A slot left without references is
        cached when committed, else free again. Freed slots just below ``_next`` lower it
        instead of entering the heap, so an allocation undone at once (a failed resize) leaves
        the free list as it was."""
        slots = np.asarray(slots, dtype=np.int64)
        if not len(slots):
            return
        refs = self.refs
        left = refs[slots] - 1
        if (left < 0).any():
            raise AssertionError(f"pool group {self.index}: released a slot with no reference")
        refs[slots] = left
        unused = slots[left == 0]
        if not len(unused):
            return
        committed = self.owner[unused] != 0
        for slot in unused[committed].tolist():
            heapq.heappush(self._lru, (int(self.stamp[slot]), slot))
        self.cached_slots += int(committed.sum())
        self._free_slots(unused[~committed].tolist())
        if len(self._lru) > 2 * self.cached_slots + 1024:
            self._compact_lru()

    def _free_slots(self, slots: list) -> None:
        for slot in sorted(slots, reverse=True):
            if slot == self._next - 1:
                self._next = slot
            else:
                heapq.heappush(self._free, slot)

    def _compact_lru(self) -> None:
        """Drop the heap's stale items (slots used again, evicted or restamped since)."""
        self._lru = [(st, s) for st, s in self._lru if self._is_cached(st, s)]
        heapq.heapify(self._lru)

    def _is_cached(self, stamp: int, slot: int) -> bool:
        return self.refs[slot] == 0 and self.owner[slot] != 0 and self.stamp[slot] == stamp

    def pop_lru(self) -> int:
        """The least recently used cached slot (there must be one), taken off the heap."""
        while self._lru:
            stamp, slot = heapq.heappop(self._lru)
            if self._is_cached(stamp, slot):
                return slot
        raise AssertionError(f"pool group {self.index}: no cached slot to evict")

    def restamp(self, slots: np.ndarray, stamps: np.ndarray) -> None:
        """New last-use stamps for committed ``slots``; cached ones re-enter the LRU heap under
        their new stamp (the old heap items go stale)."""
        self.stamp[slots] = stamps
        cached = self.refs[slots] == 0
        if cached.any():
            for slot, stamp in zip(slots[cached].tolist(), stamps[cached].tolist()):
                heapq.heappush(self._lru, (stamp, slot))

    def reference(self, slots: np.ndarray) -> None:
        """One more reference to each of ``slots`` (distinct, all committed or used): a cached
        slot becomes used."""
        if not len(slots):
            return
        self.cached_slots -= int(np.count_nonzero(self.refs[slots] == 0))
        self.refs[slots] += 1

    def uncommit(self, slots: np.ndarray) -> None:
        """The slots leave the prefix index: cached ones become free, used ones stay used
        (private to the caches holding them)."""
        self.owner[slots] = 0
        unused = slots[self.refs[slots] == 0]
        self.cached_slots -= len(unused)
        self._free_slots(unused.tolist())

    def fence_slots(self, slots, event) -> None:
        """Slots just released while a copy recorded by ``event`` (a ``torch.cuda.Event``) may
        still read them: whoever is handed one later first waits for the event on its stream."""
        slots = np.asarray(slots, dtype=np.int64)
        if not len(slots):
            return
        if self.fence is None:
            self.fence = np.zeros(self.num_slots, dtype=np.int32)
        self._fence_ids += 1
        self.fence[slots] = self._fence_ids
        self.fence_events[self._fence_ids] = event

    def await_fences(self, slots, stream) -> None:
        """``stream`` (the one that will write ``slots``, just handed out) waits for the copies
        that may still read them: a stream wait, never a host wait; fences whose copy is done
        are dropped. No-op without fences."""
        if not self.fence_events or not len(slots):
            return
        slots = np.asarray(slots, dtype=np.int64)
        ids = self.fence[slots]
        for fence_id in np.unique(ids[ids != 0]).tolist():
            event = self.fence_events[fence_id]
            if not event.query():
                stream.wait_event(event)
        self.fence[slots] = 0
        if len(self.fence_events) > 64:  # forget copies that are done
            live = set(np.unique(self.fence[self.fence != 0]).tolist())
            self.fence_events = {i: e for i, e in self.fence_events.items()
                                 if i in live and not e.query()}
            self.fence[~np.isin(self.fence, list(self.fence_events))] = 0

    def usage(self) -> tuple[int, int, int, int]:
        """(used, shared, cached, free) slots: referenced, referenced by more than one cache,
        committed without references, and free."""
        free = self.free_slots
        used = self.num_slots - free - self.cached_slots
        shared = int(np.count_nonzero(self.refs > 1)) if self.refs is not None else 0
        return used, shared, self.cached_slots, free


class Storage:
    """All pool groups of a config. Construction only groups the buffers; ``allocate`` sizes the
    groups from the budgets left after the given reserves and takes their memory.
    ``host_group`` (a ``tp.HostGroup``): the sparse groups live in its shared region instead
    (TP-1, docs/TP.md)."""

    def __init__(self, config: CacheConfig, host_group=None):
        self.config = config
        self.host_group = host_group
        self.groups: list[PoolGroup] = []
        self.places: dict[tuple[str, str], BufferPlace] = {}
        keys: dict[tuple, PoolGroup] = {}
        P = config.tokens_per_page
        for layer in config.layers:
            for buf in layer.buffers:
                page_bytes = P * buf.bytes_per_token
                group, pos = None, 0
                if page_bytes:
                    # a life cycle is (window, sinks): its own release rule (TIER-3)
                    key = (layer.window, layer.sinks, buf.sparse, page_bytes)
                    if key not in keys:
                        keys[key] = PoolGroup(len(self.groups), layer.window, buf.sparse,
                                              page_bytes, sinks=layer.sinks)
                        self.groups.append(keys[key])
                    group_obj = keys[key]
                    pos = group_obj.scale
                    group_obj.buffers.append((layer.name, buf.role))
                    group = group_obj.index
                self.places[(layer.name, buf.role)] = BufferPlace(
                    layer.name, buf.role, buf.bytes_per_token, buf.chunks, buf.sparse, group, pos
                )
        # the public description of every buffer (KVCacheManager.buffer), made once
        self.infos = {key: self._describe(place) for key, place in self.places.items()}
        self.budget = {"gpu": config.gpu_budget_bytes, "host": config.host_budget_bytes}
        self.capped = {"gpu": 0, "host": 0}  # budget beyond what int32 indices can address
        self.reserved = {"gpu": 0, "host": 0}
        self.tiers: list[Optional[PoolGroup]] = [None] * len(self.groups)  # TIER-1, by group
        self.tier_bytes = 0
        self.region: Optional[HostRegion] = None
        self.closed = False
        self.prefix = PrefixIndex(self.groups, P, config.max_pages_per_row)

    def in_region(self, group: PoolGroup) -> bool:
        """Whether the group lives in the host region: sparse groups, and on a CPU device all
        (but with a host group, whose region is shared, the dense ones stay private)."""
        return group.sparse or (self.config.device.type != "cuda" and self.host_group is None)

    def allocate(self, reserved: dict, host: Optional[HostOptions] = None) -> None:
        """Size every pool group and take its memory; raises ValueError (nothing allocated) when
        a medium's budget minus ``reserved[medium]`` cannot hold one slot of each of its groups,
        when ``host.prefill_bytes`` exceeds the host pools, or when the host region cannot be
        reserved. Groups in CPU memory get slices of one host region (reserved, not committed);
        GPU pools on CUDA are allocated whole."""
        host = HostOptions() if host is None else host
        self.reserved = dict(reserved)
        tier_slots = self._make_tiers(host.tier_bytes)
        slots = {m: self._slots_for(m) for m in ("gpu", "host")}
        device = self.config.device
        layout, end = [], 0
        for group in self.groups + [t for t in self.tiers if t is not None]:
            # every medium validated: lay out, then allocate
            n = tier_slots if group.tier_of is not None else slots[group.medium]
            if (group.tier_of is not None or self.in_region(group)) and n:
                layout.append((group, end, n))
                # slices start on huge-page boundaries, so chunks are whole huge pages
                end = round_up(end + n * group.slot_bytes, HUGE_PAGE)
        host_pool_bytes = sum(slots["host"] * g.slot_bytes for g in self.groups if g.sparse)
        prefill = host.prefill_bytes
        if not isinstance(prefill, int) or isinstance(prefill, bool) or prefill < 0:
            raise ValueError(f"prefill_host_bytes must be a non-negative int, got {prefill!r}")
        if prefill > host_pool_bytes:
            raise ValueError(f"prefill_host_bytes ({prefill}) exceeds the host pools "
                             f"({host_pool_bytes} bytes of the host budget)")
        if self.host_group is not None and not layout:
            raise ValueError("host_group: the config has no sparse pool groups to share")
        if layout:
            what = ("host_budget_bytes" if device.type == "cuda"
                    else "host_budget_bytes + gpu_budget_bytes (CPU memory on a CPU device)")
            options = dict(
                chunk_bytes=host.chunk_bytes, threads=host.threads,
                numa_node=host.numa_node, numa_strict=host.numa_strict,
                device=(device.index if device.index is not None else torch.cuda.current_device())
                if device.type == "cuda" else None,
                ops=host.ops, what=what, huge_pages=host.huge_pages)
            if self.host_group is not None:
                self.region = self.host_group.create_region(end, device, **options)
            else:
                self.region = HostRegion(end, **options)
        try:
            view = None
            if self.region is not None and device.type == "cuda":
                from .ops import uva_view  # CUDA builds only

                with torch.cuda.device(device):
                    view = uva_view(self.region.tensor, register=False)
            for group, offset, n in layout:
                group.place_in_region(n, self.region, offset, view)
            for group in self.groups:
                if not self.in_region(group):
                    group.allocate_memory(slots[group.medium], device)
            if prefill:
                self._prefill(prefill, host_pool_bytes)
        except BaseException:
            self.close()
            raise

    def _prefill(self, nbytes: int, host_pool_bytes: int) -> None:
        """Commit about ``nbytes`` of the host pools at start, in one parallel commit: each
        sparse group the same fraction of its slice, whole chunks."""
        ranges, grown = [], []
        for group in self.groups:
            if group.sparse and group.region is not None:
                grow = group.grow_range(-(-nbytes * group.nbytes // host_pool_bytes))
                if grow is not None:
                    ranges.append(grow)
                    grown.append((group, grow[1]))
        if not self.region.commit(ranges):
            raise RuntimeError(f"prefill_host_bytes: committing {nbytes} bytes of host memory at "
                               f"start failed: {self.region.last_error}")
        for group, nbytes in grown:
            group.committed_bytes += nbytes

    def _make_tiers(self, tier_bytes) -> int:
        """Create the host tier of every dense pool group from ``tier_bytes`` of the host budget
        (TIER-1): every tier gets the same number of slots, ``floor(tier_bytes / sum of their
        slot bytes)``, returned. Raises ValueError (nothing allocated) for a bad value, a config
        without dense pool groups, a host group (TP), or a tier that cannot hold one slot each."""
        if not isinstance(tier_bytes, int) or isinstance(tier_bytes, bool) or tier_bytes < 0:
            raise ValueError(f"host_tier_bytes must be a non-negative int, got {tier_bytes!r}")
        if not tier_bytes:
            return 0
        dense = [g for g in self.groups if not g.sparse]
        if not dense:
            raise ValueError("host_tier_bytes: the config has no dense pool groups to tier")
        if self.host_group is not None:
            raise ValueError("host_tier_bytes: a host tier is not supported with a host group (TP)")
        available = self.budget["host"] - self.reserved["host"]
        per_slot = sum(g.slot_bytes for g in dense)
        if tier_bytes > available or tier_bytes < per_slot:
            raise ValueError(
                f"TIER-1: host_tier_bytes ({tier_bytes}) must hold one slot of each of the "
                f"{len(dense)} dense pool groups ({per_slot} bytes) and fit the host budget "
                f"({self.budget['host']} bytes, {self.reserved['host']} reserved for staging)")
        for g in dense:
            tier = PoolGroup(g.index, g.window, False, g.page_bytes, tier_of=g.index,
                             sinks=g.sinks)
            tier.buffers = list(g.buffers)
            self.tiers[g.index] = tier
        self.tier_bytes = tier_bytes
        return tier_bytes // per_slot

    def close(self) -> None:
        """Release the host region (registrations and memory) and drop every pool tensor
        (idempotent). Views taken before must not be used afterwards."""
        self.closed = True
        for group in self.groups + [t for t in self.tiers if t is not None]:
            group.data = group.device_data = None
        if self.host_group is not None:
            self.host_group.close()  # marks this rank as left before its mapping goes
        if self.region is not None:
            self.region.close()

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError("Storage: the manager is closed; its pools are released")

    def _slots_for(self, medium: str) -> int:
        groups = [g for g in self.groups if g.medium == medium]
        if not groups:
            return 0
        available = self.budget[medium] - self.reserved[medium]
        if medium == "host":
            available -= self.tier_bytes
        per_slot = sum(g.slot_bytes for g in groups)
        slots = max(available, 0) // per_slot
        if slots == 0:
            tier = f", {self.tier_bytes} for the host tier" if medium == "host" and self.tier_bytes else ""
            raise ValueError(cite(
                f"STO-4: the {medium} budget ({self.budget[medium]} bytes, {self.reserved[medium]} "
                f"reserved for batch tables and staging{tier}) cannot hold one slot of each of its "
                f"{len(groups)} pool groups ({per_slot} bytes)"
            ))
        # Page and token indices of views are int32: cap the slot count so none can overflow.
        limit = INT32_MAX // (max(g.scale for g in groups) * self.config.tokens_per_page)
        if slots > limit:
            self.capped[medium] = (slots - limit) * per_slot
            logger.warning("the %s budget holds %d slots per pool group, more than int32 page "
                           "and token indices can address; %d are used and %d bytes of the "
                           "budget stay unused (stats()['%s']['capped_bytes'])", medium, slots,
                           limit, self.capped[medium], medium)
        return min(slots, limit)

    # ---- slots ----
    def allocate_slots(self, needs, writer=None) -> Optional[list[list[int]]]:
        """``needs[g]`` new slots of every pool group ``g`` (one reference each), or None with
        nothing changed (PFX-4, STO-5). Free slots are taken first, lowest first; only when a
        group runs out are its cached slots evicted, least recently used first, and only once
        every group's free slots (and the memory they commit) are in hand, so a failure never
        evicts anything. Evicting a full-attention page frees its cached slots in the other
        groups too, which they then take before evicting more. A slot handed out under a fence
        (a host tier's copy may still read it) makes ``writer`` (default: the current CUDA
        stream) wait for that copy."""
        groups = self.groups
        if any(n > g.free_slots + g.cached_slots for g, n in zip(groups, needs)):
            return None
        taken: list[list[int]] = []
        for group, n in zip(groups, needs):
            k = min(n, group.free_slots)
            slots = group.allocate(k) if k else []
            if slots is None:
                for g, done in zip(groups, taken):
                    g.release(done)
                return None
            taken.append(slots)
        for group, n, slots in zip(groups, needs, taken):
            while len(slots) < n:
                if not group.free_slots:
                    self.prefix.evict(group)
                # slots freed by eviction are committed memory: this never fails
                slots.extend(group.allocate(min(n - len(slots), group.free_slots)))
        for group, slots in zip(groups, taken):
            if group.fence_events and slots:
                stream = writer if writer is not None else torch.cuda.current_stream(self.config.device)
                group.await_fences(slots, stream)
        return taken

    def allocate_tier_slots(self, needs) -> Optional[list[list[int]]]:
        """``needs[g]`` slots of the host tier of every dense pool group ``g`` (TIER-1), or None
        with nothing taken: when a tier has too few free slots or committing its memory fails
        (each tier's commit rolls back; the tiers allocated before are released)."""
        taken: list[list[int]] = []
        for index, n in enumerate(needs):
            slots = [] if not n else (None if self.tiers[index] is None
                                      else self.tiers[index].allocate(n))
            if slots is None:
                for tier, done in zip(self.tiers, taken):
                    if done:
                        tier.release(done)
                return None
            taken.append(slots)
        return taken

    # ---- views ----
    def place(self, layer: str, role: str) -> BufferPlace:
        try:
            return self.places[(layer, role)]
        except KeyError:
            raise KeyError(f"unknown buffer {role!r} of layer {layer!r}") from None

    def info(self, layer: str, role: str) -> BufferInfo:
        """The public description of a buffer (``BufferInfo``)."""
        try:
            return self.infos[(layer, role)]
        except KeyError:
            raise KeyError(f"unknown buffer {role!r} of layer {layer!r}") from None

    def _describe(self, place: BufferPlace) -> BufferInfo:
        layer = place.layer
        spec = self.config.layer(layer)
        group = None if place.group is None else self.groups[place.group]
        try:
            selection = self.config.group_of(layer).index
        except KeyError:  # a dense layer
            selection = None
        return BufferInfo(layer, place.role, place.bytes_per_token, place.chunks, place.sparse,
                          place.group, place.pos, 1 if group is None else group.scale,
                          None if group is None else group.medium, selection, spec.window,
                          spec.sinks)

    def _page_layout(self, place: BufferPlace) -> tuple[int, int, int]:
        return (place.chunks, self.config.tokens_per_page, place.bytes_per_token // place.chunks)

    def view(self, layer: str, role: str, device_side: bool = True) -> torch.Tensor:
        """The buffer's view ``[num_slots*scale, chunks, P, B/chunks]`` (uint8); page index of slot
        ``s`` is ``s*scale + pos`` (STO-3). ``device_side`` picks the tensor ops see (the UVA view
        for host groups on CUDA) over the host tensor."""
        self._check_open()
        place = self.place(layer, role)
        if place.group is None:
            return torch.empty((0, *self._page_layout(place)), dtype=torch.uint8,
                               device=self.config.device)
        group = self.groups[place.group]
        data = group.device_data if device_side else group.data
        return data.view(group.num_slots * group.scale, *self._page_layout(place))

    def pool(self, layer: str, role: str, device_side: bool = True) -> tuple[torch.Tensor, int]:
        """``(data, pos)``: the buffer's pool group memory ``uint8[num_slots, scale, page_bytes]``
        and the buffer's position in a slot, as ``fetch`` and ``flush`` take them (the whole pool,
        never a per-buffer view: views of one pool would alias each other inside a compiled
        step). Page of slot ``s``: ``data[s, pos]``."""
        self._check_open()
        place = self.place(layer, role)
        if place.group is None:
            raise KeyError(f"buffer {role!r} of layer {layer!r} is zero-size: it has no pages")
        group = self.groups[place.group]
        return (group.device_data if device_side else group.data), place.pos

    def slot_pages(self, layer: str, role: str, device_side: bool = True) -> torch.Tensor:
        """The buffer's pages indexed by slot id: ``[num_slots, chunks, P, B/chunks]``, a strided
        view (slot stride = the group's slot bytes), for reading and writing pages by slot."""
        self._check_open()
        place = self.place(layer, role)
        group = self.groups[place.group]
        data = group.device_data if device_side else group.data
        return data[:, place.pos].view(group.num_slots, *self._page_layout(place))

    # ---- accounting ----
    def stats(self) -> dict:
        """Used/free bytes and slots per pool group and per medium (STO-4), committed bytes per
        group and medium, and the host region's reserved/committed/registered bytes (STO-9).
        Per group and medium also the prefix-sharing counts (PFX-4): ``used_slots`` are
        referenced by a cache, ``shared_slots`` by more than one, ``cached_slots`` are committed
        pages no cache references (reclaimable: allocation evicts them when no slot is free),
        ``free_slots`` hold nothing. ``stats()["prefix"]``: committed entries and the tokens
        ``create_cache(token_ids)`` asked for and shared. A dense group's ``host_tier`` (None
        without one, TIER-1): its slots, used / free slots and bytes and committed bytes; the
        host medium's used, free and committed bytes include the tiers', and
        ``host_tier_bytes`` / ``host_tier_used_bytes`` give the tiers' budget and use."""
        groups = []
        media = {m: {"budget_bytes": self.budget[m], "capped_bytes": self.capped[m],
                     "reserved_bytes": self.reserved[m],
                     "used_bytes": 0, "shared_bytes": 0, "cached_bytes": 0, "free_bytes": 0,
                     "committed_bytes": 0}
                 for m in ("gpu", "host")}
        for g in self.groups:
            used, shared, cached, free = g.usage()
            committed = min(g.committed_bytes, g.nbytes)
            groups.append({
                "index": g.index, "medium": g.medium, "window": g.window, "sinks": g.sinks,
                "sparse": g.sparse,
                "page_bytes": g.page_bytes, "scale": g.scale, "buffers": list(g.buffers),
                "slots": g.num_slots, "used_slots": used, "shared_slots": shared,
                "cached_slots": cached, "free_slots": free,
                "used_bytes": used * g.slot_bytes, "shared_bytes": shared * g.slot_bytes,
                "cached_bytes": cached * g.slot_bytes, "free_bytes": free * g.slot_bytes,
                "committed_bytes": committed, "in_host_region": g.region is not None,
                "host_tier": self._tier_stats(self.tiers[g.index]),
            })
            for name, n in (("used", used), ("shared", shared), ("cached", cached), ("free", free)):
                media[g.medium][f"{name}_bytes"] += n * g.slot_bytes
            media[g.medium]["committed_bytes"] += committed
        tiers = [t for t in self.tiers if t is not None]
        media["host"]["host_tier_bytes"] = self.tier_bytes
        media["host"]["host_tier_used_bytes"] = 0
        for t in tiers:
            used = (t.num_slots - t.free_slots) * t.slot_bytes
            media["host"]["used_bytes"] += used
            media["host"]["host_tier_used_bytes"] += used
            media["host"]["free_bytes"] += t.free_slots * t.slot_bytes
            media["host"]["committed_bytes"] += min(t.committed_bytes, t.nbytes)
        region = None
        if self.region is not None:
            region = self.region.stats()
            # slots holding data: referenced or cached
            region["used_bytes"] = sum((g.num_slots - g.free_slots) * g.slot_bytes
                                       for g in self.groups + tiers if g.region is not None)
            region["closed"] = self.region.closed
        return {"pool_groups": groups, **media, "host_region": region,
                "prefix": self.prefix.stats()}

    @staticmethod
    def _tier_stats(tier: Optional[PoolGroup]) -> Optional[dict]:
        if tier is None:
            return None
        used = tier.num_slots - tier.free_slots
        return {"slots": tier.num_slots, "used_slots": used, "free_slots": tier.free_slots,
                "used_bytes": used * tier.slot_bytes, "free_bytes": tier.free_slots * tier.slot_bytes,
                "committed_bytes": min(tier.committed_bytes, tier.nbytes)}
