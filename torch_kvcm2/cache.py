"""Requests (REQUIREMENTS §5, REQ-1..4): one ``KVCache`` per request.

A cache holds its pages (one preallocated int32 row per pool group: page ordinal -> slot id, BAD
outside the live range ``[first_live, allocated)`` and, in a windowed group with sink tokens,
the sink pages ``[0, min(sink pages, first_live))``, TIER-3), its lengths and its write watermarks (the
write contract, docs/HOST_PATH.md). Each page it holds is one reference to its slot: a cache
created from a committed prefix (``create_cache(token_ids)``) starts with references to shared
slots, and every write path reaches only pages at or above its history (docs/PREFIX.md). Every call validates before it changes anything; a
``resize`` that cannot be satisfied returns False and leaves the cache exactly as it was. A
resize costs what changes: the pages allocated or freed, never a loop over the pages a row holds.

A seated cache talks to its batch's row table (``rows.RowTable``) through a private protocol,
listed in that module's docstring; nothing else calls those methods. ``transfer.py`` builds an
imported cache through ``_start_imported`` (TIER-2).

A cache suspended with ``offload=True`` (TIER-1, ``tiers.py``) holds its private dense pages in
the host tier (``_offload``): their page entries read BAD until ``resume`` brings them back.
"""
from __future__ import annotations

import logging
from typing import Optional

import numpy as np
import torch

from . import lengths as rules
from ._util import check_int, cite, refuse_during_capture
from .config import BAD
from .prefix import token_array
from .transfer import CacheRecord, export_record

ACTIVE, SUSPENDED, CLOSED = "active", "suspended", "closed"

logger = logging.getLogger(__name__)


