"""A batch's device tables, their host mirror and the delta publish (BAT-1, BAT-3, HOST-1,
HOST-2).

Every page table and every length row of a batch is a view of one flat int32 device tensor, the
*table store*: ``[G, max_rows, max_pages_per_row]`` page entries, then ``[6, max_rows]`` length
rows (``memory.HISTORY`` ...). Its address never changes. The host mirror is a numpy copy of the
store as the device holds it after the last publish.

A publish writes only the entries that changed: per dirty row its six lengths, and per pool
group the page ordinals that left or entered the row's live range since the published one (a
decode step: none, or one page every ``tokens_per_page`` tokens; a hole or suspended row: a
BAD fill of the pages it had). The (index, value) pairs, plus the leases whose residency must be
cleared, go into one pinned staging buffer, travel in one host-to-device copy and are applied by
one ``index_put_`` on the current stream. Staging buffers form a ring recycled through
``Event.query()``: the host never waits on the GPU; when every buffer is still in use (the GPU
lags that many publishes behind) a new one is made.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from .config import BAD
from .memory import LEASE, LENGTH_ROWS, staging_bytes


def changed_ranges(old: tuple, new: tuple, same_owner: bool) -> list:
    """Page ordinals whose entries differ between a published live range ``old`` = (first,
    end) and the new one, as disjoint [lo, hi) ranges. Entries inside both ranges are equal
    when the owner is the same (a live page keeps its slot)."""
    (pf, pk), (f, k) = old, new
    old_empty, new_empty = pk <= pf, k <= f
    if old_empty or new_empty:
        return [r for r, empty in ((old, old_empty), (new, new_empty)) if not empty]
    if f >= pk or pf >= k:  # disjoint
        return [old, new]
    if not same_owner:
        return [(min(pf, f), max(pk, k))]
    return [(lo, hi) for lo, hi in ((min(pf, f), max(pf, f)), (min(pk, k), max(pk, k))) if lo < hi]


#: deltas of up to this many entries take the fixed-size path: the delta is padded to a power
#: of two (at least ``SMALL_DELTA``) with copies of its first entry, and the views of (padded
#: size, leases to clear) are made once, so that a publish is one copy and one scatter (plus
#: the residency clear of its new leases)
SMALL_DELTA, FAST_DELTA = 16, 4096


def bucket_of(n: int) -> int:
    """The padded size of a delta of ``n`` entries (1 <= n <= FAST_DELTA)."""
    return max(SMALL_DELTA, 1 << (n - 1).bit_length())


class _Staging:
    """One pinned staging buffer, the event of the copy that last read it, and its fixed-size
    views (per padded size: the source tensor, the index and the value arrays)."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor
        self.bytes = tensor.numpy()
        self.event: Optional[torch.cuda.Event] = None
        self.views: dict = {}

    def free(self) -> bool:
        return self.event is None or self.event.query()

    def fixed(self, b: int, lb: int) -> tuple:
        """The views of ``b`` (padded) entries and ``lb`` leases: the source bytes, then the
        index, value and lease arrays (in that order in the buffer)."""
        views = self.views.get((b, lb))
        if views is None:
            views = self.views[(b, lb)] = (
                self.tensor[:12 * b + 8 * lb], self.bytes[:8 * b].view(np.int64),
                self.bytes[8 * b:12 * b].view(np.int32),
                self.bytes[12 * b:12 * b + 8 * lb].view(np.int64))
        return views


