"""The lengths of many rows at once (HOST-3, HOST-4): ``Batch.resize_rows`` on the host, and
``Batch.advance`` on the device with the lazy read-back that brings the host mirror up to date.

``LengthsPath`` is a part of ``Batch`` (its base class) kept in its own module; it uses the
batch's tables, mirror and members and the rules of ``lengths``.
"""
from __future__ import annotations

import numpy as np
import torch

from . import lengths as rules
from . import ops
from ._util import bound_like
from .memory import ALLOCATED, CAPACITY, DECLARED, HISTORY, LEASE, WRITTEN


class LengthsPath:
    """``resize_rows``, ``advance``, ``record_advance``, ``catch_up`` and ``sync_member`` of a
    ``Batch``."""

    def resize_rows(self, rows, capacity=None, history=None) -> list[int]:
        """``KVCache.resize`` for many rows in one call: ``rows`` a sequence of seated rows,
        ``capacity`` / ``history`` None or one int per row (a sequence, numpy array or CPU
        tensor). Each row is checked by resize's rules (over numpy arrays for rows published as
        they are) and changed all or nothing; rows whose
        lengths break a rule (ValueError), whose cache is suspended, or whose pages the pools
        cannot supply are left unchanged. Returns the rows that failed (empty when all
        succeeded). Bad arguments (not a member, wrong lengths of the sequences, capture in
        progress) raise before anything changes."""
        self._check_host_call("Batch.resize_rows")
        self.catch_up()
        rows = self._int_sequence("rows", rows, length=None)  # ints >= 0
        members, R = self._rows, self.max_rows
        caches = [members[row] if row < R else None for row in rows]
        if None in caches:
            row = rows[caches.index(None)]
            raise ValueError(f"Batch.resize_rows: row {row} is not a seated row")
        if len(set(rows)) != len(rows):
            raise ValueError("Batch.resize_rows: a row is named twice")
        n = len(rows)
        caps = None if capacity is None else self._int_sequence("capacity", capacity, length=n)
        hists = None if history is None else self._int_sequence("history", history, length=n)
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
        """The vectorised part of ``resize_rows``: rows published as they are (the host mirror
        holds their lengths and watermarks) are checked by ``lengths.resize_violations`` over
        numpy arrays; the refused ones fail and those whose pages stay as they are take their
        new lengths here. Returns (positions handled, rows failed); the rest take the per-row
        path (page work, or a row changed since the last publish)."""
        if self._windowed or not rows:
            return set(), []
        reserve = self._reserve_tokens
        index = np.asarray(rows, dtype=np.int64)
        stale = self._stale[index]
        if stale.any():  # these members take the lengths advance() moved first
            for row in index[stale].tolist():
                self.sync_member(row)
        # published with a lease and unchanged since (a seat change, a resize, a declaration or
        # a new reserve makes a row take the per-row path)
        active = self._mirror.active
        unclean = (self._dirty, self._declared_rows, self._settle, self._reserve_rows)
        if any(unclean):
            active = active.copy()
            for group in unclean:
                for r in group:
                    active[r] = False
        clean = active[index]
        if not clean.any():
            return set(), []
        L = self._mirror.host_lengths.astype(np.int64)[:, index]
        h, c = L[HISTORY], L[CAPACITY]
        h2 = h if hists is None else np.asarray(hists, dtype=np.int64)
        c2 = c if caps is None else np.asarray(caps, dtype=np.int64)
        config, P = self.config, self.config.tokens_per_page
        bad = np.zeros(len(rows), dtype=bool)
        for _, violated, _ in rules.resize_violations(
                h, c, h2, c2, L[WRITTEN], L[DECLARED], (h, c), self._shapes,
                config.max_tokens_per_row, config.max_total_input_tokens, np.maximum, np.minimum):
            bad |= violated
        keep = -(-L[ALLOCATED] // P)
        keep2 = np.where(c2 > 0, -(-np.minimum(c2 + reserve[index], config.max_tokens_per_row) // P), 0)
        fast = clean & ~bad & (keep2 == keep)
        moved = np.flatnonzero(fast & ((h2 != h) | (c2 != c)))
        if len(moved):
            for i, hh, cc in zip(moved.tolist(), h2[moved].tolist(), c2[moved].tolist()):
                caches[i].take_resize(hh, cc)
            self._dirty.update(index[moved].tolist())
        refused = clean & bad
        done = np.flatnonzero(fast | refused)
        return set(done.tolist()), index[refused].tolist()

    # ---- the device-side length advance (HOST-3) ----
    def advance(self, accepted: torch.Tensor) -> None:
        """Advance every seated row's lengths on the device, capturable (no host work, no
        synchronisation): ``accepted`` int32[max_rows] on the batch's device, the tokens of the
        row's in-flight range [history, capacity) accepted this step.

        Per seated row (holes and suspended rows are untouched), with width = capacity -
        history: a row is *refused* and left unchanged when ``accepted`` is negative, exceeds
        the width, or would move history past ``written`` (SAFE-2: what was flushed; flush
        first); else history += accepted and capacity = history + width, cut at the row's
        allocated pages (its reserve, ``KVCache.set_reserve``); a row cut there is counted as
        *short*. ``advance_counters`` int64[2] counts refused and short rows, cumulatively.

        The host mirror catches up without a per-step synchronisation: eagerly, ``advance``
        queues a copy of the lengths to pinned memory and the host reads it when it next needs
        a length (any host-side call, or a cache's ``history_length``). After replaying a
        captured graph or a compiled call that contains ``advance``, call
        ``record_advance()``. Windowed pages behind the window are released, and reserves taken
        again, at the first ``publish`` after that catch-up."""
        self._check_step("Batch.advance")
        if torch.compiler.is_compiling():
            self._check_rows_tensor("accepted", accepted)
            ops.advance(self._mirror.lengths, self.advance_counters, accepted)
            return
        # the eager path: counts like the batch's history go to the op unchecked here
        if accepted.__class__ is not torch.Tensor or not bound_like(
                accepted, self._rows_shape, self._bound_device):
            self._check_rows_tensor("accepted", accepted)
        ops.advance(self._mirror.lengths, self.advance_counters, accepted)
        self._queue_readback()  # not while capturing

    def record_advance(self) -> None:
        """Queue the read-back of the device lengths after ``advance`` (on the current stream;
        ``advance`` calls it eagerly; call it after replaying a graph that contains
        ``advance``). The host applies it when it next needs a length, or at a ``publish`` once
        it has arrived. The read-backs go round a ring of pinned buffers, so a host running
        steps ahead of the GPU still takes the newest one that has arrived."""
        self._check_host_call("Batch.record_advance")
        self._queue_readback()

    def _queue_readback(self) -> None:
        """``record_advance`` without its checks (``advance`` has made them); nothing while the
        current CUDA stream is capturing (the replay's ``record_advance`` queues it). On CUDA
        the copy into the next buffer of the ring is queued on the current stream, then that
        buffer's event is recorded after it."""
        k = self._next_readback
        if self._mirror.cuda:
            if torch.cuda.is_current_stream_capturing():
                return
            lengths = self._mirror.lengths
            self._snapshot_buffers[k].copy_(lengths, non_blocking=True)
            self._snapshot_events[k].record(torch.cuda.current_stream(lengths.device))
        else:
            self._snapshot_buffers[k].copy_(self._mirror.lengths)
        self._lengths_epoch += 1  # the lengths moved under the groups' write tables
        ring = len(self._snapshot_events)
        self._next_readback = (k + 1) % ring
        queue = self._readbacks
        if len(queue) == ring:  # the oldest buffer is copied into again: this copy supersedes it
            queue.popleft()
        queue.append(k)
        self._owed = False

    @property
    def pending_readback(self) -> bool:
        """A read-back of the device lengths is queued and not applied yet, or owed (an eager
        flush to a tensor of targets queues its read-back at the next ``record_advance`` or host
        call that needs a length)."""
        return bool(self._readbacks) or self._owed

    def catch_up(self, wait: bool = True) -> None:
        """Apply the read-backs of ``advance`` to the host mirror and the member caches.
        ``wait`` False applies the newest that the GPU has finished, if any (``publish`` does
        that, never blocking on the latest steps: only when every buffer of the read-back ring
        is still in flight does it wait, for the oldest); True waits for the newest queued
        (every host call that needs a length, and a publish of changes). Cheap when none is
        pending. Page work the new lengths need (windowed pages to release, the reserve to take
        again) happens at the next ``publish``."""
        if self._owed:  # a flush to a tensor of targets: queue its read-back now
            self.record_advance()
        queue = self._readbacks
        if not queue:
            return
        events = self._snapshot_events
        if wait or events[queue[-1]] is None:
            if events[queue[-1]] is not None:
                events[queue[-1]].synchronize()
            newest = len(queue)
        else:  # the newest finished copy (copies on one stream finish in order)
            newest = next((i + 1 for i in range(len(queue) - 1, -1, -1)
                           if events[queue[i]].query()), 0)
            if not newest:
                if len(queue) < len(events):
                    return
                # a whole ring of read-backs in flight: the host is that many steps ahead of
                # the GPU; it waits for the oldest, so its view lags by no more than the ring
                events[queue[0]].synchronize()
                newest = 1
        for _ in range(newest - 1):
            queue.popleft()
        snapshot = self._snapshot_host[queue.popleft()]
        L = self._mirror.host_lengths
        if self._windowed:
            # rows whose history, capacity or watermark moved release pages behind their
            # windows at the next publish
            moved = (snapshot[:WRITTEN + 1] != L[:WRITTEN + 1]).any(axis=0)
            moved &= L[LEASE] >= 0
            self._settle.update(np.flatnonzero(moved).tolist())
        # the rows the device writes (history, capacity, written); lease, declared and
        # allocated tokens are the host's (only a publish changes them, and a publish may have
        # changed allocated tokens since this copy was queued: Batch.publish's page work)
        L[:CAPACITY + 1] = snapshot[:CAPACITY + 1]
        L[WRITTEN] = snapshot[WRITTEN]
        # every member takes its row when next used (sync_member: seated rows not changed on
        # the host since their publish), so the steady state costs no per-row work here
        self._stale.fill(True)
        if not self._windowed:
            self._settle_reserves(L)

    def _settle_reserves(self, L: np.ndarray) -> None:
        """Queue the reserve top-ups (page allocation) for the next publish, in batches: once a
        seated row has used more than half its reserve, every seated row that has used any of
        it is topped up in that same publish. A row's pages then run out no earlier than half a
        reserve after a top-up, and the fixed cost of a publish with page work is shared by
        many rows instead of paid by one row per step (64 staggered rows with a one-page
        reserve: one such publish about every 32 steps instead of every step)."""
        if not (L[CAPACITY] >= self._urgent_at).any():
            return
        wanted = np.minimum(L[CAPACITY] + self._reserve_tokens, self.config.max_tokens_per_row)
        low = np.flatnonzero((L[LEASE] >= 0) & (wanted > L[ALLOCATED]))
        self._settle.update(low.tolist())

    def urgent_capacity(self, values: np.ndarray, reserves: np.ndarray) -> np.ndarray:
        """Per published row (``values`` its six lengths, ``reserves`` its reserve tokens), the
        capacity from which more than half its reserve is used: allocated - ceil(reserve / 2) +
        1; never (int64 max) for rows without a lease or whose pages reach max_tokens_per_row."""
        allocated = values[:, ALLOCATED].astype(np.int64)
        never = (values[:, LEASE] < 0) | (allocated >= self.config.max_tokens_per_row)
        return np.where(never, np.iinfo(np.int64).max, allocated - (reserves + 1) // 2 + 1)

    def sync_member(self, row: int, wait: bool = True) -> None:
        """Bring the member at ``row`` up to date with lengths ``advance`` moved (catch_up, then
        the cache takes its row of the host mirror); ``wait`` False takes only the read-backs
        that have arrived."""
        if self.pending_readback:
            self.catch_up(wait)
        if not self._stale[row]:
            return
        self._stale[row] = False
        cache, L = self._rows[row], self._mirror.host_lengths
        # a row changed on the host since its last publish (dirty) is ahead of the mirror; a
        # hole or a suspended row has nothing of the device's
        if cache is None or row in self._dirty or L[LEASE, row] < 0:
            return
        cache.take_lengths(int(L[HISTORY, row]), int(L[CAPACITY, row]), int(L[WRITTEN, row]))
