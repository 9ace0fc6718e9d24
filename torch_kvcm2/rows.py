"""The row table of a batch (BAT-2..4, HOST-1..4): which cache sits in which row with which lease,
what of each row the device does not have yet, and ``publish``, which uploads it.

Every row has its flags, ``RowTable.state[row]``: a set of the ``RowFlags`` below
(none: the device, the host mirror and the cache agree). Host calls set flags, ``publish`` and
the read-back of the device lengths (``readback``) clear them:

=========== ============================================ =============================================
flag        set by                                       cleared by
=========== ============================================ =============================================
UPLOAD      a resize, seat, move, lease grant or release the next publish (per-step calls refused
            changing the row on the host                 until then)
NEW_LEASE   a lease granted to the row                   the next publish, which clears the lease's
                                                         residency; a release before it
DECLARED    a declaration of host writes only            the next publish (per-step calls still run)
RESERVE     ``KVCache.set_reserve``                      the next publish of the row
PAGES       a read-back showing the row moved past half  the next publish, which plans its pages
            its reserve, or (windowed) past a page
BEHIND      every applied read-back of the lengths       the cache taking the mirror's lengths when
                                                         a call next changes it
                                                         (``take_device_lengths``); getters read
                                                         through it (``lengths_of``)
=========== ============================================ =============================================

A removed row is a hole with UPLOAD alone; a moved cache takes its state to the new row.
``RowTable.marked`` records which of UPLOAD, DECLARED and PAGES some row may have, so a publish
with nothing to do scans no row.

The seat interface, which a seated ``KVCache`` calls: ``mark_changed(row)``,
``mark_declared(row)``, ``mark_reserve(row)``, ``grant_lease(row)``, ``release_lease(row)``,
``cell_lengths(row)``, ``lengths_of(row, ...)`` (its getters: no change, no wait),
``take_device_lengths(row, what)`` (before a change: refused, naming ``Batch.poll``, while a
read-back is outstanding) and ``leave(cache)`` (its close). The table reads and writes a seated
request's state through the manager's request table (``request_table.RequestTable``, by the
cache's ``slot``), never through the cache.
"""
from __future__ import annotations

import enum
import heapq
from typing import Optional

import numpy as np

from . import lengths as rules
from .gpu_history import GpuHistory
from .arguments import check_row, int_sequence
from .config import BAD
from .memory import ALLOCATED, CAPACITY, DECLARED, HISTORY, LEASE, WRITTEN
from ._util import refuse_during_capture


class RowFlags(enum.IntFlag):
    """The flags of a row (the module's table says who sets and clears each)."""

    UPLOAD = 1
    NEW_LEASE = 2
    DECLARED = 4
    RESERVE = 8
    PAGES = 16
    BEHIND = 32


UPLOAD, NEW_LEASE, DECLARED_ONLY, RESERVE, PAGES, BEHIND = (int(f) for f in RowFlags)
#: the flags that keep a row out of ``resize_rows``' vectorised path (its host state is ahead)
UNCLEAN = UPLOAD | DECLARED_ONLY | RESERVE | PAGES
#: the flags that make publish upload or plan something
PUBLISHED = UPLOAD | DECLARED_ONLY | PAGES


