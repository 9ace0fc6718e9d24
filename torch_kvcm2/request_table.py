"""The request table (API-1): every request's host state, owned by the manager.

One slot per open request, struct of arrays (the way an engine keeps ``req_to_blocks``): the
page rows, the live ranges, the lengths and write watermarks, and what the request's batch has
not published yet. A ``KVCache`` is a handle (its slot and the manager): it validates a call and
asks the table to change the slot; the batch's row table (``rows.RowTable``) and its device
tables (``tables.TableMirror``) read and write a seated request through the same public methods
below. Nothing else holds a request's state.

======================= ================================ ===========================================
array                   per slot                         meaning
======================= ================================ ===========================================
``pages``               int32[G, max_pages_per_row]      page ordinal -> pool slot id, BAD outside
                                                         the held ranges (``held``)
``live``                int64[G, 2]                      (first live page, allocated pages) per pool
                                                         group (REQ-3)
``lengths``             int64[FIELDS]                    ``H`` history, ``C`` capacity, ``FLUSHED``
                                                         (SAFE-2 watermark), ``DECLARED`` (host
                                                         writes declared), ``RESERVE`` (tokens kept
                                                         allocated beyond capacity), ``LOWEST``
                                                         (the lowest capacity since the last
                                                         publish of the request's row)
``lowest_keep``         int64[G]                         the fewest allocated pages since that
                                                         publish, per pool group
``moved``               bool                             a live range changed since that publish
``seat``                (RowTable, row) or None          where the request is seated
``state``               ACTIVE / SUSPENDED               (a closed request has no slot)
``offload``             tiers.Offload or None            dense pages in the host tier (TIER-1)
``arrival``             tiers.Restore or None            a resume's copy back, until read
======================= ================================ ===========================================

A request seated in a batch may be newer on the device (``Batch.advance``): its row table knows
(the BEHIND flag); the table takes those lengths through ``take_device_lengths`` when the row
table hands them over. Slots are reused after close; the arrays grow by doubling (a handle reads
through its slot on every call, so no view outlives a growth).
"""
from __future__ import annotations

import logging
from typing import Optional

import numpy as np
import torch

from . import lengths as rules
from .config import BAD
from .memory import ALLOCATED, CAPACITY, HISTORY, LEASE, LENGTH_ROWS, WRITTEN
from .memory import DECLARED as DECLARED_ROW

ACTIVE, SUSPENDED, CLOSED = "active", "suspended", "closed"
H, C, FLUSHED, DECLARED, RESERVE, LOWEST = range(6)
FIELDS = 6

logger = logging.getLogger(__name__)


