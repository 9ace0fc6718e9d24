"""Requests (REQUIREMENTS §5, REQ-1..4): one ``KVCache`` per request.

A ``KVCache`` is a handle: its slot in the manager's request table (``request_table.py``, which
holds every request's pages, live ranges, lengths and watermarks) and the manager. A request's
pages are one int32 row per pool group: page ordinal -> slot id, BAD outside the live range
``[first_live, allocated)`` and, in a windowed group with sink tokens, the sink pages ``[0,
min(sink pages, first_live))``, TIER-3. Each page it holds is one reference to its slot: a cache
created from a committed prefix (``create_cache(token_ids)``) starts with references to shared
slots, and every write path reaches only pages at or above its history (docs/PREFIX.md). Every
call validates before it changes anything; a ``resize`` that cannot be satisfied returns False
and leaves the cache exactly as it was. A resize costs what changes: the pages allocated or
freed, never a loop over the pages a row holds.

A seated cache tells its batch's row table what changed through the row table's seat interface
(``rows.RowTable``: ``mark_changed``, ``mark_declared``, ``mark_reserve``, ``grant_lease``,
``release_lease``, ``cell_lengths``, ``lengths_of``, ``take_device_lengths``, ``leave``).

A cache suspended with ``offload=True`` (TIER-1, ``tiers.py``) holds its private dense pages in
the host tier: their page entries read BAD until ``resume`` brings them back.
"""
from __future__ import annotations

import logging
from typing import Optional

import numpy as np

from . import lengths as rules
from ._util import check_int, cite, refuse_during_capture
from .config import BAD
from .prefix import token_array
from .request_table import ACTIVE, C, CLOSED, DECLARED, FLUSHED, H, LOWEST, RESERVE, SUSPENDED
from .transfer import CacheRecord, export_record

__all__ = ["KVCache", "ACTIVE", "SUSPENDED", "CLOSED"]

logger = logging.getLogger(__name__)


