"""The read-back of a batch (HOST-3): bringing the host up to date with lengths ``advance``
moved on the device, without a per-step synchronisation.

``Batch.advance`` queues a copy of the device's length rows into the next pinned buffer of a
ring (``queue_readback``); ``Batch.poll`` waits for the newest and applies it, and a publish
without host changes applies the newest that has arrived without waiting (``catch_up``): the
mirror takes the rows the device writes, every row becomes BEHIND (its cache reads through the
mirror and takes its row when a call next changes it) and the rows that used more than half
their reserve, or moved past a windowed page, get PAGES (the next publish plans their pages). An
eager flush to a tensor of targets leaves the read-back *owed*: the host learns its watermark
only from a copy queued after it. While a read-back is queued or owed (``pending``), calls that
change rows refuse and name ``Batch.poll``.

Each read-back also copies the device counters (hits, misses, invalid per selection group,
``advance``'s refused and short rows: separate int64 tensors, gathered on the device by one
``cat`` into a stage, then one more copy in the same call, into a ring of its own beside the
lengths' under the same event; docs/DESIGN.md, "Metrics");
``counters`` holds them as of the last applied read-back and ``latest_counters`` reads the
newest arrived one without waiting (``KVCacheManager.metrics``).

State: the ring (``buffers``, their ``events`` on CUDA), ``queue`` (ring positions queued and
not applied, oldest first), ``owed``, and per row the reserve as published
(``reserve_tokens``) and the capacity from which its top-up is urgent (``urgent_at``). The row
flags it sets live in the row table (``rows.RowFlags``).
"""
from __future__ import annotations

import collections
import mmap
import weakref

import numpy as np
import torch

from ._util import outside_capture
from .memory import ALLOCATED, CAPACITY, DECLARED, LEASE, WRITTEN
from .rows import BEHIND
from .telemetry import flushed_tokens

NEVER = np.iinfo(np.int64).max


def readback_ring(spec, device: torch.device) -> torch.Tensor:
    """The read-back buffers (``memory.batch_tensor_specs``' "snapshot"). On CUDA: whole pages
    of anonymous memory of their own, registered with ``cudaHostRegister`` (``host_register``),
    not the pinned allocator's: that allocator creates an event for every stream a block was
    copied on when the block is freed, which throws, and so aborts the process from a
    destructor, once a device fault has ended the context (a rank that traps in ``rank_wait``,
    TP-4). ``Readback`` unregisters them once their copies are done."""
    if device.type != "cuda":
        return torch.zeros(spec.shape, dtype=spec.dtype)
    memory = mmap.mmap(-1, spec.nbytes)  # zeroed, page-aligned
    ring = torch.frombuffer(memory, dtype=spec.dtype)
    n = 1
    for d in spec.shape:
        n *= d
    torch.ops.torch_kvcm2.host_register(ring.data_ptr(), spec.nbytes, _index(device), True)
    return ring[:n].view(spec.shape)


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def _release_ring(rings: tuple, events: list, device: int) -> None:
    """Wait for the copies into the rings, then unregister them (their memory goes with the
    tensors). After a device fault neither can succeed, and there is nothing left to protect."""
    try:
        for event in events:
            event.synchronize()
        for ring in rings:
            torch.ops.torch_kvcm2.host_register(ring.data_ptr(), ring.untyped_storage().nbytes(),
                                                device, False)
    except Exception:  # noqa: BLE001 -- a finalizer must finish; the context may be gone
        pass