class RequestTable:
    """Every open request's host state, by slot (module docstring)."""

    def __init__(self, manager, slots: int = 16):
        self.manager = manager
        config = manager.config
        groups = manager.storage.groups
        self.groups = groups
        self.G, self.MP = len(groups), config.max_pages_per_row
        self.P, self.max_tokens = config.tokens_per_page, config.max_tokens_per_row
        self.shapes = rules.shapes_of(config)
        # per pool group: the sink pages a windowed group keeps below first_live (TIER-3)
        self.sinks = [rules.sink_pages(g.sinks, config.tokens_per_page) if g.window else 0
                      for g in groups]
        self.windows = [g.window for g in groups]
        self.windowed = any(self.windows)
        self.pages = np.full((0, self.G, self.MP), BAD, dtype=np.int32)
        self.live = np.zeros((0, self.G, 2), dtype=np.int64)
        self.lowest_keep = np.zeros((0, self.G), dtype=np.int64)
        self.lengths = np.zeros((0, FIELDS), dtype=np.int64)
        self.moved = np.zeros(0, dtype=bool)
        self.seat: list = []
        self.state: list = []
        self.offload: list = []
        self.arrival: list = []
        self.free: list = []
        self._grow(slots)

    def _grow(self, n: int) -> None:
        old = len(self.seat)
        if n <= old:
            return
        self.pages = np.concatenate(
            [self.pages, np.full((n - old, self.G, self.MP), BAD, dtype=np.int32)])
        self.live = np.concatenate([self.live, np.zeros((n - old, self.G, 2), dtype=np.int64)])
        self.lowest_keep = np.concatenate(
            [self.lowest_keep, np.zeros((n - old, self.G), dtype=np.int64)])
        self.lengths = np.concatenate([self.lengths, np.zeros((n - old, FIELDS), dtype=np.int64)])
        self.moved = np.concatenate([self.moved, np.zeros(n - old, dtype=bool)])
        for column in (self.seat, self.state, self.offload, self.arrival):
            column.extend([None] * (n - old))
        self.free.extend(range(n - 1, old - 1, -1))  # lowest slot first (pop from the end)

    # ---- slots ----
    def open(self) -> int:
        """A fresh slot: empty lengths and pages, active, unseated."""
        if not self.free:
            self._grow(2 * len(self.seat))
        slot = self.free.pop()
        self.state[slot] = ACTIVE
        return slot

    def release(self, slot: int) -> None:
        """Give the slot back (its pages must be freed already: ``free_pages``)."""
        self.pages[slot] = BAD
        self.live[slot] = 0
        self.lowest_keep[slot] = 0
        self.lengths[slot] = 0
        self.moved[slot] = False
        self.seat[slot] = self.state[slot] = self.offload[slot] = self.arrival[slot] = None
        self.free.append(slot)

    # ---- reads (never change anything) ----
    def own_lengths(self, slot: int) -> list:
        """[history, capacity, flushed watermark, ...] as the slot holds them (every field, in
        ``FIELDS`` order)."""
        return self.lengths[slot].tolist()

    def written(self, h: int, c: int, flushed: int, slot: int) -> int:
        """Tokens ``[0, written)`` are on host pages for lengths (h, c) and the watermark
        ``flushed`` (``lengths.written_prefix``) with the slot's declarations."""
        return rules.written_prefix(h, c, flushed, int(self.lengths[slot, DECLARED]), self.shapes,
                                    max, min)

    def held(self, slot: int, group: int) -> list:
        """The page ranges ``[lo, hi)`` the request holds in pool group ``group``: the sink pages
        ``[0, min(sink pages, first_live))`` (TIER-3) and ``[first_live, allocated)``, non-empty
        ones only; every other entry of its page row is BAD."""
        first, keep = self.live[slot, group].tolist()
        return [(lo, hi) for lo, hi in ((0, min(self.sinks[group], first)), (first, keep))
                if lo < hi]

    def page_row(self, slot: int, group: int) -> np.ndarray:
        """The request's page row of a pool group (int32[max_pages_per_row], BAD outside the
        held ranges); read-only for its readers."""
        return self.pages[slot, group]

    def live_range(self, slot: int, group: int) -> tuple[int, int, int, int]:
        """(sink pages held, first live page, allocated pages, the fewest pages allocated since
        the row table last published the request): entries ``[0, sink pages)`` and ``[first,
        allocated)`` hold slots (TIER-3), and those from the last one on may have new slots."""
        first, keep = self.live[slot, group].tolist()
        return min(self.sinks[group], first), first, keep, int(self.lowest_keep[slot, group])

    def pages_moved(self, slots: np.ndarray) -> np.ndarray:
        """Per slot (-1: none, False), whether a page moved since the last publish of the
        request's row (without, a publish sends its lengths only)."""
        return self.moved[slots] & (slots >= 0)

    def lengths_rows(self, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Every slot's length row as a publish uploads it: int64[n,
        memory.LENGTH_ROWS] (history, capacity, lease (BAD: the row table fills it), written,
        declared, allocated tokens) and the reserve tokens int64[n]; a slot of -1 (a hole or
        suspended row) gets 0 / BAD / 0."""
        held = slots >= 0
        s = slots[held]
        L = self.lengths[s]
        # built by columns for the held slots, scattered once (a masked assignment per column
        # cost more than the rest of a publish of 8 rows)
        rows = np.empty((len(s), LENGTH_ROWS), dtype=np.int64)
        rows[:, HISTORY], rows[:, CAPACITY], rows[:, LEASE] = L[:, H], L[:, C], BAD
        # without sparse layers nothing is flushed: history may advance through capacity
        # (written_prefix), so the device's advance is bounded by the row's ceiling only
        rows[:, WRITTEN] = L[:, FLUSHED] if self.shapes else self.max_tokens
        rows[:, DECLARED_ROW] = L[:, DECLARED]
        keep = self.live[s, 0, 1] if self.G else -(-L[:, C] // self.P)
        np.minimum(keep * self.P, self.max_tokens, out=rows[:, ALLOCATED])
        if len(s) == len(slots):
            return rows, L[:, RESERVE]
        out = np.zeros((len(slots), LENGTH_ROWS), dtype=np.int64)
        out[:, LEASE] = BAD
        out[held] = rows
        reserves = np.zeros(len(slots), dtype=np.int64)
        reserves[held] = L[:, RESERVE]
        return out, reserves

    def tier_pages(self, slot: int, group: int) -> Optional[tuple]:
        """(the host tier's pool ``uint8[num_slots, scale, page_bytes]``, int64 tier slot per
        page ordinal of the live range's end, BAD for pages not there, the copy's event) of pool
        group ``group`` while the request's pages are offloaded; None otherwise."""
        offload = self.offload[slot]
        if offload is None or group not in offload.ordinals:
            return None
        tier = self.manager.storage.tiers[group]
        return tier.data, offload.tier_index(group, int(self.live[slot, group, 1])), offload.event

    # ---- lengths ----
    def take_lengths(self, slot: int, h: int, c: int) -> bool:
        """Lengths (h, c) whose pages are in place; whether they differ from the slot's."""
        row = self.lengths[slot]
        h0, c0 = row[:C + 1].tolist()
        row[H], row[C] = h, c
        if c < c0:  # tokens cut off by a shrink are gone
            np.minimum(row[FLUSHED:DECLARED + 1], c, out=row[FLUSHED:DECLARED + 1])
            row[LOWEST] = min(int(row[LOWEST]), c)
        return (h, c) != (h0, c0)

    def take_device_lengths(self, slot: int, h: int, c: int, written: int) -> None:
        """Lengths advanced on the device (Batch.advance), as the batch read them back."""
        row = self.lengths[slot]
        row[H], row[C], row[LOWEST] = h, c, c
        row[FLUSHED] = max(row[FLUSHED], written)

    def take_written(self, slot: int, written: int) -> None:
        """The written watermark after a flush, as the batch computed it for the row."""
        self.lengths[slot, FLUSHED] = max(int(self.lengths[slot, FLUSHED]), written)

    def take_resize_rows(self, slots: np.ndarray, h: np.ndarray, c: np.ndarray) -> None:
        """Lengths that ``Batch.resize_rows`` checked by resize's rules and that keep every page
        where it is (no page enters or leaves a live range), for many slots at once."""
        block = self.lengths[slots]  # one gather and one scatter: fancy indexing is the cost
        block[:, H], block[:, C] = h, c
        np.minimum(block[:, FLUSHED:DECLARED + 1], c[:, None], out=block[:, FLUSHED:DECLARED + 1])
        np.minimum(block[:, LOWEST], c, out=block[:, LOWEST])
        self.lengths[slots] = block

    def record_flush(self, slot: int, h: int, c: int, target: int) -> None:
        """A flush of lengths (h, c) to ``target`` ran (an eager Batch.flush)."""
        row = self.lengths[slot]
        row[FLUSHED] = rules.flushed_watermark(h, c, int(row[FLUSHED]), int(row[DECLARED]),
                                               target, self.shapes, max, min, rules.pick)

    def declare(self, slot: int, end: int) -> None:
        self.lengths[slot, DECLARED] = max(int(self.lengths[slot, DECLARED]), end)

    def mark_published(self, slots: np.ndarray) -> None:
        """The row table published these requests' lengths and pages (-1: no request)."""
        slots = slots[slots >= 0]
        self.lengths[slots, LOWEST] = self.lengths[slots, C]
        moved = slots[self.moved[slots]]
        if len(moved):
            self.lowest_keep[moved] = self.live[moved, :, 1]
            self.moved[moved] = False

    # ---- pages ----
    def plans(self, slot: int, h: int, c: int, grow_only: bool = False,
              shrink_only: bool = False) -> list:
        """Per pool group, (first live page, allocated pages) for lengths (h, c); ``grow_only``
        keeps at least the pages allocated now, ``shrink_only`` at most (a reserve set since
        is not taken)."""
        P = self.P
        reserve = int(self.lengths[slot, RESERVE])
        keep = -(-min(c + reserve, self.max_tokens) // P) if c else 0
        if not (grow_only or shrink_only or self.windowed):  # every range starts at page 0
            return [(0, keep)] * self.G
        out = []
        for (first0, keep0), window in zip(self.live[slot].tolist(), self.windows):
            k = max(keep, keep0) if grow_only else min(keep, keep0) if shrink_only else keep
            out.append((max(first0, min(rules.first_live_page(h, P, window), k)), k))  # REQ-3
        return out

    def apply(self, slot: int, h: int, c: int, grow_only: bool = False,
              shrink_only: bool = False) -> Optional[bool]:
        """Allocate and free pages for lengths (h, c) and take them: True when the lengths or
        pages changed, False when nothing did, None (nothing changed) when a pool group cannot
        supply the pages. The lengths must have passed resize's checks. ``grow_only``: no page
        beyond the live range's start is freed (``retake_pages``); ``shrink_only``: none is
        allocated (``discard_in_flight``), so it cannot fail."""
        groups = self.groups
        live = self.live[slot]
        plans = self.plans(slot, h, c, grow_only, shrink_only)
        old = list(map(tuple, live.tolist()))
        if plans == old:
            # no page enters or leaves a live range (most decode steps): the lengths only
            return self.take_lengths(slot, h, c)
        # the window's new pages, and sink pages not allocated yet (a jump past the window)
        needs = [max(keep - max(o[1], first), 0) + max(min(sinks, first) - o[1], 0)
                 for (first, keep), o, sinks in zip(plans, old, self.sinks)]
        allocated = self.manager.storage.allocate_slots(needs)
        if allocated is None:
            self.manager.counts.allocations_failed += 1
            logger.debug("slot %d: %s pages per pool group not available", slot, needs)
            return None
        if self.arrival[slot] is not None and any(
                first > o[0] or keep < o[1] for (first, keep), o in zip(plans, old)):
            self.await_pages(slot)  # pages are freed: a resume's copy into them must come first
        rows = self.pages[slot]
        for group, slots, n, (first, keep), (old_first, old_keep) in zip(
                groups, allocated, needs, plans, old):
            g = group.index
            row = rows[g]
            front_start, front_end = max(old_first, self.sinks[g]), min(first, old_keep)
            if front_end > front_start:  # REQ-3: wholly before h - window, past the sinks
                group.release(row[front_start:front_end])
                row[front_start:front_end] = BAD
            if keep < old_keep:
                lo = max(keep, old_first)
                group.release(row[lo:old_keep])
                row[lo:old_keep] = BAD
            if n:
                sink_end = min(self.sinks[g], first)
                new_sinks = max(sink_end - old_keep, 0)  # TIER-3: kept below the window
                row[old_keep:old_keep + new_sinks] = slots[:new_sinks]
                row[max(old_keep, first):keep] = slots[new_sinks:]
            if (first, keep) != (old_first, old_keep):
                self.moved[slot] = True
            live[g] = first, keep
            self.lowest_keep[slot, g] = min(int(self.lowest_keep[slot, g]), keep)
        self.take_lengths(slot, h, c)
        return True

    def retake_pages(self, slot: int, grow_only: bool = False) -> Optional[bool]:
        """Plan the pages of the current lengths again: the reserve beyond capacity and the
        window's releases, after ``Batch.advance`` moved the lengths on the device (the row table
        calls it at publish, once the request took the lengths read back so far). The lengths do
        not change, so no rule of ``resize`` can break. Returns what ``apply`` returns: True
        when pages changed, None, with nothing changed, when the pools cannot supply them (the
        row's advance then stops at its pages, counted as short). ``grow_only`` (lengths older
        than the device's: a read-back in flight) frees no page at the end of the live range, so
        a smaller reserve never takes pages the device's capacity already reached; windowed
        releases still happen."""
        h, c = self.lengths[slot, :C + 1].tolist()
        return self.apply(slot, h, c, grow_only)

    def discard_in_flight(self, slot: int) -> None:
        """Drop the tokens in flight: capacity shrinks back to history (the abort path)."""
        h, c = self.lengths[slot, :C + 1].tolist()
        if c > h:
            self.manager.counts.aborts += 1
            self.apply(slot, h, h, shrink_only=True)  # takes no page: cannot fail

    def start_shared(self, slot: int, pages: int, entries: np.ndarray) -> int:
        """Take ``pages`` committed pages (``entries``, page order) as the new request's first
        pages: a reference to each slot, lengths and watermarks at the shared length (PFX-2).
        The match guaranteed every slot the lengths need; nothing is allocated. Returns the
        shared tokens."""
        prefix = self.manager.storage.prefix
        h = pages * self.P
        self.live[slot] = self.plans(slot, h, h)
        for group in self.groups:
            for lo, hi in self.held(slot, group.index):  # the sink pages too (TIER-3)
                slots = prefix.slots_of(entries[lo:hi], group.index)
                group.reference(slots)
                self.pages[slot, group.index, lo:hi] = slots
        prefix.touch(entries)
        self.lengths[slot, [H, C, FLUSHED, DECLARED]] = h
        self.moved[slot] = True
        return h

    def free_pages(self, slot: int) -> None:
        """Free every page the request holds (host tier pages included): its close."""
        self.await_pages(slot)
        if self.offload[slot] is not None:
            self.manager.tier.discard(self.offload[slot])
            self.offload[slot] = None
        for group in self.groups:
            row = self.pages[slot, group.index]
            for lo, hi in self.held(slot, group.index):
                slots = row[lo:hi]
                group.release(slots[slots >= 0])  # pages in the host tier have no GPU slot
            row[:] = BAD
        self.live[slot] = 0
        self.lengths[slot, [H, C]] = 0

    def await_pages(self, slot: int) -> None:
        """After a resume: what is left of the copy of the pages back is issued now, and on
        CUDA the current stream waits for its last piece (once; a stream wait, never a host
        wait)."""
        arrival = self.arrival[slot]
        if arrival is not None:
            event = self.manager.tier.complete(arrival)
            if event is not None and not event.query():
                torch.cuda.current_stream(self.manager.config.device).wait_event(event)
            self.arrival[slot] = None