class KVCache:
    """The KV cache of one request: a handle on its slot of the manager's request table.

    ``capacity`` c: positions ``[0, c)`` have pages; ``history_length`` h: positions ``[0, h)``
    are final (held by the host pages of sparse buffers). Created by
    ``KVCacheManager.create_cache()``. ``manager`` is the KVCacheManager that made it; ``slot``
    its slot in ``manager.requests`` (None once closed: the slot goes to another request).
    """

    def __init__(self, manager, request_id: int):
        self.manager = manager
        self.request_id = request_id
        self._requests = manager.requests
        self.slot: Optional[int] = self._requests.open()
        self.reused_tokens = 0  # tokens shared from committed pages at creation (PFX-2)

    def __repr__(self):
        if self.slot is None:
            return f"KVCache(request_id={self.request_id}, state='closed')"
        return (f"KVCache(request_id={self.request_id}, capacity={self.capacity}, "
                f"history_length={self.history_length}, state={self.state!r})")

    # ---- inspection ----
    @property
    def state(self) -> str:
        """"active", "suspended" or "closed"."""
        return CLOSED if self.slot is None else self._requests.state[self.slot]

    @property
    def capacity(self) -> int:
        """Positions ``[0, capacity)`` have pages. Like every getter it reads what the host
        knows, changing nothing and never waiting: lengths ``Batch.advance`` moved on the device
        show once ``Batch.poll()`` has read them back. 0 once closed."""
        return self._lengths()[1]

    @property
    def history_length(self) -> int:
        """Positions ``[0, history_length)`` are final (on the host pages of sparse buffers);
        as of the last ``Batch.poll()`` (see ``capacity``). 0 once closed."""
        return self._lengths()[0]

    @property
    def written(self) -> int:
        """Tokens ``[0, written)`` are on the host pages of every sparse buffer (flushed, or
        declared written straight to host pages): how far history may advance (SAFE-2)."""
        if self.slot is None:
            return 0
        h, c, flushed = self._lengths()
        return self._requests.written(h, c, flushed, self.slot)

    @property
    def host_direct_end(self) -> int:
        """The end of the host-direct range: the largest in-flight start over the selection
        groups (history without sparse layers); ``record_host_write`` may declare up to it."""
        h, c, _ = self._lengths()
        return rules.host_direct_end(h, c, self._requests.shapes, max)

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
        req = self._requests
        req.await_pages(self.slot)
        return req.pages[self.slot, group, :int(req.live[self.slot, group, 1])].tolist()

    @property
    def returning_bytes(self) -> int:
        """Bytes of the dense pages a ``resume`` brings back from the host tier whose copy is
        not issued yet: it goes in pieces, one per ``Batch.publish`` (``resume_piece_bytes`` of
        the manager), and whatever is left is issued at once when the pages are first read (the
        publish that seats the row, ``host_pages``, ...). An engine seats a request resumed
        detached once this is 0, so no step shares the link with more than a piece. 0 when
        nothing is coming back."""
        self._check_open()
        arrival = self._requests.arrival[self.slot]
        return 0 if arrival is None else arrival.pending_bytes(self.manager.storage)

    @property
    def offloaded(self) -> bool:
        """Whether some of the cache's dense pages are in the host tier (``suspend(offload)``)."""
        offload = None if self.slot is None else self._requests.offload[self.slot]
        return offload is not None and offload.pages > 0

    def offloaded_pages(self) -> list[int]:
        """Per pool group, how many of the cache's pages are in the host tier (0 for sparse
        groups and when not offloaded): the GPU slots ``resume()`` needs."""
        self._check_open()
        n, offload = self._requests.G, self._requests.offload[self.slot]
        return [0] * n if offload is None else offload.needs(n)

    def host_pages(self, layer: str, role: str) -> "np.ndarray":
        """The page indices of this request's pages of one buffer in its view
        ``manager.buffer_view(layer, role)`` (token ``t`` is ``view[idx[t // P], :, t % P]``),
        int64[pages], BAD for released pages. Works for any open cache: seated, suspended or
        detached (the way to read or prefill a request's host pages outside a batch); the
        dense pages of a cache suspended with ``offload`` are in the host tier and read BAD
        here (``export`` reads them). After a resume on CUDA the current stream first waits
        for the pages' copy back (no host wait), so reads queued on it afterwards see them."""
        self._check_open()
        req = self._requests
        req.await_pages(self.slot)
        info = self.manager.buffer(layer, role)
        if info.pool_group is None:
            raise KeyError(f"buffer {role!r} of layer {layer!r} is zero-size: it has no pages")
        g = info.pool_group
        slots = req.pages[self.slot, g, :int(req.live[self.slot, g, 1])].astype(np.int64)
        return np.where(slots >= 0, slots * info.scale + info.pos, BAD)

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
        h0, c0 = self._requests.own_lengths(self.slot)[:2]
        c = c0 if capacity is None else check_int("capacity", capacity)
        h = h0 if history is None else check_int("history", history)
        self._check_lengths(h, c)
        return self._apply(h, c)

    def _check_lengths(self, h: int, c: int) -> None:
        """Every rule of a resize to (h, c) (``lengths.resize_violations``), raising ValueError
        for the first one broken; changes nothing."""
        config, req, slot = self.manager.config, self._requests, self.slot
        seat = req.seat[slot]
        h0, c0 = (0, 0) if seat is None else seat[0].cell_lengths(seat[1])
        L = req.lengths[slot].tolist()
        cells = (h0, c0, min(c0, L[LOWEST]))  # a shrink cut the rest off
        for rule, violated, d in rules.resize_violations(
                L[H], L[C], h, c, L[FLUSHED], L[DECLARED], cells, req.shapes,
                config.max_tokens_per_row, config.max_total_input_tokens, max, min):
            if violated:
                raise ValueError(cite(self._message(rule, L[H], h, c, d)))

    def _message(self, rule: str, h0: int, h: int, c: int, d: dict) -> str:
        config = self.manager.config
        if rule == "decrease":
            return f"REQ-2: history cannot decrease ({h0} -> {h})"
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

    def _apply(self, h: int, c: int) -> bool:
        """Take lengths (h, c) with their pages (``RequestTable.apply``) and tell the row table
        when something changed; False (nothing changed) when the pools cannot supply them."""
        changed = self._requests.apply(self.slot, h, c)
        if changed is None:
            logger.debug("request %d: pages not available for lengths (%d, %d)",
                         self.request_id, h, c)
            return False
        if changed:
            self._tell("mark_changed")
        return True

    def _tell(self, what: str) -> None:
        """Call the seat interface ``what(row)`` of the row table the cache is seated in."""
        seat = self._requests.seat[self.slot]
        if seat is not None:
            getattr(seat[0], what)(seat[1])

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
        L = self._requests.lengths[self.slot].tolist()
        if end > bound:
            raise ValueError(
                f"record_host_write: end ({end}) is past the host-direct range, which ends at "
                f"{bound} (history {L[H]}, capacity {L[C]}); tokens from {bound} on are "
                f"in flight: write them into cells and flush them")
        self.manager.counts.declared(L[H], L[C], L[DECLARED], end)
        self._requests.declare(self.slot, end)
        self._tell("mark_declared")

    def set_reserve(self, tokens: int) -> None:
        """Keep pages allocated for ``tokens`` tokens beyond capacity (rounded up to whole pages,
        at most ``max_tokens_per_row``), so that ``Batch.advance`` can grow capacity on the
        device without the host. Takes effect at the next ``resize`` (``resize()`` with no
        arguments allocates them now)."""
        self._check_open()
        tokens = check_int("tokens", tokens)
        if tokens != self.reserve_tokens:
            self._tell("mark_reserve")
        self._requests.lengths[self.slot, RESERVE] = tokens

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
        req, slot = self._requests, self.slot
        P, h = req.P, int(req.lengths[slot, H])
        pages = len(ids) // P
        if pages * P > h:
            raise ValueError(
                f"commit: token_ids has {pages} whole pages ({pages * P} tokens) but history holds "
                f"{h} tokens ({h // P} whole pages); commit at most token_ids[:history_length]")
        req.await_pages(slot)  # sharers read these pages on the current stream
        # BAD between sinks and window
        self.manager.storage.prefix.commit(ids, pages, req.pages[slot], req.live[slot])
        return pages * P

    # ---- moving between managers (TIER-2, torch_kvcm2/transfer.py) ----
    def export(self, token_ids=None) -> CacheRecord:
        """A self-contained copy of this request's final tokens (``transfer.CacheRecord``): the
        config fields an importer must match, ``history_length``, ``token_ids`` when given (a
        list of ints, a CPU integer tensor or a numpy integer array; stored as int64) and every
        buffer's pages of tokens ``[0, history)`` as CPU uint8 tensors in the page layout (a
        windowed layer's live pages only). Reads only; the cache may be seated, suspended or
        detached (dense pages in the host tier are read there, once their copy has ended).
        Raises RuntimeError while tokens are in flight (history < capacity: flush and advance
        history, or ``resize(capacity=history_length)``, first), for a closed cache or manager,
        and during stream capture; TypeError / ValueError for bad ``token_ids``."""
        self._check_open()
        self._current("KVCache.export")
        return export_record(self, token_ids)

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
        req, slot = self._requests, self.slot
        h, c = req.own_lengths(slot)[:2]
        if h < c:
            raise RuntimeError(
                f"KVCache.suspend: tokens are in flight (history {h} < capacity {c}); flush and "
                f"advance history, or shrink capacity, first")
        tier = self.manager.tier
        if offload is None:
            offload = tier.enabled
        elif not isinstance(offload, bool):
            raise TypeError(f"KVCache.suspend: offload must be a bool or None, got {offload!r}")
        if offload:
            if not tier.enabled:
                raise ValueError("KVCache.suspend: offload=True needs a host tier; create the "
                                 "manager with host_tier_bytes > 0")
            req.await_pages(slot)  # a resume's copy into these pages comes first
            moved = tier.offload(req.pages[slot], [req.held(slot, g) for g in range(req.G)])
            if moved is None:
                self.manager.counts.allocations_failed += 1
                logger.debug("request %d: the host tier cannot take its dense pages",
                             self.request_id)
                return False
            req.offload[slot] = moved if moved.pages else None
            if moved.pages:
                req.moved[slot] = True
                self.manager.counts.offloads += 1
        req.state[slot] = SUSPENDED
        self.manager.counts.preemptions += 1
        self._tell("release_lease")
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
        (``KVCacheManager.can_fit(tokens, resuming=[cache])`` says so beforehand). Raises
        RuntimeError when not suspended or during stream capture."""
        self._check_open()
        refuse_during_capture(self.manager.config.device, "KVCache.resume")
        if not self.suspended:
            raise RuntimeError("KVCache.resume: the cache is not suspended")
        req, slot = self._requests, self.slot
        offload = req.offload[slot]
        if offload is not None:
            done = self.manager.tier.restore(offload, req.pages[slot])
            if done is None:
                self.manager.counts.allocations_failed += 1
                logger.debug("request %d: %s GPU pages per pool group not available to resume",
                             self.request_id, offload.needs(req.G))
                return False
            req.arrival[slot], moved = done
            for group in moved:  # entries from the lowest page brought back on have new slots
                lowest = int(offload.ordinals[group].min())
                req.lowest_keep[slot, group] = min(int(req.lowest_keep[slot, group]), lowest)
            req.moved[slot] = True
            req.offload[slot] = None
        req.state[slot] = ACTIVE
        self._tell("grant_lease")
        self.manager.counts.resumes += 1
        return True

    def close(self) -> None:
        """The abort path: leave the batch discarding any in-flight tokens, and free every page
        (host tier pages included). Every later call raises RuntimeError, except ``close``,
        which does nothing again (nor after the manager's close, which released everything)."""
        if self.slot is None:
            return
        if self.manager.closed:
            self.slot = None
            return
        self._check_open()
        refuse_during_capture(self.manager.config.device, "KVCache.close")
        req, slot = self._requests, self.slot
        seat = req.seat[slot]
        if seat is not None:
            seat[0].leave(self)
        else:
            h, c = req.own_lengths(slot)[:2]
            if c > h:  # in-flight tokens dropped (a seated cache: RequestTable.discard_in_flight)
                self.manager.counts.aborts += 1
        req.free_pages(slot)
        req.release(slot)
        self.slot = None

    @property
    def seated_in(self):
        """(batch, row) of the batch this cache is seated in, or (None, None)."""
        seat = None if self.slot is None else self._requests.seat[self.slot]
        return (None, None) if seat is None else (seat[0].batch, seat[1])

    @property
    def reserve_tokens(self) -> int:
        """Tokens of pages kept allocated beyond capacity (``set_reserve``)."""
        return 0 if self.slot is None else int(self._requests.lengths[self.slot, RESERVE])

    # ---- internals ----
    def _lengths(self) -> tuple[int, int, int]:
        """(history, capacity, flushed watermark) as the host knows them now: the request
        table's, or, while seated, those of its batch's last applied read-back of the device
        lengths when they are newer. Changes nothing and never waits."""
        if self.slot is None:
            return 0, 0, 0
        req, slot = self._requests, self.slot
        h, c, flushed = req.lengths[slot, :3].tolist()  # history, capacity, flushed watermark
        seat = req.seat[slot]
        if seat is None:
            return h, c, flushed
        return seat[0].lengths_of(seat[1], h, c, flushed)

    def _current(self, what: str) -> None:
        """Before a call that changes the cache from its lengths: refuse (RuntimeError naming
        ``Batch.poll``) while its batch has device lengths the host has not read back, then take
        the newest lengths read back."""
        seat = self._requests.seat[self.slot]
        if seat is not None:
            seat[0].take_device_lengths(seat[1], what)

    def _check_open(self) -> None:
        self.manager.check_open(f"request {self.request_id}")
        if self.slot is None:
            raise RuntimeError(f"request {self.request_id}: the cache is closed")

    def _check_group(self, group) -> None:
        G = self._requests.G
        if isinstance(group, bool) or not isinstance(group, int) or not 0 <= group < G:
            raise ValueError(f"group must be a pool group index in [0, {G}), got {group!r}")
