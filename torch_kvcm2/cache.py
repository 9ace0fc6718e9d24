"""Requests (SPEC §5, REQ-1..4): one ``KVCache`` per request.

A cache owns its pages (one list per pool group, page ordinal -> slot id, BAD once released by a
window) and its lengths. Every call validates before it changes anything; a ``resize`` that
cannot be satisfied returns False and leaves the cache exactly as it was.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from ._util import ceil_div, check_int, refuse_during_capture
from .config import BAD

if TYPE_CHECKING:
    from .batch import Batch
    from .manager import KVCacheManager

ACTIVE, SUSPENDED, CLOSED = "active", "suspended", "closed"



class KVCache:
    """The KV cache of one request.

    ``capacity`` c: positions ``[0, c)`` have pages; ``history_length`` h: positions ``[0, h)``
    are final (held by the host pages of sparse buffers). Created by
    ``KVCacheManager.create_cache()``.
    """

    def __init__(self, manager: "KVCacheManager", request_id: int):
        self.manager = manager
        self.request_id = request_id
        self.capacity = 0
        self.history_length = 0
        self.state = ACTIVE
        self._pages: list[list[int]] = [[] for _ in manager.storage.groups]
        self._flushed = 0  # SAFE-2: tokens below it are on their host pages
        self._batch: Optional["Batch"] = None
        self._row: Optional[int] = None

    def __repr__(self):
        return (f"KVCache(request_id={self.request_id}, capacity={self.capacity}, "
                f"history_length={self.history_length}, state={self.state!r})")

    # ---- inspection ----
    @property
    def closed(self) -> bool:
        return self.state == CLOSED

    @property
    def suspended(self) -> bool:
        return self.state == SUSPENDED

    def pages(self, group: int) -> list[int]:
        """A copy of the page list of pool group ``group`` (slot ids; BAD for released pages)."""
        self._check_open()
        return list(self._pages[group])

    # ---- REQ-1..3 ----
    def resize(self, capacity: Optional[int] = None, history: Optional[int] = None) -> bool:
        """Grow or shrink capacity (allocating or freeing pages) and advance history.

        Raises ``ValueError`` for impossible lengths (history decreasing, above capacity, or
        capacity beyond ``max_tokens_per_row``) and ``RuntimeError`` for a closed or suspended
        cache or during stream capture. Returns False, with nothing changed, when the pools
        cannot supply the pages.
        """
        self._check_open()
        refuse_during_capture(self.manager.config.device, "KVCache.resize")
        if self.suspended:
            raise RuntimeError("KVCache.resize: the cache is suspended; resume() it first")
        c = self.capacity if capacity is None else check_int("capacity", capacity)
        h = self.history_length if history is None else check_int("history", history)
        limit = self.manager.config.max_tokens_per_row
        if h < self.history_length:
            raise ValueError(f"REQ-2: history cannot decrease ({self.history_length} -> {h})")
        if h > c:
            raise ValueError(f"REQ-2: history ({h}) cannot exceed capacity ({c})")
        if c > limit:
            raise ValueError(f"REQ-2: capacity ({c}) exceeds max_tokens_per_row ({limit})")
        safe = self._host_written_through(c)
        if h > self.history_length and h > safe:
            raise ValueError(
                f"SAFE-2: history ({h}) cannot pass what was flushed or written straight to host "
                f"pages ({safe}); flush the in-flight tokens first")
        inflight = self._max_inflight_tokens(h, c)
        if inflight > self.manager.config.max_total_input_tokens:
            raise ValueError(
                f"CFG-3: an in-flight range of {inflight} tokens exceeds max_total_input_tokens "
                f"({self.manager.config.max_total_input_tokens})")

        plans = [self._plan(group, c, h) for group in self.manager.storage.groups]
        taken: list[tuple] = []
        for group, (_, need, _) in zip(self.manager.storage.groups, plans):
            slots = group.allocate(len(need))
            if slots is None:
                for g, s in taken:
                    g.release(s)
                return False
            taken.append((group, slots))
        for (group, slots), (keep, need, drop), pages in zip(taken, plans, self._pages):
            pages.extend([BAD] * (keep - len(pages)))
            for p, slot in zip(need, slots):
                pages[p] = slot
            group.release(pages[p] for p in drop)
            for p in drop:
                pages[p] = BAD
            del pages[keep:]
        self.capacity, self.history_length = c, h
        self._flushed = min(self._flushed, c)  # tokens cut off by a shrink are gone
        self._mark_dirty()
        return True

    def _plan(self, group, c: int, h: int) -> tuple[int, list[int], list[int]]:
        """(page list length, ordinals to allocate, ordinals to free) for new lengths; changes
        nothing."""
        pages = self._pages[group.index]
        P = self.manager.config.tokens_per_page
        keep = ceil_div(c, P)
        first_live = 0
        if group.window is not None and h > group.window:
            first_live = min((h - group.window) // P, keep)  # REQ-3: wholly before h - window
        need = [p for p in range(first_live, keep) if p >= len(pages) or pages[p] == BAD]
        drop = [p for p, s in enumerate(pages) if s != BAD and (p >= keep or p < first_live)]
        return keep, need, drop

    def _host_written_through(self, capacity: int) -> int:
        """How far history may advance with the given (new) capacity (SAFE-2): through what was
        flushed, and through the start of every selection group's in-flight range (tokens
        before it are written straight to host pages: the prefill path). Without sparse layers,
        through capacity."""
        groups = self.manager.config.selection_groups
        if not groups:
            return capacity
        starts = [g.sparse.inflight_start(self.history_length, capacity) for g in groups]
        return max(min(self._flushed, capacity), min(starts))

    def _max_inflight_tokens(self, h: int, c: int) -> int:
        return max((c - g.sparse.inflight_start(h, c) for g in self.manager.config.selection_groups),
                   default=0)

    # ---- REQ-4 ----
    def suspend(self) -> None:
        """Give up the cells (lease); the row publishes BAD / 0; pages stay. Refused while
        tokens are in flight (history < capacity)."""
        self._check_open()
        refuse_during_capture(self.manager.config.device, "KVCache.suspend")
        if self.suspended:
            raise RuntimeError("KVCache.suspend: already suspended")
        if self.history_length < self.capacity:
            raise RuntimeError(
                f"KVCache.suspend: tokens are in flight (history {self.history_length} < capacity "
                f"{self.capacity}); flush and advance history, or shrink capacity, first")
        self.state = SUSPENDED
        if self._batch is not None:
            self._batch._release_lease(self)

    def resume(self) -> None:
        """Take a fresh, empty lease (when seated in a batch)."""
        self._check_open()
        refuse_during_capture(self.manager.config.device, "KVCache.resume")
        if not self.suspended:
            raise RuntimeError("KVCache.resume: the cache is not suspended")
        if self._batch is not None:
            self._batch._grant_lease(self)
        self.state = ACTIVE

    def close(self) -> None:
        """Leave the batch and free every page. Every later call raises RuntimeError."""
        self._check_open()
        refuse_during_capture(self.manager.config.device, "KVCache.close")
        if self._batch is not None:
            self._batch.remove(self)
        for group, pages in zip(self.manager.storage.groups, self._pages):
            group.release(s for s in pages if s != BAD)
            pages.clear()
        self.capacity = self.history_length = 0
        self.state = CLOSED

    # ---- internals ----
    def _check_open(self) -> None:
        self.manager._check_open(f"request {self.request_id}")
        if self.state == CLOSED:
            raise RuntimeError(f"request {self.request_id}: the cache is closed")

    def _mark_dirty(self) -> None:
        if self._batch is not None:
            self._batch._dirty.add(self._row)