class KVCache:
    """The KV cache of one request.

    ``capacity`` c: positions ``[0, c)`` have pages; ``history_length`` h: positions ``[0, h)``
    are final (held by the host pages of sparse buffers). Created by
    ``KVCacheManager.create_cache()``. ``manager`` is the KVCacheManager that made it.
    """

    def __init__(self, manager, request_id: int):
        self.manager = manager
        self.request_id = request_id
        config = manager.config
        self._h = 0
        self._c = 0
        self.state = ACTIVE
        groups = manager.storage.groups
        self._pages = np.full((len(groups), config.max_pages_per_row), BAD, dtype=np.int32)
        self._live = [[0, 0] for _ in groups]  # per pool group: [first_live, allocated pages)
        # per pool group: the sink pages a windowed group keeps below first_live (TIER-3)
        self._sinks = [rules.sink_pages(g.sinks, config.tokens_per_page) if g.window else 0
                       for g in groups]
        self._flushed = 0  # SAFE-2 watermark: tokens below it are on their host pages
        self._declared = 0  # tokens declared written straight to host pages (record_host_write)
        self._reserve = 0  # tokens of pages kept allocated beyond capacity (Batch.advance)
        self._lowest_capacity = 0  # the lowest capacity since the batch last published this row
        self._lowest_keep = [0 for _ in groups]  # per pool group, likewise for allocated pages
        self._pages_moved = False  # a live range changed since the batch last published this row
        self._shapes = rules.shapes_of(config)
        self._page_tokens, self._max_tokens = config.tokens_per_page, config.max_tokens_per_row
        self._table = None  # the row table (rows.RowTable) of the batch it is seated in
        self._row: Optional[int] = None
        self.reused_tokens = 0  # tokens shared from committed pages at creation (PFX-2)
        self._offload = None  # tiers.Offload: dense pages in the host tier while suspended
        self._arrival = None  # tiers.Restore: resume's copy back, until a reader waited for it

    def __repr__(self):
        return (f"KVCache(request_id={self.request_id}, capacity={self.capacity}, "
                f"history_length={self.history_length}, state={self.state!r})")

    # ---- inspection ----
    @property
    def capacity(self) -> int:
        """Positions ``[0, capacity)`` have pages. Like every getter it reads what the host
        knows, changing nothing and never waiting: lengths ``Batch.advance`` moved on the device
        show once ``Batch.poll()`` has read them back."""
        return self._lengths()[1]

    @property
    def history_length(self) -> int:
        """Positions ``[0, history_length)`` are final (on the host pages of sparse buffers);
        as of the last ``Batch.poll()`` (see ``capacity``)."""
        return self._lengths()[0]

    @property
    def written(self) -> int:
        """Tokens ``[0, written)`` are on the host pages of every sparse buffer (flushed, or
        declared written straight to host pages): how far history may advance (SAFE-2)."""
        h, c, flushed = self._lengths()
        return rules.written_prefix(h, c, flushed, self._declared, self._shapes, max, min)

    @property
    def host_direct_end(self) -> int:
        """The end of the host-direct range: the largest in-flight start over the selection
        groups (history without sparse layers); ``record_host_write`` may declare up to it."""
        h, c, _ = self._lengths()
        return rules.host_direct_end(h, c, self._shapes, max)

    @property
    def closed(self) -> bool:
        return self.state == CLOSED

    @property
    def suspended(self) -> bool:
        return self.state == SUSPENDED

    def pages(self, group: int) -> list[int]:
        """A copy of the page list of pool group ``group``: slot ids of pages ``0 ..
        ceil(capacity/P) - 1`` (and of any reserve pages beyond), BAD for released pages and
        for pages in the host tier (suspended with ``offload``). After a resume on CUDA the
        current stream first waits for the pages' copy back (no host wait)."""
        self._check_open()
        self._check_group(group)
        self._await_pages()
        return self._pages[group, :self._live[group][1]].tolist()

    @property
    def returning_bytes(self) -> int:
        """Bytes of the dense pages a ``resume`` brings back from the host tier whose copy is
        not issued yet: it goes in pieces, one per ``Batch.publish`` (``resume_piece_bytes`` of
        the manager), and whatever is left is issued at once when the pages are first read (the
        publish that seats the row, ``host_pages``, ...). An engine seats a request resumed
        detached once this is 0, so no step shares the link with more than a piece. 0 when
        nothing is coming back."""
        self._check_open()
        return 0 if self._arrival is None else self._arrival.pending_bytes(self.manager.storage)

    @property
    def offloaded(self) -> bool:
        """Whether some of the cache's dense pages are in the host tier (``suspend(offload)``)."""
        return self._offload is not None and self._offload.pages > 0

    def offloaded_pages(self) -> list[int]:
        """Per pool group, how many of the cache's pages are in the host tier (0 for sparse
        groups and when not offloaded): the GPU slots ``resume()`` needs."""
        self._check_open()
        n = len(self._live)
        return [0] * n if self._offload is None else self._offload.needs(n)

    def host_pages(self, layer: str, role: str) -> "np.ndarray":
        """The page indices of this request's pages of one buffer in its view
        ``manager.buffer_view(layer, role)`` (token ``t`` is ``view[idx[t // P], :, t % P]``),
        int64[pages], BAD for released pages. Works for any open cache: seated, suspended or
        detached (the way to read or prefill a request's host pages outside a batch); the
        dense pages of a cache suspended with ``offload`` are in the host tier and read BAD
        here (``export`` reads them). After a resume on CUDA the current stream first waits
        for the pages' copy back (no host wait), so reads queued on it afterwards see them."""
        self._check_open()
        self._await_pages()
        place = self.manager.storage.place(layer, role)
        if place.group is None:
            raise KeyError(f"buffer {role!r} of layer {layer!r} is zero-size: it has no pages")
        scale = self.manager.storage.groups[place.group].scale
        slots = self._pages[place.group, :self._live[place.group][1]].astype(np.int64)
        return np.where(slots >= 0, slots * scale + place.pos, BAD)

    # ---- REQ-1..3 ----
    def resize(self, capacity: Optional[int] = None, history: Optional[int] = None) -> bool:
        """Grow or shrink capacity (allocating or freeing pages) and advance history.

        Raises ``ValueError`` for impossible lengths (history decreasing, above capacity or past
        what is on host pages (SAFE-2), capacity beyond ``max_tokens_per_row``) and for a change
        the write contract forbids (docs/HOST_PATH.md): growth whose in-flight start passes
        unflushed in-flight tokens, or a change that brings tokens already on host pages back
        into the in-flight range. ``RuntimeError`` for a closed or suspended cache or during
        stream capture. Returns False, with nothing changed, when the pools cannot supply the
        pages.
        """
        self._check_open()
        refuse_during_capture(self.manager.config.device, "KVCache.resize")
        if self.suspended:
            raise RuntimeError("KVCache.resize: the cache is suspended; resume() it first")
        self._current("KVCache.resize")
        c = self._c if capacity is None else check_int("capacity", capacity)
        h = self._h if history is None else check_int("history", history)
        self._check_lengths(h, c)
        return self._apply(h, c)

    def _check_lengths(self, h: int, c: int) -> None:
        """Every rule of a resize to (h, c) (``lengths.resize_violations``), raising ValueError
        for the first one broken; changes nothing."""
        config = self.manager.config
        h0, c0 = (0, 0) if self._table is None else self._table._cell_lengths(self._row)
        cells = (h0, c0, min(c0, self._lowest_capacity))  # a shrink cut the rest off
        for rule, violated, d in rules.resize_violations(
                self._h, self._c, h, c, self._flushed, self._declared, cells, self._shapes,
                config.max_tokens_per_row, config.max_total_input_tokens, max, min):
            if violated:
                raise ValueError(cite(self._message(rule, h, c, d)))

    def _message(self, rule: str, h: int, c: int, d: dict) -> str:
        config = self.manager.config
        if rule == "decrease":
            return f"REQ-2: history cannot decrease ({self._h} -> {h})"
        if rule == "above":
            return f"REQ-2: history ({h}) cannot exceed capacity ({c})"
        if rule == "limit":
            return f"REQ-2: capacity ({c}) exceeds max_tokens_per_row ({config.max_tokens_per_row})"
        if rule == "safe":
            return (f"SAFE-2: history ({h}) cannot pass what was flushed or declared written to "
                    f"host pages ({d['safe']}); flush the in-flight tokens, or declare tokens "
                    f"written straight to host pages with record_host_write(), first")
        if rule == "width":
            return (f"CFG-3: an in-flight range of {d['width']} tokens exceeds "
                    f"max_total_input_tokens ({config.max_total_input_tokens})")
        (U, I), (lo, hi) = d["shape"], d["range"]
        if rule == "lost":
            return (f"SAFE-1: capacity {c} moves the in-flight start (tokens_per_unit {U}, "
                    f"max_inflight_tokens {I}) past tokens [{lo}, {hi}), which are in cells and "
                    f"not flushed; flush them (Batch.flush) before growing this far")
        return (f"SAFE-1: lengths (history {h}, capacity {c}) bring tokens [{lo}, {hi}), already "
                f"on host pages, back into the in-flight range (tokens_per_unit {U}, "
                f"max_inflight_tokens {I}), whose cells do not hold them; advance history over "
                f"them first, or shrink capacity to at most {lo}")

    def _apply(self, h: int, c: int, grow_only: bool = False) -> bool:
        """Allocate and free pages for lengths (h, c) and take them; False (nothing changed) when
        a pool group cannot supply the pages. The lengths must have passed the checks.
        ``grow_only``: no page beyond the live range's start is freed (``retake_pages``)."""
        groups = self.manager.storage.groups
        plans = [self._plan(group, h, c, grow_only) for group in groups]
        if all(first == live[0] and keep == live[1] for (first, keep), live in zip(plans, self._live)):
            # no page enters or leaves a live range (most decode steps): the lengths only
            changed = (h, c) != (self._h, self._c)
            self._take_lengths(h, c)
            if changed and self._table is not None:
                self._table._changed(self._row)
            return True
        # the window's new pages, and sink pages not allocated yet (a jump past the window)
        needs = [max(keep - max(live[1], first), 0) + max(min(sinks, first) - live[1], 0)
                 for (first, keep), live, sinks in zip(plans, self._live, self._sinks)]
        allocated = self.manager.storage.allocate_slots(needs)
        if allocated is None:
            self.manager.counts.allocations_failed += 1
            logger.debug("request %d: %s pages per pool group not available", self.request_id,
                         needs)
            return False
        taken = [(group, slots if n else None) for group, slots, n in zip(groups, allocated, needs)]
        if self._arrival is not None and any(first > live[0] or keep < live[1]
                                             for (first, keep), live in zip(plans, self._live)):
            self._await_pages()  # pages are freed: a resume's copy into them must come first
        changed = (h, c) != (self._h, self._c)
        for (group, slots), (first, keep) in zip(taken, plans):
            row, live = self._pages[group.index], self._live[group.index]
            old_first, old_keep = live
            changed = changed or (first, keep) != (old_first, old_keep)
            front_start, front_end = max(old_first, self._sinks[group.index]), min(first, old_keep)
            if front_end > front_start:  # REQ-3: wholly before h - window, past the sinks
                group.release(row[front_start:front_end])
                row[front_start:front_end] = BAD
            if keep < old_keep:
                lo = max(keep, old_first)
                group.release(row[lo:old_keep])
                row[lo:old_keep] = BAD
            if slots is not None:
                sink_end = min(self._sinks[group.index], first)
                new_sinks = max(sink_end - old_keep, 0)  # TIER-3: kept below the window
                row[old_keep:old_keep + new_sinks] = slots[:new_sinks]
                row[max(old_keep, first):keep] = slots[new_sinks:]
            if (first, keep) != (old_first, old_keep):
                self._pages_moved = True
            live[0], live[1] = first, keep
            self._lowest_keep[group.index] = min(self._lowest_keep[group.index], keep)
        self._take_lengths(h, c)
        if changed and self._table is not None:
            self._table._changed(self._row)
        return True

    def _take_lengths(self, h: int, c: int) -> None:
        """Lengths (h, c) whose pages are in place."""
        self._h, self._c = h, c
        self._lowest_capacity = min(self._lowest_capacity, c)
        self._flushed = min(self._flushed, c)  # tokens cut off by a shrink are gone
        self._declared = min(self._declared, c)

    def _plan(self, group, h: int, c: int, grow_only: bool = False) -> tuple[int, int]:
        """(first live page, allocated pages) of a pool group for lengths (h, c); ``grow_only``
        keeps at least the pages allocated now."""
        P, limit = self._page_tokens, self._max_tokens
        keep = -(-min(c + self._reserve, limit) // P) if c else 0
        if grow_only:
            keep = max(keep, self._live[group.index][1])
        first = max(self._live[group.index][0],
                    min(rules.first_live_page(h, P, group.window), keep))  # REQ-3
        return first, keep

    def _held(self, group: int) -> list:
        """The page ranges ``[lo, hi)`` the cache holds in pool group ``group``: the sink pages
        ``[0, min(sink pages, first_live))`` (TIER-3) and ``[first_live, allocated)``, non-empty
        ones only; every other entry of its page row is BAD."""
        first, keep = self._live[group]
        return [(lo, hi) for lo, hi in ((0, min(self._sinks[group], first)), (first, keep))
                if lo < hi]

    def _written(self) -> int:
        return rules.written_prefix(self._h, self._c, self._flushed, self._declared,
                                    self._shapes, max, min)

    # ---- the write contract (docs/HOST_PATH.md) ----
    def record_host_write(self, end: int) -> None:
        """Declare that the caller wrote this request's host-direct tokens below ``end``
        straight to host pages, for every sparse buffer of every sparse layer (the prefill
        path: ``Batch.host_token_indices`` or ``host_pages``). For each selection group the
        declaration covers ``[history, min(end, s0))``, s0 its in-flight start; ``end`` may be
        at most the largest in-flight start (tokens beyond it are in cells: flush them).
        History may then advance over them (SAFE-2). Raises ValueError for a bad ``end``."""
        self._check_open()
        refuse_during_capture(self.manager.config.device, "KVCache.record_host_write")
        self._current("KVCache.record_host_write")
        end = check_int("end", end)
        bound = self.host_direct_end
        if end > bound:
            raise ValueError(
                f"record_host_write: end ({end}) is past the host-direct range, which ends at "
                f"{bound} (history {self._h}, capacity {self._c}); tokens from {bound} on are "
                f"in flight: write them into cells and flush them")
        self.manager.counts.declared(self._h, self._c, self._declared, end)
        self._declared = max(self._declared, end)
        if self._table is not None:
            self._table._declared(self._row)

    def set_reserve(self, tokens: int) -> None:
        """Keep pages allocated for ``tokens`` tokens beyond capacity (rounded up to whole pages,
        at most ``max_tokens_per_row``), so that ``Batch.advance`` can grow capacity on the
        device without the host. Takes effect at the next ``resize`` (``resize()`` with no
        arguments allocates them now)."""
        self._check_open()
        tokens = check_int("tokens", tokens)
        if tokens != self._reserve and self._table is not None:
            self._table._reserve_set(self._row)
        self._reserve = tokens

    def _record_flush(self, h: int, c: int, target: int) -> None:
        """A flush of lengths (h, c) to ``target`` ran (Batch.flush / Batch.record_flush)."""
        self._flushed = rules.flushed_watermark(h, c, self._flushed, self._declared, target,
                                                self._shapes, max, min, rules.pick)

    # ---- prefix sharing (PFX-1..3, docs/PREFIX.md) ----
    def commit(self, token_ids) -> int:
        """Offer this request's whole pages of ``token_ids`` for reuse (PFX-1): page ``i``,
        under the key of ``token_ids[:(i+1)*P]``, in every pool group that holds it (a windowed
        group's pages behind its window are gone and are not offered). ``token_ids`` are the
        request's token ids from position 0 (a list of ints, a CPU integer tensor or a numpy
        integer array); its whole pages must lie within ``history_length`` (final tokens, on
        their host pages); a partial last page is not committed. Committed pages are never
        written again (PFX-3: history only grows, so nothing writes below it). Idempotent and
        copy-free; a page whose content another cache already committed stays private.
        Returns the tokens of ``token_ids``'s whole pages, all of which are now offered: each
        page was committed by this call or before, or stays private because another cache
        committed equal content first (``stats()["prefix"]`` counts entries). Raises TypeError / ValueError
        (wrong type or dtype, negative ids, pages beyond history, ids disagreeing with the
        ones a page was shared or committed under) and RuntimeError (closed cache, closed
        manager, stream capture, dense pages in the host tier: resume first), each with
        nothing changed."""
        self._check_open()
        refuse_during_capture(self.manager.config.device, "KVCache.commit")
        if self.offloaded:
            raise RuntimeError("KVCache.commit: the cache's dense pages are in the host tier "
                               "(suspended with offload); resume() it first")
        ids = token_array("token_ids", token_ids)
        self._current("KVCache.commit")
        P = self._page_tokens
        pages = len(ids) // P
        if pages * P > self._h:
            raise ValueError(
                f"commit: token_ids has {pages} whole pages ({pages * P} tokens) but history holds "
                f"{self._h} tokens ({self._h // P} whole pages); commit at most "
                f"token_ids[:history_length]")
        storage = self.manager.storage
        self._await_pages()  # sharers read these pages on the current stream
        storage.prefix.commit(ids, pages, self._pages, self._live)  # BAD between sinks and window
        return pages * P

    def _start_shared(self, pages: int, entries: np.ndarray) -> None:
        """Take ``pages`` committed pages (``entries``, page order) as this new cache's first
        pages: a reference to each slot, lengths and watermarks at the shared length (PFX-2).
        The match guaranteed every slot the lengths need; nothing is allocated."""
        storage = self.manager.storage
        h = pages * self._page_tokens
        for group in storage.groups:
            self._live[group.index][:] = self._plan(group, h, h)
            for lo, hi in self._held(group.index):  # the sink pages too (TIER-3)
                slots = storage.prefix.slots_of(entries[lo:hi], group.index)
                group.reference(slots)
                self._pages[group.index, lo:hi] = slots
        storage.prefix.touch(entries)
        self._h = self._c = self._flushed = self._declared = h
        self.reused_tokens = h
        self._pages_moved = True

    # ---- moving between managers (TIER-2, torch_kvcm2/transfer.py) ----
    def export(self, token_ids=None) -> CacheRecord:
        """A self-contained copy of this request's final tokens (``transfer.CacheRecord``): the
        config fields an importer must match, ``history_length``, ``token_ids`` when given (a
        list of ints, a CPU integer tensor or a numpy integer array; stored as int64) and every
        buffer's pages of tokens ``[0, history)`` as CPU uint8 tensors in the page layout (a
        windowed layer's live pages only). Reads only; the cache may be seated, suspended or
        detached (dense pages in the host tier are read there, once their copy has ended). Raises RuntimeError while tokens are in flight (history < capacity: flush and
        advance history, or ``resize(capacity=history_length)``, first), for a closed cache or
        manager, and during stream capture; TypeError / ValueError for bad ``token_ids``."""
        self._check_open()
        self._current("KVCache.export")
        return export_record(self, token_ids)

    def _start_imported(self, history: int, write) -> bool:
        """Take pages for lengths (history, history) on this new cache, let ``write(self)`` put
        every byte of ``[0, history)`` on them, and declare those tokens written straight to
        host pages (what ``record_host_write`` declares; its bound, the in-flight start, stops
        short of capacity, and an imported cache has nothing in flight). False, with nothing
        taken, when the pools cannot supply the pages; a failing ``write`` frees them."""
        if not self._apply(history, history):
            return False
        try:
            write(self)
        except BaseException:
            self.close()
            raise
        self._declared = history
        return True

    # ---- REQ-4, TIER-1 ----
    def suspend(self, offload: Optional[bool] = None) -> bool:
        """Give up the cells (lease); the row publishes BAD / 0. Refused (RuntimeError) while
        tokens are in flight (history < capacity), when already suspended, and during stream
        capture.

        ``offload`` (TIER-1, default: whether the manager has a host tier, ``host_tier_bytes``):
        copy every dense page no other cache references to the host tier of its pool group and
        free its GPU slot, so the request holds no GPU pool bytes beyond shared prefix pages
        (which stay, with this cache's reference). Sparse pages are host pages already and
        stay. On CUDA the copy runs on the manager's copy stream after the current stream's
        queued work, and the freed slots are fenced until it ends (``tiers.py``); nothing waits
        on the host. Returns True once suspended; False, with nothing changed, when the host
        tier cannot take the pages (full, or its memory cannot be committed). ``offload=True``
        without a host tier raises ValueError. Without ``offload`` the pages stay (REQ-4)."""
        self._check_open()
        refuse_during_capture(self.manager.config.device, "KVCache.suspend")
        if self.suspended:
            raise RuntimeError("KVCache.suspend: already suspended")
        self._current("KVCache.suspend")
        if self._h < self._c:
            raise RuntimeError(
                f"KVCache.suspend: tokens are in flight (history {self._h} < capacity "
                f"{self._c}); flush and advance history, or shrink capacity, first")
        tier = self.manager.tier
        if offload is None:
            offload = tier.enabled
        elif not isinstance(offload, bool):
            raise TypeError(f"KVCache.suspend: offload must be a bool or None, got {offload!r}")
        if offload:
            if not tier.enabled:
                raise ValueError("KVCache.suspend: offload=True needs a host tier; create the "
                                 "manager with host_tier_bytes > 0")
            self._await_pages()  # a resume's copy into these pages comes first
            moved = tier.offload(self._pages, [self._held(g) for g in range(len(self._live))])
            if moved is None:
                self.manager.counts.allocations_failed += 1
                logger.debug("request %d: the host tier cannot take its dense pages",
                             self.request_id)
                return False
            self._offload = moved if moved.pages else None
            if moved.pages:
                self._pages_moved = True
                self.manager.counts.offloads += 1
        self.state = SUSPENDED
        self.manager.counts.preemptions += 1
        if self._table is not None:
            self._table._release_lease(self._row)
        return True

    def resume(self) -> bool:
        """Take a fresh, empty lease (when seated in a batch). Pages in the host tier
        (``suspend(offload=True)``) come back into free GPU slots of their pool groups (any
        slots: the page entries change, and the row's next publish uploads them; per-step calls
        are refused until then, BAT-4). The copy back goes in pieces (``returning_bytes``): the
        first now, one per ``Batch.publish`` after, the rest at once when the pages are first
        read. On CUDA the copies run on the copy stream and the publish that first seats the
        row makes the current stream wait for the last piece (as do ``host_pages``, ``pages``,
        ``commit``, ``export``, a shrink and ``close``): no host wait. Returns True once
        resumed; False, with nothing changed, when the GPU pools cannot supply the slots
        (``KVCacheManager.can_fit(tokens, resuming=[cache])`` says so beforehand). Raises RuntimeError when not suspended or during stream capture."""
        self._check_open()
        refuse_during_capture(self.manager.config.device, "KVCache.resume")
        if not self.suspended:
            raise RuntimeError("KVCache.resume: the cache is not suspended")
        if self._offload is not None:
            done = self.manager.tier.restore(self._offload, self._pages)
            if done is None:
                self.manager.counts.allocations_failed += 1
                logger.debug("request %d: %s GPU pages per pool group not available to resume",
                             self.request_id, self._offload.needs(len(self._live)))
                return False
            self._arrival, moved = done
            for group in moved:  # entries from the lowest page brought back on have new slots
                lowest = int(self._offload.ordinals[group].min())
                self._lowest_keep[group] = min(self._lowest_keep[group], lowest)
            self._pages_moved = True
            self._offload = None
        if self._table is not None:
            self._table._grant_lease(self._row)
        self.state = ACTIVE
        self.manager.counts.resumes += 1
        return True

    def close(self) -> None:
        """The abort path: leave the batch discarding any in-flight tokens, and free every page
        (host tier pages included). Every later call raises RuntimeError, except ``close``,
        which does nothing again (nor after the manager's close, which released everything)."""
        if self.state == CLOSED:
            return
        if self.manager.closed:
            self.state = CLOSED
            return
        self._check_open()
        refuse_during_capture(self.manager.config.device, "KVCache.close")
        if self._table is not None:
            self._table._leave(self)
        elif self._c > self._h:  # in-flight tokens dropped (a seated cache: _discard_in_flight)
            self.manager.counts.aborts += 1
        self._await_pages()
        if self._offload is not None:
            self.manager.tier.discard(self._offload)
            self._offload = None
        for group, row, live in zip(self.manager.storage.groups, self._pages, self._live):
            for lo, hi in self._held(group.index):
                slots = row[lo:hi]
                group.release(slots[slots >= 0])  # pages in the host tier have no GPU slot
            row[:] = BAD
            live[0] = live[1] = 0
        self._h = self._c = 0
        self.state = CLOSED

    def _await_pages(self) -> None:
        """After a resume: what is left of the copy of the pages back is issued now, and on
        CUDA the current stream waits for its last piece (once; a stream wait, never a host
        wait)."""
        if self._arrival is not None:
            event = self.manager.tier.complete(self._arrival)
            if event is not None and not event.query():
                torch.cuda.current_stream(self.manager.config.device).wait_event(event)
            self._arrival = None

    def _tier_pages(self, group: int) -> Optional[tuple]:
        """(the host tier's pool ``uint8[num_slots, scale, page_bytes]``, int64 tier slot per
        page ordinal of the live range's end, BAD for pages not there, the copy's event) of
        pool group ``group`` while pages are offloaded; None otherwise."""
        if self._offload is None or group not in self._offload.ordinals:
            return None
        tier = self.manager.storage.tiers[group]
        return (tier.data, self._offload.tier_index(group, self._live[group][1]),
                self._offload.event)

    # ---- the row table's side of the protocol (rows.py) ----
    def _page_row(self, group: int) -> np.ndarray:
        """The cache's page row of a pool group (int32[max_pages_per_row], BAD outside the live
        range); read-only for the batch."""
        return self._pages[group]

    def _live_range(self, group: int) -> tuple[int, int, int, int]:
        """(sink pages held, first live page, allocated pages, the fewest pages allocated since
        the batch last published this cache): entries ``[0, sink pages)`` and ``[first,
        allocated)`` hold slots (TIER-3), and those from the last one on may have new slots."""
        first, keep = self._live[group]
        return min(self._sinks[group], first), first, keep, self._lowest_keep[group]

    def _mark_published(self) -> None:
        """The batch published this cache's lengths and pages."""
        self._lowest_capacity = self._c
        if self._pages_moved:
            self._lowest_keep = [keep for _, keep in self._live]
            self._pages_moved = False

    def _retake_pages(self, grow_only: bool = False) -> bool:
        """Plan the pages of the current lengths again: the reserve beyond capacity and the
        window's releases, after ``Batch.advance`` moved the lengths on the device (the batch
        calls it at publish, from the lengths read back so far). The
        lengths do not change, so no rule of ``resize`` can break; False, with nothing changed,
        when the pools cannot supply the pages (the row's advance then stops at its pages,
        counted as short). ``grow_only`` (lengths older than the device's: a read-back in
        flight) frees no page at the end of the live range, so a smaller reserve never takes
        pages the device's capacity already reached; windowed releases still happen."""
        if self._table is not None:
            self._table.take_device_lengths(self._row, None)
        return self._apply(self._h, self._c, grow_only)

    def _lengths_row(self) -> tuple[int, int, int, int, int, int]:
        """(history, capacity, written, declared, allocated tokens, reserve tokens) as the batch
        publishes them."""
        P = self._page_tokens
        keep = self._live[0][1] if self._live else -(-self._c // P)
        allocated = min(keep * P, self._max_tokens)
        # without sparse layers nothing is flushed: history may advance through capacity
        # (written_prefix), so the device's advance is bounded by the row's ceiling only
        written = self._flushed if self._shapes else self._max_tokens
        return self._h, self._c, written, self._declared, allocated, self._reserve

    def _pages_unmoved(self) -> bool:
        """No page moved since the batch last published this cache: a publish of its row then
        sends its lengths only (and calls ``mark_published`` once the delta is uploaded)."""
        return not self._pages_moved

    def _take_written(self, written: int) -> None:
        """The written watermark after a flush, as the batch computed it for this row."""
        self._flushed = max(self._flushed, written)

    def _take_device_lengths(self, h: int, c: int, written: int) -> None:
        """Lengths advanced on the device (Batch.advance), as the batch read them back."""
        self._h, self._c = h, c
        self._lowest_capacity = c
        self._flushed = max(self._flushed, written)

    def _take_resize(self, h: int, c: int) -> None:
        """Lengths (h, c) that ``Batch.resize_rows`` checked by resize's rules and that keep
        every page where it is (no page enters or leaves the live range)."""
        self._take_lengths(h, c)

    def _discard_in_flight(self) -> None:
        """Drop the tokens in flight: capacity shrinks back to history (the abort path)."""
        if self._c > self._h:
            self.manager.counts.aborts += 1
            self._apply(self._h, self._h)  # a shrink: always succeeds, breaks no rule

    def _seat(self, table, row: Optional[int]) -> None:
        self._table, self._row = table, row

    @property
    def seated_in(self):
        """(batch, row) of the batch this cache is seated in, or (None, None)."""
        return (None if self._table is None else self._table.batch), self._row

    @property
    def reserve_tokens(self) -> int:
        """Tokens of pages kept allocated beyond capacity (``set_reserve``)."""
        return self._reserve

    # ---- internals ----
    def _lengths(self) -> tuple[int, int, int]:
        """(history, capacity, flushed watermark) as the host knows them now: the cache's own,
        or, while seated, those of its batch's last applied read-back of the device lengths
        when they are newer. Changes nothing and never waits."""
        if self._table is None:
            return self._h, self._c, self._flushed
        return self._table.lengths_of(self._row, self._h, self._c, self._flushed)

    def _current(self, what: str) -> None:
        """Before a call that changes the cache from its lengths: refuse (RuntimeError naming
        ``Batch.poll``) while its batch has device lengths the host has not read back, then take
        the newest lengths read back."""
        if self._table is not None:
            self._table.take_device_lengths(self._row, what)

    def _check_open(self) -> None:
        self.manager.check_open(f"request {self.request_id}")
        if self.state == CLOSED:
            raise RuntimeError(f"request {self.request_id}: the cache is closed")

    def _check_group(self, group) -> None:
        if isinstance(group, bool) or not isinstance(group, int) or not 0 <= group < len(self._live):
            raise ValueError(f"group must be a pool group index in [0, {len(self._live)}), "
                             f"got {group!r}")