class TableMirror:
    """The table store of a batch (device), its host mirror, and the delta publish."""

    def __init__(self, config, num_pool_groups: int, max_rows: int, allocated: dict, requests,
                 gpu_slots: int = 0):
        self.config, self.G, self.R = config, num_pool_groups, max_rows
        self.gpu_slots = gpu_slots  # the batch's GPU history pages (RSD-1; 0: none)
        self.requests = requests  # request_table.RequestTable: the owners' pages and live ranges
        self.P = config.max_pages_per_row
        self.store = allocated["tables"]
        self.cuda = self.store.device.type == "cuda"
        self.offset = self.G * max_rows * self.P  # where the length rows start
        self.page_tables = [self.store[g * max_rows * self.P:(g + 1) * max_rows * self.P]
                            .view(max_rows, self.P) for g in range(self.G)]
        end = self.offset + LENGTH_ROWS * max_rows
        self.lengths = self.store[self.offset:end].view(LENGTH_ROWS, max_rows)
        self.host = np.full(self.store.numel(), BAD, dtype=np.int32)
        self.host_lengths = self.host[self.offset:end].reshape(LENGTH_ROWS, max_rows)
        self.host_lengths[:] = 0
        self.host_lengths[LEASE] = BAD
        # GPU-resident history (RSD-1): each row's GPU page slot per page ordinal, its flag
        # (nonzero: its history is on GPU pages), and the lease resolve reads (BAD where the
        # flag is set); empty without
        self.gpu_offset = end
        gpu = gpu_slots > 0
        self.gpu_pages = self.store[end:end + max_rows * self.P * gpu].view(max_rows, self.P * gpu)
        self.flag_offset = flags = end + max_rows * self.P * gpu
        self.gpu_rows = self.store[flags:flags + max_rows * gpu]
        self.host[flags:flags + max_rows * gpu] = 0
        self.resolve_lease_offset = flags + max_rows * gpu
        self.resolve_lease = self.store[self.resolve_lease_offset:
                                        self.resolve_lease_offset + max_rows * gpu]
        self.store.copy_(torch.from_numpy(self.host))
        self.delta = allocated["delta"]
        self.delta_bytes = self.delta.numel()
        self.ring = [_Staging(allocated[name]) for name in sorted(allocated)
                     if name.startswith("staging")]
        self.published_owner: list = [None] * max_rows
        self.active = np.zeros(max_rows, dtype=bool)  # published with an owner (a lease)
        # per row and pool group: (sink pages, first live page, allocated pages) as published;
        # the entries of [0, sink pages) and [first, allocated) hold slots, the others BAD
        self.published_live = [[(0, 0, 0)] * self.G for _ in range(max_rows)]
        self._length_index = (np.arange(LENGTH_ROWS, dtype=np.int64)[:, None] * max_rows
                              + self.offset)
        # moves on at every publish and every queued read-back of the lengths (advance): the
        # lengths the device holds may have changed, so a group's write table is current only
        # while this has not moved since its resolve (DeviceStep.writes_epoch)
        self.epoch = 0
        self.extra_staging = 0  # staging buffers made beyond the reserve's
        self._next_staging = 0  # ring position to try first
        self._fixed: dict = {}  # padded sizes -> (device bytes, index, value, lease views)

    def lengths_after(self, rows: list, values: np.ndarray) -> np.ndarray:
        """The host length rows as they would be after publishing ``values`` (int32[len(rows),
        6]) for ``rows``."""
        out = self.host_lengths.copy()
        if rows:
            out[:, rows] = values.T
        return out

    def publish(self, rows: list, owners: list, slots: np.ndarray, values: np.ndarray,
                leases: list, clear_leases, lengths: Optional[tuple] = None,
                extra: Optional[tuple] = None) -> None:
        """Stage and apply the delta of ``rows`` (each with its owner cache or None for a hole
        or suspended row, the owner's request slot or -1, and its six length values:
        int32[len(rows), 6]) and clear the residency of ``leases`` (``clear_leases(device int64
        tensor)``). ``lengths``: the length rows to upload (``memory.HISTORY`` ...; None: all
        six). ``extra``: (store indices, values) of more entries in the same delta (the GPU
        history's page entries and flags, ``gpu_history.GpuHistory.plan``)."""
        requests = self.requests
        index_parts, value_parts = [], []
        published = []  # (row, owner, live ranges) whose page state changes with this delta
        moved = requests.pages_moved(slots).tolist()
        for row, owner, pages_moved in zip(rows, owners, moved):
            previous = self.published_owner[row]
            if owner is previous and not pages_moved:  # a hole, or lengths only
                continue
            live = list(self.published_live[row])
            for g in range(self.G):
                sinks, first, end, lowest = (requests.live_range(owner.slot, g) if owner is not None
                                             else (0, 0, 0, 0))
                new, old = (sinks, first, end), live[g]
                if owner is previous and new == old and lowest >= end:
                    continue
                base = (g * self.R + row) * self.P
                same = owner is previous
                # the window's range and the sink pages' (TIER-3), each as a live range
                ranges = (changed_ranges(old[1:], new[1:], same)
                          + changed_ranges((0, old[0]), (0, sinks), same))
                if same:  # pages freed and taken again since the last publish
                    for lo, hi in ((max(lowest, old[1], first), min(old[2], end)),
                                   (lowest, min(old[0], sinks))):
                        if lo < hi:
                            ranges.append((lo, hi))
                for lo, hi in ranges:
                    index_parts.append(np.arange(base + lo, base + hi, dtype=np.int64))
                    value_parts.append(requests.page_row(owner.slot, g)[lo:hi] if owner is not None
                                       else np.full(hi - lo, BAD, dtype=np.int32))
                live[g] = new
            published.append((row, owner, live))
        if extra is not None:
            index_parts.append(extra[0])
            value_parts.append(extra[1])
        if rows:
            fields = slice(None) if lengths is None else list(lengths)
            index_parts.append((self._length_index[fields] + np.asarray(rows, dtype=np.int64))
                               .ravel())
            value_parts.append(values.T[fields].ravel())
        if len(index_parts) == 1:
            index, value = index_parts[0], value_parts[0]
        elif index_parts:
            index, value = np.concatenate(index_parts), np.concatenate(value_parts)
        else:
            index, value = np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int32)
        self._upload(index, value, np.asarray(leases, dtype=np.int64), clear_leases)
        self.host[index] = value
        for row, owner, live in published:  # only once the delta is on its way
            self.published_live[row] = live
            self.published_owner[row] = owner
            self.active[row] = owner is not None
        requests.mark_published(slots)

    def _upload(self, index: np.ndarray, value: np.ndarray, leases: np.ndarray,
                clear_leases) -> None:
        n, m = len(index), len(leases)
        if n == 0 and m == 0:
            return  # nothing to upload: launch nothing
        staging = self._free_staging()
        b = bucket_of(n) if 0 < n <= FAST_DELTA else 0
        lb = m  # leases are not padded: each one clears a residency row
        if b and 12 * b + 8 * lb <= self.delta_bytes:  # fixed-size views: one copy, one scatter
            source, index_bytes, value_bytes, lease_bytes = staging.fixed(b, lb)
            index_bytes[:n] = index
            index_bytes[n:] = index[0]  # padding rewrites the first entry with its own value
            value_bytes[:n] = value
            value_bytes[n:] = value[0]
            lease_bytes[:] = leases
            fixed = self._fixed.get((b, lb))
            if fixed is None:
                device = self.delta[:12 * b + 8 * lb]
                fixed = self._fixed[(b, lb)] = (
                    device, device[:8 * b].view(torch.int64),
                    device[8 * b:12 * b].view(torch.int32), device[12 * b:].view(torch.int64))
            device, device_index, device_value, device_leases = fixed
            device.copy_(source, non_blocking=True)
            self._record(staging)
            self.store.index_put_((device_index,), device_value)
            if m:
                clear_leases(device_leases)
            return
        nbytes = 8 * m + 12 * n
        buf = staging.bytes
        buf[:8 * m].view(np.int64)[:] = leases
        buf[8 * m:8 * (m + n)].view(np.int64)[:] = index
        buf[8 * (m + n):nbytes].view(np.int32)[:] = value
        device = self.delta[:nbytes]
        device.copy_(staging.tensor[:nbytes], non_blocking=True)
        self._record(staging)
        if n:
            self.store.index_put_((device[8 * m:8 * (m + n)].view(torch.int64),),
                                  device[8 * (m + n):nbytes].view(torch.int32))
        if m:
            clear_leases(device[:8 * m].view(torch.int64))

    def _record(self, staging: _Staging) -> None:
        """Record the event of the copy that just read ``staging`` (CUDA only)."""
        if self.cuda:
            if staging.event is None:
                staging.event = torch.cuda.Event()
            staging.event.record()

    def _free_staging(self) -> _Staging:
        """A staging buffer no copy may still read: the ring's next one first (the oldest copy,
        in a steady state the only event queried), else any free one, else a new one."""
        ring, start = self.ring, self._next_staging
        for i in range(len(ring)):
            k = (start + i) % len(ring)
            if ring[k].free():
                self._next_staging = (k + 1) % len(ring)
                return ring[k]
        pin = self.store.device.type == "cuda"
        size = staging_bytes(self.config, self.G, self.R, self.gpu_slots)
        staging = _Staging(torch.zeros(size, dtype=torch.uint8, pin_memory=pin))
        self.ring.append(staging)
        self.extra_staging += 1
        self._next_staging = 0
        return staging

    def host_view(self) -> dict:
        pages = self.host[:self.offset].reshape(self.G, self.R, self.P)
        lengths = self.host_lengths
        pages.flags.writeable = False  # views share the flag with nothing else
        return {"page_tables": pages, "lengths": lengths.copy()}