class Readback:
    """The read-back ring of one batch and what applying a read-back does (module docstring)."""

    def __init__(self, table, snapshot: torch.Tensor, counter_parts: list,
                 counter_stage: torch.Tensor, counter_snapshot: torch.Tensor):
        self.table = table
        mirror = table.mirror
        self.source = mirror.lengths  # the device length rows, int32[6, max_rows]
        self.buffers = snapshot.unbind(0)  # page-locked on CUDA; views made once
        self.snapshot = snapshot  # int32[ring, 6, max_rows]
        self.host = snapshot.numpy()
        # the device counters (int64 tensors, gathered into the stage in memory.counter_words'
        # order) and their ring
        self.counter_parts, self.counter_stage = counter_parts, counter_stage
        self.counter_buffers = counter_snapshot.unbind(0)
        self.counter_snapshot = counter_snapshot
        self.host_counters = counter_snapshot.numpy()
        #: the device counters as of the last applied read-back
        self.counters = np.zeros(counter_stage.numel(), dtype=np.int64)
        # the counters of the newest read-back known to have arrived that the queue no longer
        # holds: the last applied, or a finished one whose buffer the ring took back unapplied
        self.arrived = self.counters.copy()
        self.cuda = mirror.cuda
        self.events: list = [None] * len(self.buffers)
        if self.cuda:
            with torch.cuda.device(self.source.device):
                self.events = [torch.cuda.Event() for _ in self.buffers]
            weakref.finalize(self, outside_capture(_release_ring), (snapshot, counter_snapshot),
                             self.events, _index(self.source.device))
        self.queue: collections.deque = collections.deque()
        self.next = 0
        self.owed = False  # a flush to a tensor of targets ran since the last read-back
        self.counts = table.manager.counts  # telemetry.HostCounters: bytes flushed
        self.flush_token_bytes = 0  # bytes per token this batch's flush writes (set by Batch)
        R = table.max_rows
        self.reserve_tokens = np.zeros(R, dtype=np.int64)  # as published, per row
        self.urgent_at = np.full(R, NEVER, dtype=np.int64)

    @property
    def pending(self) -> bool:
        """A read-back is queued and not applied yet, or owed."""
        return bool(self.queue) or self.owed

    def record_advance(self) -> None:
        self.table.check_host_call("Batch.record_advance")
        self.queue_readback(moved=True)

    def queue_readback(self, moved: bool = False) -> None:
        """Queue the copy of the device lengths into the ring's next buffer on the current
        stream (nothing while it is capturing: the replay's ``record_advance`` queues it).
        ``moved``: the device's lengths moved since the last publish or read-back (an
        ``advance``), so the groups' write tables are dated (``TableMirror.epoch``); applying
        a read-back whose lengths differ from the mirror's dates them too."""
        k = self.next
        if self.cuda and torch.cuda.is_current_stream_capturing():
            return
        ring = len(self.buffers)
        if len(self.queue) == ring:  # the oldest queued buffer, k, is copied into again:
            event = self.events[k]  # keep its counters if they arrived, or a later
            if event is None or event.query():  # latest_counters could go backwards
                self.arrived[:] = self.host_counters[k]
        if self.cuda:
            self.buffers[k].copy_(self.source, non_blocking=True)
            torch.cat(self.counter_parts, out=self.counter_stage)
            self.counter_buffers[k].copy_(self.counter_stage, non_blocking=True)
            self.events[k].record(torch.cuda.current_stream(self.source.device))
        else:
            self.buffers[k].copy_(self.source)
            torch.cat(self.counter_parts, out=self.counter_buffers[k])
        if moved:
            self.table.mirror.epoch += 1  # the lengths moved under the groups' write tables
        self.next = (k + 1) % ring
        if len(self.queue) == ring:  # superseded
            self.queue.popleft()
        self.queue.append(k)
        self.owed = False

    def catch_up(self, wait: bool = True) -> None:
        """Apply the read-backs to the mirror. ``wait`` False applies the newest the GPU has
        finished, if any (only when the whole ring is in flight does it wait, for the oldest);
        True waits for the newest queued. Cheap when none is pending."""
        if self.owed:  # a flush to a tensor of targets: queue its read-back now
            self.queue_readback()
        queue = self.queue
        if not queue:
            return
        events = self.events
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
                # a whole ring in flight: the host is that many steps ahead of the GPU; it
                # waits for the oldest, so its view lags by no more than the ring
                events[queue[0]].synchronize()
                newest = 1
        for _ in range(newest - 1):
            queue.popleft()
        k = queue.popleft()
        self.counters[:] = self.host_counters[k]
        self.arrived[:] = self.counters
        self._apply(self.host[k])

    def latest_counters(self) -> np.ndarray:
        """The device counters of the newest read-back that has arrived, without applying it
        or waiting: a queued one whose copy has finished (``Event.query``, no synchronisation),
        else the newest that arrived before the queue let it go (``arrived``), so successive
        calls never go backwards, however far the device lags. At most ``READBACKS`` read-backs are queued, so these lag the
        device by at most that many ``advance``/``record_advance`` calls, plus the steps since
        the last one."""
        events = self.events
        for k in reversed(self.queue):
            if events[k] is None or events[k].query():
                return self.host_counters[k].copy()
        return self.arrived.copy()

    def _apply(self, snapshot: np.ndarray) -> None:
        table = self.table
        L, state = table.mirror.host_lengths, table.state
        if table.windowed:
            # rows whose history, capacity or watermark moved release pages behind their
            # windows at the next publish
            moved = (snapshot[:WRITTEN + 1] != L[:WRITTEN + 1]).any(axis=0) & (L[LEASE] >= 0)
            table.mark_pages(moved)
        # the rows the device writes (history, capacity, written); lease, declared and
        # allocated tokens are the host's (only a publish changes them, and a publish may have
        # changed allocated tokens since this copy was queued)
        # (compared as bytes: a third of np.array_equal's cost on these two short rows)
        if snapshot[:CAPACITY + 1].tobytes() != L[:CAPACITY + 1].tobytes():
            table.mirror.epoch += 1  # e.g. a replayed advance no record_advance announced
        L[:CAPACITY + 1] = snapshot[:CAPACITY + 1]
        self.count_flushed(snapshot[WRITTEN], L)
        L[WRITTEN] = snapshot[WRITTEN]
        # every member takes its row when next used, so the steady state costs no per-row work
        state |= BEHIND
        if not table.windowed:
            self._settle_reserves(L, state)

    def count_flushed(self, written: np.ndarray, L: np.ndarray) -> None:
        """The mirror's watermark moves to ``written`` (a read-back, or the host's own rule for
        a flush): count the bytes flushed (``telemetry.flushed_tokens``)."""
        tokens = flushed_tokens(written, L[WRITTEN], L[DECLARED])
        if tokens:
            self.counts.flushed_bytes += tokens * self.flush_token_bytes

    def _settle_reserves(self, L: np.ndarray, state: np.ndarray) -> None:
        """Reserve top-ups for the next publish, in batches: once a seated row has used more
        than half its reserve, every seated row that has used any of it is topped up in that
        same publish. A row's pages then run out no earlier than half a reserve after a
        top-up, and the fixed cost of a publish with page work is shared by many rows (64
        staggered rows with a one-page reserve: one such publish about every 32 steps)."""
        if not (L[CAPACITY] >= self.urgent_at).any():
            return
        wanted = np.minimum(L[CAPACITY] + self.reserve_tokens, self.table.config.max_tokens_per_row)
        self.table.mark_pages((L[LEASE] >= 0) & (wanted > L[ALLOCATED]))

    def published(self, rows: list, values: np.ndarray, reserves: np.ndarray) -> None:
        """``rows`` were published with ``values`` (their six lengths) and ``reserves``: the
        capacity from which more than half a row's reserve is used is allocated -
        ceil(reserve / 2) + 1 (never for rows without a lease or at max_tokens_per_row)."""
        self.reserve_tokens[rows] = reserves
        allocated = values[:, ALLOCATED].astype(np.int64)
        never = (values[:, LEASE] < 0) | (allocated >= self.table.config.max_tokens_per_row)
        self.urgent_at[rows] = np.where(never, NEVER, allocated - (reserves + 1) // 2 + 1)