class RowTable:
    """Rows, leases, row flags and the publish of one batch (see the module docstring)."""

    def __init__(self, batch, mirror, step):
        self.batch, self.manager, self.config = batch, batch.manager, batch.config
        self.requests = batch.manager.requests  # every request's host state, by slot
        self.max_rows = R = batch.max_rows
        self.mirror = mirror  # tables.TableMirror: the device table store and its host copy
        self.readback = None  # readback.Readback, set by the batch right after
        self._clear_leases = step.clear_leases  # empties the residency of int64 device leases
        self.caches: list = [None] * R
        self.leases = [BAD] * R  # each row's lease as the next publish uploads it
        self.free_leases = list(range(R))  # a heap
        self.state = np.zeros(R, dtype=np.uint8)
        self.unpublished = False  # some row has UPLOAD: per-step calls are refused
        # which of UPLOAD, DECLARED and PAGES some row may have: publish scans the rows only
        # for those (a steady-state step sets none of them)
        self.marked = 0
        self.shapes = rules.shapes_of(self.config)
        self.windowed = any(g.window is not None for g in batch.manager.storage.groups)
        self.closed = False
        self.seated = self.leased = 0  # members, and members with a lease (metrics)
        self.gpu = GpuHistory(batch, mirror, step)  # RSD-1: rows whose history is on GPU pages

    def describe(self, row: int) -> RowFlags:
        """A row's flags (for messages and debugging)."""
        return RowFlags(int(self.state[row]))

    # ---- checks ----
    def check_host_call(self, what: str) -> None:
        self.manager.check_open(what)
        if self.closed:
            raise RuntimeError(f"{what}: the batch is closed")
        refuse_during_capture(self.config.device, what)

    def check_step(self, what: str) -> None:
        self.manager.check_open(what)
        if self.closed:
            raise RuntimeError(f"{what}: the batch is closed")
        if self.unpublished:
            raise RuntimeError(f"{what}: the batch has unpublished changes; call publish() first")

    @property
    def ready(self) -> bool:
        """What ``check_step`` asks, as a predicate (the eager calls; the check raises)."""
        return not self.unpublished and not self.closed and not self.manager.closed

    def _mark(self, row: int, flags: int) -> None:
        self.state[row] |= flags
        self.marked |= flags & PUBLISHED
        if flags & UPLOAD:
            self.unpublished = True

    def mark_pages(self, rows: np.ndarray) -> None:
        """PAGES for the rows of the bool mask ``rows`` (applied read-backs)."""
        self.state[rows] |= PAGES
        self.marked |= PAGES

    # ---- membership (BAT-2) ----
    def add(self, cache, row: Optional[int]) -> int:
        self.check_host_call("Batch.add")
        from .cache import KVCache  # the cache module imports nothing of the batch's
        if not isinstance(cache, KVCache):
            raise TypeError(f"Batch.add: expected a KVCache, got {type(cache).__name__}")
        if cache.manager is not self.manager:
            raise ValueError("Batch.add: the cache belongs to another manager")
        if cache.closed:
            raise RuntimeError("Batch.add: the cache is closed")
        seated_batch, seated_row = cache.seated_in
        if seated_batch is self.batch:
            raise ValueError(f"Batch.add: the cache is already seated at row {seated_row}")
        if seated_batch is not None:
            raise ValueError("Batch.add: the cache is a member of another batch")
        if row is None:
            row = next((r for r, c in enumerate(self.caches) if c is None), None)
            if row is None:
                raise RuntimeError(f"Batch.add: all {self.max_rows} rows are occupied")
        else:
            self._check_free_row(row, "Batch.add")
        self.requests.seat[cache.slot] = (self, row)
        self.caches[row] = cache
        self.seated += 1
        self.state[row] = 0
        self._mark(row, UPLOAD)
        if not cache.suspended:
            self.grant_lease(row)
        return row

    def remove(self, cache, discard: bool, closing: bool = False) -> None:
        self.check_host_call("Batch.remove")
        row = self.member_row(cache, "Batch.remove")
        # a closing cache frees every page whatever its lengths: it needs no poll
        self.take_device_lengths(row, None if closing else "Batch.remove")
        h, c = cache.history_length, cache.capacity
        if h < c:
            if not discard:
                raise RuntimeError(
                    f"Batch.remove: tokens are in flight (history {h} < capacity {c}); flush and "
                    f"advance history, or shrink capacity, first, or pass discard=True to drop "
                    f"them")
            self.requests.discard_in_flight(cache.slot)
        self.release_lease(row)
        self.caches[row] = None
        self.seated -= 1
        self.requests.seat[cache.slot] = None
        self.state[row] = 0
        self._mark(row, UPLOAD)

    def move(self, cache, row: int) -> None:
        self.check_host_call("Batch.move")
        old = self.member_row(cache, "Batch.move")
        self._check_free_row(row, "Batch.move")
        self.take_device_lengths(old, "Batch.move")
        self.caches[old], self.caches[row] = None, cache
        self.leases[old], self.leases[row] = BAD, self.leases[old]
        self.state[row], self.state[old] = self.state[old], 0
        self.requests.seat[cache.slot] = (self, row)
        self._mark(old, UPLOAD)
        self._mark(row, UPLOAD)

    def members(self) -> dict:
        return {r: c for r, c in enumerate(self.caches) if c is not None}

    def _check_free_row(self, row, what: str) -> None:
        check_row(row, self.max_rows, what)
        if self.caches[row] is not None:
            raise ValueError(f"{what}: row {row} is occupied")

    def member_row(self, cache, what: str) -> int:
        slot = getattr(cache, "slot", None)
        seat = None if slot is None or getattr(cache, "manager", None) is not self.manager \
            else self.requests.seat[slot]
        if seat is None or seat[0] is not self:
            raise ValueError(f"{what}: the cache is not a member of this batch")
        return seat[1]

    # ---- the seat interface, which a seated cache calls (module docstring) ----
    def mark_changed(self, row: int) -> None:
        """The cache changed its lengths, pages or watermarks: publish it."""
        self._mark(row, UPLOAD)

    def mark_declared(self, row: int) -> None:
        """Only the cache's declared host writes changed: published too, but per-step calls
        still run (the device needs them only for ``advance``'s watermark)."""
        self._mark(row, DECLARED_ONLY)

    def mark_reserve(self, row: int) -> None:
        """The cache set a new reserve, which takes effect at its next resize (so the batched
        path sends the row through ``KVCache.resize``)."""
        self._mark(row, RESERVE)

    def cell_lengths(self, row: int) -> tuple[int, int]:
        """(history, capacity) as published for the member at ``row`` with its lease: the cells
        may hold its in-flight range of these lengths; (0, 0) without a published lease."""
        cache = self.caches[row]
        if cache is None or self.mirror.published_owner[row] is not cache:
            return 0, 0
        L = self.mirror.host_lengths
        return L.item(HISTORY, row), L.item(CAPACITY, row)

    def grant_lease(self, row: int) -> None:
        """A fresh lease for the member at ``row`` (its residency is cleared at publish)."""
        self.leases[row] = heapq.heappop(self.free_leases)  # never empty: one lease per row
        self.leased += 1
        self._mark(row, UPLOAD | NEW_LEASE)

    def release_lease(self, row: int) -> None:
        """The lease of the member at ``row`` goes back (suspend, remove)."""
        lease = self.leases[row]
        if lease != BAD:
            heapq.heappush(self.free_leases, lease)
            self.leases[row] = BAD
            self.leased -= 1
        self.state[row] &= ~NEW_LEASE & 0xFF
        self._mark(row, UPLOAD)

    def require_polled(self, what: str) -> None:
        """RuntimeError naming ``Batch.poll`` while the device holds lengths the host has not
        read back (an ``advance``, ``finish_step`` or a flush to a tensor since the last poll):
        ``what`` changes state from lengths, and the host never waits for them implicitly."""
        if self.readback.pending:
            raise RuntimeError(
                f"{what}: the device moved this batch's lengths (advance, finish_step or a "
                f"flush to a tensor of targets) since the host last read them; call "
                f"Batch.poll() first (once per step, where the engine waits for its sampled "
                f"tokens)")

    def lengths_of(self, row: int, h: int, c: int, flushed: int) -> tuple[int, int, int]:
        """(history, capacity, flushed watermark) of the member at ``row`` as the host knows
        them: the mirror's when it holds a read-back the cache has not taken (BEHIND), else the
        cache's own ``h``, ``c``, ``flushed``. Changes nothing."""
        s = self.state.item(row)
        if not s & BEHIND or s & UPLOAD:
            return h, c, flushed
        L = self.mirror.host_lengths
        if L.item(LEASE, row) < 0:
            return h, c, flushed
        return L.item(HISTORY, row), L.item(CAPACITY, row), max(flushed, L.item(WRITTEN, row))

    def take_device_lengths(self, row: int, what: Optional[str]) -> None:
        """The member at ``row`` takes the lengths of the last applied read-back, if newer than
        its own (BEHIND). ``what`` (a call about to change state from them) first refuses while
        a read-back is outstanding (``require_polled``); None (publish's page planning) takes
        what has been applied."""
        if what is not None:
            self.require_polled(what)
        s = int(self.state[row])
        if not s & BEHIND:
            return
        self.state[row] = s & ~BEHIND
        cache, L = self.caches[row], self.mirror.host_lengths
        # a row changed on the host since its publish is ahead of the mirror; a hole or a
        # suspended row has nothing of the device's
        if cache is None or s & UPLOAD or L[LEASE, row] < 0:
            return
        self.requests.take_device_lengths(cache.slot, int(L[HISTORY, row]),
                                          int(L[CAPACITY, row]), int(L[WRITTEN, row]))

    def leave(self, cache) -> None:
        """The cache closes (the abort path): unseat it, dropping its in-flight tokens."""
        self.remove(cache, discard=True, closing=True)

    # ---- publish (BAT-3, HOST-1, HOST-2) ----
    def publish(self) -> None:
        self.check_host_call("Batch.publish")
        readback, state = self.readback, self.state
        if readback.pending:
            # host changes are published over the device's newest lengths only (the mirror must
            # not take an older read-back after this publish's delta): the engine polls first;
            # without changes, the read-backs that have arrived are applied, never waited for
            if self.marked & (UPLOAD | DECLARED_ONLY):
                self.require_polled("Batch.publish")
            readback.catch_up(wait=False)
        self.manager.tier.progress()  # the next piece of the copies back of resumed requests
        pages_only = False
        due = ()
        if self.marked & PAGES:
            self.marked &= ~PAGES  # a read-back applied while planning sets it again
            due = np.flatnonzero(state & PAGES)
        if len(due):
            # page work for rows advance() moved (reserve top-ups, windowed releases), planned
            # from the lengths the host has: with a read-back still in flight they are a step
            # or two old, so such a publish only adds pages (a smaller reserve frees pages at a
            # publish without one in flight), leaves the device's lengths alone and uploads page
            # entries and allocated tokens only
            pages_only = readback.pending
            state[due] &= ~PAGES & 0xFF
            for row in due.tolist():
                cache = self.caches[row]
                if cache is not None and not cache.suspended:
                    self.take_device_lengths(row, None)
                    if self.requests.retake_pages(cache.slot, grow_only=pages_only):
                        self._mark(row, UPLOAD)
        if not self.marked & (UPLOAD | DECLARED_ONLY):
            return
        rows = np.flatnonzero(state & (UPLOAD | DECLARED_ONLY)).tolist()
        requests = self.requests
        owners, slots, leases = [], [], []
        for row in rows:
            cache, lease = self.caches[row], self.leases[row]
            if cache is None or lease == BAD:  # hole or suspended: BAD / 0
                owners.append(None)
                slots.append(-1)
            else:
                owners.append(cache)
                slots.append(cache.slot)
                requests.await_pages(cache.slot)  # resumed from the host tier: its pages first
                if state[row] & NEW_LEASE:
                    leases.append(lease)
        slots = np.asarray(slots, dtype=np.int64)
        block, reserves = requests.lengths_rows(slots)  # holes and suspended rows: 0 / BAD
        block[:, LEASE] = np.asarray(self.leases, dtype=np.int64)[rows]
        values = block.astype(np.int32)
        width = self.flush_width(self.mirror.lengths_after(rows, values))
        if width > self.config.max_total_input_tokens:
            raise ValueError(
                f"Batch.publish: {width} in-flight tokens over all rows exceed "
                f"max_total_input_tokens ({self.config.max_total_input_tokens}), the bound of "
                f"the flush work list; nothing was published")
        extra = None
        if self.gpu.enabled:  # RSD-1: rows onto and off GPU history pages
            published = self.mirror.published_owner
            fresh = [owner is not published[row] for row, owner in zip(rows, owners)]
            # only rows whose lengths or owner changed move on or off GPU pages: a publish of
            # declarations alone (finish_step's, between a step's writes and its flush) must
            # not move a row whose in-flight tokens are written but not flushed
            moving = (state[rows] & UPLOAD) != 0
            index, value, demoted, promoted = self.gpu.plan(rows, values, fresh, moving,
                                                            pages_only)
            extra = (index, value)
            # a row's cells may hold stale copies of units it wrote on GPU pages meanwhile (a
            # demoted row) or before (a promoted one, when it comes back): its lease is
            # cleared, as a new lease is; a demoted row's is then seeded from its pages
            leases = (set(leases) | {self.leases[row] for row, *_ in demoted}
                      | {self.leases[row] for row, _ in promoted})
        self.mirror.publish(rows, owners, slots, values, sorted(leases), self._clear_leases,
                            lengths=(ALLOCATED,) if pages_only else None, extra=extra)
        if extra is not None:  # the demoted rows' cells seeded from their freed GPU pages,
            self.gpu.seed(self, demoted)  # before a promotion writes those pages
            self.gpu.copy_in(self, promoted)
        self.mirror.epoch += 1
        readback.published(rows, values, reserves)
        done = UPLOAD | DECLARED_ONLY | NEW_LEASE
        if not pages_only:  # a pages-only publish may keep old pages
            done |= RESERVE
        state[rows] &= ~done & 0xFF
        self.marked &= ~(UPLOAD | DECLARED_ONLY)
        self.unpublished = False

    def flush_width(self, lengths: np.ndarray) -> int:
        """The most in-flight tokens a flush can write back over all rows with these host length
        rows: the flush work-list bound of OP-FLUSH."""
        # holes and suspended rows publish lengths 0 / 0 (width 0), and s0 <= c for h <= c
        h, c = lengths[HISTORY], lengths[CAPACITY]
        widest = 0
        for shape in self.shapes:
            widest = max(widest, int((c - rules.inflight_start(h, c, shape, np.maximum)).sum()))
        return widest

    # ---- the host's bookkeeping of the write contract (SAFE-2) ----
    def record_flush(self, new_history: Optional[list]) -> None:
        """The host's record of an eager flush (its SAFE-2 watermark per seated row, by the rule
        the flush applies on the device): ``new_history`` None (the published capacity) or the
        ``max_rows`` targets ``Batch.flush`` checked. A row credits the cache that was published
        there, and only while it still sits there."""
        self.check_host_call("Batch.flush")
        if self.readback.pending:
            # the device lengths are ahead of the host (advance): its watermark, computed by
            # the flush itself, comes back with a fresh read-back of the lengths
            self.readback.queue_readback()
            return
        L = self.mirror.host_lengths
        if new_history is None:
            target = L[CAPACITY]
        else:
            target = np.asarray(new_history, dtype=np.int64)
        # the device's watermark (the flush_watermark op applies the same rule)
        watermark = rules.flushed_watermark(L[HISTORY], L[CAPACITY], L[WRITTEN], L[DECLARED],
                                            target, self.shapes, np.maximum, np.minimum, np.where)
        seated = L[LEASE] >= 0
        owners = self.mirror.published_owner
        still = [row for row in np.flatnonzero(seated).tolist()
                 if owners[row] is not None and owners[row] is self.caches[row]]
        declared = self.state & DECLARED_ONLY
        requests = self.requests
        for row in still:
            if declared[row]:  # declarations the device has not seen yet
                requests.record_flush(self.caches[row].slot, int(L[HISTORY, row]),
                                      int(L[CAPACITY, row]), int(target[row]))
            elif watermark[row] > L[WRITTEN, row]:
                requests.take_written(self.caches[row].slot, int(watermark[row]))
        self.readback.count_flushed(np.where(seated, watermark, 0), L)
        L[WRITTEN] = np.where(seated, watermark, L[WRITTEN])

    def record_host_writes(self, ends) -> None:
        self.check_host_call("Batch.record_host_writes")
        self.require_polled("Batch.record_host_writes")
        if ends is not None:
            ends = int_sequence("ends", ends, self.max_rows, self.config.device)
        L = self.mirror.host_lengths
        declarations = []
        for row, cache in enumerate(self.caches):
            if cache is None or self.leases[row] == BAD:
                continue
            end = (rules.host_direct_end(int(L[HISTORY, row]), int(L[CAPACITY, row]),
                                         self.shapes, max) if ends is None else ends[row])
            if end > cache.host_direct_end:
                raise ValueError(
                    f"Batch.record_host_writes: row {row}'s end ({end}) is past its host-direct "
                    f"range, which ends at {cache.host_direct_end}; nothing was declared")
            if end:
                declarations.append((cache, end))
        for cache, end in declarations:  # all checked: none can raise
            cache.record_host_write(end)

    # ---- the batched host path (HOST-4) ----
    def resize_rows(self, rows, capacity, history) -> list[int]:
        self.check_host_call("Batch.resize_rows")
        self.require_polled("Batch.resize_rows")
        device = self.config.device
        rows = int_sequence("rows", rows, None, device)  # ints >= 0
        caches = [self.caches[row] if row < self.max_rows else None for row in rows]
        if None in caches:
            row = rows[caches.index(None)]
            raise ValueError(f"Batch.resize_rows: row {row} is not a seated row")
        if len(set(rows)) != len(rows):
            raise ValueError("Batch.resize_rows: a row is named twice")
        n = len(rows)
        caps = None if capacity is None else int_sequence("capacity", capacity, n, device)
        hists = None if history is None else int_sequence("history", history, n, device)
        done, failed = self._resize_clean_rows(rows, caches, caps, hists)
        if len(done) == n:
            return failed
        for i, cache in enumerate(caches):
            if i in done:
                continue
            try:
                ok = cache.resize(None if caps is None else caps[i],
                                  None if hists is None else hists[i])
            except (ValueError, RuntimeError):
                ok = False
            if not ok:
                failed.append(rows[i])
        return failed

    def _resize_clean_rows(self, rows: list, caches: list, caps, hists) -> tuple[set, list]:
        """The vectorised part of ``resize_rows``: rows published as they are (no UNCLEAN flag:
        the mirror holds their lengths and watermarks) are checked by
        ``lengths.resize_violations`` over numpy arrays; the refused ones fail and those whose
        pages stay as they are take their new lengths here. Returns (positions handled, rows
        failed); the rest take the per-row path."""
        if self.windowed or not rows:
            return set(), []
        index = np.asarray(rows, dtype=np.int64)
        behind = index[(self.state[index] & BEHIND) != 0]
        for row in behind.tolist():  # these members take the lengths advance() moved first
            self.take_device_lengths(row, None)
        clean = self.mirror.active[index] & ((self.state[index] & UNCLEAN) == 0)
        if not clean.any():
            return set(), []
        L = self.mirror.host_lengths.astype(np.int64)[:, index]
        h, c = L[HISTORY], L[CAPACITY]
        h2 = h if hists is None else np.asarray(hists, dtype=np.int64)
        c2 = c if caps is None else np.asarray(caps, dtype=np.int64)
        config, P = self.config, self.config.tokens_per_page
        bad = np.zeros(len(rows), dtype=bool)
        for _, violated, _ in rules.resize_violations(
                h, c, h2, c2, L[WRITTEN], L[DECLARED], (h, c, c), self.shapes,
                config.max_tokens_per_row, config.max_total_input_tokens, np.maximum, np.minimum):
            bad |= violated
        reserve = self.readback.reserve_tokens[index]
        keep = -(-L[ALLOCATED] // P)
        keep2 = np.where(c2 > 0, -(-np.minimum(c2 + reserve, config.max_tokens_per_row) // P), 0)
        fast = clean & ~bad & (keep2 == keep)
        moved = np.flatnonzero(fast & ((h2 != h) | (c2 != c)))
        if len(moved):
            slots = np.array([caches[i].slot for i in moved.tolist()], dtype=np.int64)
            self.requests.take_resize_rows(slots, h2[moved], c2[moved])
            self.state[index[moved]] |= UPLOAD
            self.marked |= UPLOAD
            self.unpublished = True
        refused = clean & bad
        done = np.flatnonzero(fast | refused)
        return set(done.tolist()), index[refused].tolist()
