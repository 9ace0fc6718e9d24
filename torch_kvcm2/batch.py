"""Batch (REQUIREMENTS §6-8, BAT-1..4, RES, OP): rows, leases, device tables, residency and the
per-step entry points.

Every table has a fixed address for the batch's lifetime, so a captured graph keeps working
across membership changes (BAT-1). The page tables and the length rows are views of one flat
int32 table store with a host mirror (``tables.TableMirror``); ``publish`` uploads only what
changed, as one delta, with one copy and one scatter (HOST-1, HOST-2). Host-side calls
(membership, ``publish``) refuse to run during stream capture; per-step calls refuse to run with
unpublished changes (BAT-4).
"""
from __future__ import annotations

import collections
import heapq
import weakref
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import numpy as np
import torch

from . import lengths as rules
from . import ops
from ._util import bound_like, ceil_div, refuse_during_capture
from .cache import KVCache
from .config import BAD, INT32_MAX, SelectionGroup
from .memory import (ALLOCATED, CAPACITY, DECLARED, HISTORY, LEASE, WRITTEN,
                     batch_memory_bytes, batch_tensor_specs, sparse_buffers)
from .lengths_path import LengthsPath
from .tables import TableMirror

INT32 = torch.int32


def _wait_all(events: list) -> None:
    for event in events:
        event.synchronize()


@dataclass
class GroupState:
    """Residency state and per-step outputs of one selection group (REQUIREMENTS §7)."""

    spec: SelectionGroup
    resident: torch.Tensor  # int32[max_rows, S]: unit held by each slot, -1 when empty
    recency: torch.Tensor  # int32[max_rows, S]: slots, least to most recently used
    index_table: torch.Tensor  # int32[max_rows, K]: entries lease*S + slot, BAD
    # index_views[t - 1]: int32[max_rows, t, K], the index table of a step of t query tokens
    # (MTP-2); every view, index_table included, starts at the one buffer's address
    index_views: tuple
    miss_list: torch.Tensor  # int32[rows, 4]: (lease, slot, row, unit)
    miss_count: torch.Tensor  # int32[4]: [0] the count (ops.MISS_COUNT_WORDS)
    counters: torch.Tensor  # int64[3]: cumulative hits, misses, invalid
    inflight_slots: torch.Tensor  # int32[max_rows, ceil(I/U)+1]: slot of in-flight unit k, BAD
    write_table: torch.Tensor  # int32[max_rows, I+U-1]: write_indices' output
    inflight_start: torch.Tensor  # int32[max_rows]: s0 per row (BAD for unseated rows)
    # uint8: the CUDA resolve's table region for rows too wide for shared memory (CUDA groups
    # of more than one query token; docs/MTP.md), else None
    resolve_scratch: Optional[torch.Tensor] = None


class Batch(LengthsPath):
    """The rows a decode step works on, with their device tables and cell state.

    ``Batch(manager, max_rows=None)``; ``max_rows`` defaults to (and may not exceed) the
    config's. The batch's GPU and host memory (``memory.batch_tensor_specs``) come from the
    manager's batch reserve; ``close()`` returns it.

    Device tables (fixed addresses, BAT-1): ``page_tables[g]`` int32[max_rows,
    max_pages_per_row] per pool group, ``history``, ``capacity``, ``lease`` int32[max_rows], and
    ``written`` int32[max_rows] (the SAFE-2 watermark ``Batch.advance`` respects).
    The batched host path (``resize_rows``) and the device-side advance (``advance``,
    ``record_advance``, ``catch_up``) are in ``lengths_path.LengthsPath``.
    """

    def __init__(self, manager, max_rows: Optional[int] = None):
        config = manager.config
        max_rows = config.max_rows if max_rows is None else max_rows
        if isinstance(max_rows, bool) or not isinstance(max_rows, int) or not 0 < max_rows <= config.max_rows:
            raise ValueError(f"Batch: max_rows must be an int in [1, {config.max_rows}], got {max_rows!r}")
        refuse_during_capture(config.device, "Batch()")
        manager._check_open("Batch()")
        storage = manager.storage
        self.manager, self.config, self.max_rows = manager, config, max_rows
        self._memory = batch_memory_bytes(config, len(storage.groups), max_rows)
        manager.reserve.take(self._memory)
        try:
            self._build(manager, storage, config, max_rows)
        except BaseException:
            manager.reserve.give_back(self._memory)  # a failed construction holds nothing
            raise

    def _build(self, manager, storage, config, max_rows: int) -> None:
        """Every tensor and host structure of the batch (``__init__`` after the reserve)."""
        dev = config.device
        pin = dev.type == "cuda"
        allocated = {}
        for spec in batch_tensor_specs(config, len(storage.groups), max_rows):
            if spec.medium == "host":
                allocated[spec.name] = torch.zeros(spec.shape, dtype=spec.dtype, pin_memory=pin)
            else:
                allocated[spec.name] = torch.zeros(spec.shape, dtype=spec.dtype, device=dev)
        self._mirror = TableMirror(config, len(storage.groups), max_rows, allocated)
        self.page_tables = self._mirror.page_tables
        lengths = self._mirror.lengths
        self.history, self.capacity, self.lease = lengths[HISTORY], lengths[CAPACITY], lengths[LEASE]
        self.written, self._declared = lengths[WRITTEN], lengths[DECLARED]
        self._allocated = lengths[ALLOCATED]
        self.advance_counters = allocated["advance_counters"]
        # the read-backs of the device lengths (record_advance): a ring of pinned buffers, each
        # with the event of the copy into it (CUDA), and the queue of those not applied yet
        self._snapshot = allocated["snapshot"]
        self._snapshot_buffers = self._snapshot.unbind(0)  # views made once
        self._snapshot_host = self._snapshot.numpy()
        self._snapshot_events: list = [None] * self._snapshot.shape[0]
        if self._mirror.cuda:  # recorded once, so each has its cudaEvent_t from the start
            with torch.cuda.device(dev):
                self._snapshot_events = [torch.cuda.Event() for _ in self._snapshot_buffers]
                for event in self._snapshot_events:
                    event.record()
            # the ring's buffers are freed only after the copies into them have run
            finalizer = weakref.finalize(self, _wait_all, self._snapshot_events)
            finalizer.atexit = False
        self._readbacks: collections.deque = collections.deque()
        self._next_readback = 0
        self._owed = False  # a flush to a tensor of targets ran since the last read-back
        self.groups = [self._new_group_state(g, allocated) for g in config.selection_groups]
        self._residents = [s.resident for s in self.groups]  # clear_leases' arguments
        self._recencies = [s.recency for s in self.groups]
        self._shapes = rules.shapes_of(config)
        self._shape_pairs = [n for shape in self._shapes for n in shape]  # flush_watermark
        self._cells: dict[tuple[str, str], torch.Tensor] = {}
        self._fetch_args: dict[str, tuple] = {}
        self._fetch_plans: dict[tuple, tuple] = {}  # fetch(*layers)'s checked arguments
        # A group's write table is current when its last resolve saw the lengths' epoch, which
        # every publish and advance moves on (write_indices).
        self._lengths_epoch = 0
        self._writes_epoch = [-1] * len(config.selection_groups)
        for group in config.selection_groups:
            for layer in group.layers:
                self._fetch_args[layer] = self._new_cells(group, layer, allocated)
        self._flush_args = self._new_flush_args()
        # the bound tensors' shapes and device (bound_like): selections, then targets and counts
        self._selection_shapes = [tuple(state.index_table.shape) for state in self.groups]
        self._rows_shape = (max_rows,)
        self._bound_device = self.history.device
        # what group() accepts, to the group's index: layer names, selection ids, indices
        self._group_index = {layer: spec.index for spec in config.selection_groups
                             for layer in spec.layers}
        for spec in config.selection_groups:
            self._group_index[spec.index] = spec.index
            if spec.key[0] == "id":
                self._group_index[spec.key[1]] = spec.index
        self._rows: list[Optional[KVCache]] = [None] * max_rows
        self._row_lease = [BAD] * max_rows
        self._free_leases = list(range(max_rows))
        self._dirty: set[int] = set()
        self._granted: set[int] = set()  # leases whose residency publish() must clear
        self._declared_rows: set[int] = set()  # rows with new declared host writes only
        self._reserve_rows: set[int] = set()  # rows whose reserve changed since published
        self._fetch_events: dict[int, torch.cuda.Event] = {}
        self._settle: set[int] = set()  # rows advanced on the device, page work pending
        # per row: the mirror may hold lengths the device advanced that the row's cache has not
        # taken yet (sync_member takes them when the cache is next used)
        self._stale = np.zeros(max_rows, dtype=bool)
        self._reserve_tokens = np.zeros(max_rows, dtype=np.int64)  # as published, per row
        # per row, the capacity from which its reserve top-up is urgent (lengths_path)
        self._urgent_at = np.full(max_rows, np.iinfo(np.int64).max, dtype=np.int64)
        self._windowed = any(g.window is not None for g in storage.groups)
        self._closed = False
        for tensor in self.state_tensors():
            # Fixed addresses: guarded static addresses are installed in the compiled graph as
            # attributes (guarded by identity, which never changes) instead of lifted inputs, so
            # cudagraph trees neither copy them nor count their mutation as an input mutation.
            torch._dynamo.mark_static_address(tensor, guard=True)
        for state in self.groups:
            # the multi-token index tables (views of the index table's buffer; not listed by
            # state_tensors, whose tensors never overlap): fixed addresses too
            for view in state.index_views:
                torch._dynamo.mark_static_address(view, guard=True)

    def _new_group_state(self, group: SelectionGroup, allocated: dict) -> GroupState:
        g, rows, sp = group.index, self.max_rows, group.sparse
        index_buffer = allocated[f"index_table{g}"].fill_(BAD)  # int32[max_rows, T*K]
        state = GroupState(
            spec=group,
            resident=allocated[f"resident{g}"].fill_(BAD),
            recency=allocated[f"recency{g}"],
            index_table=index_buffer if sp.max_query_tokens == 1
            else index_buffer.view(-1)[:rows * sp.width].view(rows, sp.width),
            index_views=tuple(index_buffer.view(-1)[:rows * t * sp.width].view(rows, t, sp.width)
                              for t in range(1, sp.max_query_tokens + 1)),
            miss_list=allocated[f"miss_list{g}"],
            miss_count=allocated[f"miss_count{g}"],
            counters=allocated[f"counters{g}"],
            inflight_slots=allocated[f"inflight_slots{g}"].fill_(BAD),
            write_table=allocated[f"write_table{g}"].fill_(BAD),
            inflight_start=allocated[f"inflight_start{g}"].fill_(BAD),
            resolve_scratch=allocated.get(f"resolve_scratch{g}"),
        )
        state.recency.copy_(torch.arange(sp.slots, dtype=INT32).expand(rows, sp.slots))
        return state

    def _new_cells(self, group: SelectionGroup, layer: str, allocated: dict) -> tuple:
        """Cells of each non-zero sparse buffer of ``layer``: ``num_leases*S/E`` cells laid out
        like pages of that buffer; plus what fetch reads for each: its pool group's memory, its
        position in a slot, and the group's page table."""
        storage = self.manager.storage
        cells, pools, positions, tables = [], [], [], []
        for buf in sparse_buffers(self.config, layer):
            place = storage.place(layer, buf.role)
            cell = allocated[f"cells:{layer}:{buf.role}"]
            self._cells[(layer, buf.role)] = cell
            cells.append(cell)
            pool, pos = storage.pool(layer, buf.role)
            pools.append(pool)
            positions.append(pos)
            tables.append(self.page_tables[place.group])
        return cells, pools, positions, tables

    def state_tensors(self) -> list[torch.Tensor]:
        """Every tensor the per-step ops read or write (tables, residency, outputs, cells and the
        host pools' device views), each once; their addresses never change (BAT-1)."""
        tensors = [*self.page_tables, self.history, self.capacity, self.lease, self.written,
                   self._declared, self._allocated, self.advance_counters]
        for state in self.groups:
            tensors += [state.resident, state.recency, state.index_table, state.miss_list,
                        state.miss_count, state.counters, state.inflight_slots, state.write_table,
                        state.inflight_start]
            if state.resolve_scratch is not None:
                tensors.append(state.resolve_scratch)
        for cells, pools, _, _ in self._fetch_args.values():
            tensors += cells + pools
        tensors += [args[0] for args in self._flush_args]
        unique = {id(t): t for t in tensors}
        return list(unique.values())

    def _resolve_bound(self, index: int, selected: torch.Tensor, fetch: bool) -> bool:
        """Batch.resolve's eager path: ``resolve_step`` of group ``index`` with the batch's own
        tables and, with ``fetch``, the fetch of every layer of the group, when ``selected`` is
        like the group's index table (``bound_like``); False, and nothing done, otherwise."""
        state = self.groups[index]
        if not bound_like(selected, self._selection_shapes[index], self._bound_device):
            return False
        spec = state.spec
        if fetch:
            _, cells, pools, positions, tables = self._plan_of(tuple(spec.layers))
        else:
            cells = pools = positions = tables = ()
        sp = spec.sparse
        ops.resolve_step(state.resident, state.recency, state.index_table, state.miss_list,
                         state.miss_count, state.counters, state.inflight_slots,
                         state.write_table, state.inflight_start, cells, selected, self.history,
                         self.capacity, self.lease, pools, positions, tables, sp.tokens_per_unit,
                         self.config.tokens_per_page, sp.max_inflight_tokens, spec.window or 0,
                         state.resolve_scratch)
        return True

    def _flush_bound(self, new_history: torch.Tensor) -> bool:
        """Batch.flush's eager path, for targets like the batch's history (``bound_like``):
        every pool group's flush, then the watermark; False, and nothing done, otherwise."""
        if not bound_like(new_history, self._rows_shape, self._bound_device):
            return False
        for pool, positions, cells, resident, slots, table, params in self._flush_args:
            ops.flush(pool, positions, cells, resident, slots, table, new_history, self.history,
                      self.capacity, self.lease, params)
        ops.flush_watermark(self.written, self._declared, new_history, self.history,
                            self.capacity, self.lease, self._shape_pairs)
        return True

    def _new_flush_args(self) -> list[tuple]:
        """Per sparse pool group with cells: the arguments of its one flush launch, covering
        every non-zero sparse buffer of every sparse layer in it (OP-FLUSH). With a host group
        (TP-3) only this rank's share: the buffers of the layers, or the pool groups, it owns
        (``HostGroup.split``); ``_shared_pools`` are the host pools every rank orders on."""
        storage = self.manager.storage
        host_group = self.manager.host_group
        layer_index = {layer.name: i for i, layer in enumerate(self.config.layers)}
        self._shared_pools = [g.device_data for g in storage.groups if g.sparse]
        per_pool: dict[int, list] = {}
        for group, state in zip(self.config.selection_groups, self.groups):
            sp = group.sparse
            for layer in group.layers:
                for buf in sparse_buffers(self.config, layer):
                    place = storage.place(layer, buf.role)
                    if host_group is not None and not host_group.owns(layer_index[layer],
                                                                      place.group):
                        continue
                    per_pool.setdefault(place.group, []).append((
                        place.pos, self._cells[(layer, buf.role)], state.resident,
                        state.inflight_slots, (sp.slots, sp.tokens_per_unit, sp.max_inflight_tokens)))
        args = []
        for pool, entries in per_pool.items():
            positions, cells, resident, slots, params = zip(*entries)
            args.append((storage.groups[pool].device_data, list(positions), list(cells),
                         list(resident), list(slots), self.page_tables[pool],
                         [p for ps in params for p in ps]))
        return args

    # ---- membership (BAT-2) ----
    def add(self, cache: KVCache, row: Optional[int] = None) -> int:
        """Seat ``cache`` at the lowest free row (or ``row``) and give it a lease; returns the row."""
        self._check_host_call("Batch.add")
        if not isinstance(cache, KVCache):
            raise TypeError(f"Batch.add: expected a KVCache, got {type(cache).__name__}")
        if cache.manager is not self.manager:
            raise ValueError("Batch.add: the cache belongs to another manager")
        if cache.closed:
            raise RuntimeError("Batch.add: the cache is closed")
        seated_batch, seated_row = cache.seated_in
        if seated_batch is self:
            raise ValueError(f"Batch.add: the cache is already seated at row {seated_row}")
        if seated_batch is not None:
            raise ValueError("Batch.add: the cache is a member of another batch")
        if row is None:
            row = next((r for r, c in enumerate(self._rows) if c is None), None)
            if row is None:
                raise RuntimeError(f"Batch.add: all {self.max_rows} rows are occupied")
        else:
            self._check_row(row, "Batch.add")
        cache.seat(self, row)
        self._rows[row] = cache
        self._dirty.add(row)
        if not cache.suspended:
            self.grant_lease(row)
        return row

    def remove(self, cache: KVCache, discard: bool = False) -> None:
        """Unseat a member, leaving a hole that publishes BAD / 0 and is reused later.

        Refused (RuntimeError, nothing changed) while tokens are in flight (history <
        capacity): their KV lives in the lease's cells, which the next member gets. Flush and
        advance history first, or pass ``discard=True`` (the abort path): capacity shrinks back
        to history, dropping the in-flight tokens, so nothing stale is ever read."""
        self._check_host_call("Batch.remove")
        row = self._member_row(cache, "Batch.remove")
        self.catch_up()
        h, c = cache.history_length, cache.capacity
        if h < c:
            if not discard:
                raise RuntimeError(
                    f"Batch.remove: tokens are in flight (history {h} < capacity {c}); flush and "
                    f"advance history, or shrink capacity, first, or pass discard=True to drop "
                    f"them")
            cache.discard_in_flight()
        self.release_lease(row)
        self._rows[row] = None
        cache.seat(None, None)
        self._dirty.add(row)

    def move(self, cache: KVCache, row: int) -> None:
        """Move a member to an empty row, keeping its lease (hence its residency)."""
        self._check_host_call("Batch.move")
        old = self._member_row(cache, "Batch.move")
        self._check_row(row, "Batch.move")
        self.sync_member(old)
        if old in self._settle:
            self._settle.discard(old)
            self._settle.add(row)
        self._rows[old], self._rows[row] = None, cache
        self._row_lease[old], self._row_lease[row] = BAD, self._row_lease[old]
        cache.seat(self, row)
        self._dirty.update((old, row))

    def row_of(self, cache: KVCache) -> Optional[int]:
        batch, row = cache.seated_in
        return row if batch is self else None

    def members(self) -> dict[int, KVCache]:
        """Seated caches by row."""
        return {r: c for r, c in enumerate(self._rows) if c is not None}

    def lease_of(self, row: int) -> Optional[int]:
        """The lease of the member at ``row`` (None for a hole or a suspended member), as the
        next publish uploads it."""
        lease = self._row_lease[row]
        return None if lease == BAD else lease

    def _check_row(self, row, what: str) -> None:
        if isinstance(row, bool) or not isinstance(row, int) or not 0 <= row < self.max_rows:
            raise ValueError(f"{what}: row must be an int in [0, {self.max_rows}), got {row!r}")
        if self._rows[row] is not None:
            raise ValueError(f"{what}: row {row} is occupied")

    def _member_row(self, cache: KVCache, what: str) -> int:
        batch, row = cache.seated_in if isinstance(cache, KVCache) else (None, None)
        if batch is not self:
            raise ValueError(f"{what}: the cache is not a member of this batch")
        return row

    # ---- what a seated cache calls ----
    def seat_changed(self, row: int, declared_only: bool = False) -> None:
        """The cache at ``row`` changed its lengths, pages or watermarks: publish it. A change
        of only the declared host writes (``declared_only``) is published too but does not block
        per-step calls: the device needs it only for ``advance``'s watermark."""
        (self._declared_rows if declared_only else self._dirty).add(row)

    def reserve_changed(self, row: int) -> None:
        """The cache at ``row`` set a new reserve (``KVCache.set_reserve``); it takes effect at
        its next resize, which the batched path then sends through ``KVCache.resize``."""
        self._reserve_rows.add(row)

    def cell_lengths(self, row: int) -> tuple[int, int]:
        """(history, capacity) as published for the member at ``row`` with its lease: the cells
        may hold its in-flight range of these lengths; (0, 0) when it has no published lease."""
        cache = self._rows[row]
        if cache is None or self._mirror.published_owner[row] is not cache:
            return 0, 0
        L = self._mirror.host_lengths
        return int(L[HISTORY, row]), int(L[CAPACITY, row])

    def grant_lease(self, row: int) -> None:
        """Give the member at ``row`` a fresh lease (its residency is cleared at publish)."""
        lease = heapq.heappop(self._free_leases)  # never empty: one lease per row
        self._row_lease[row] = lease
        self._granted.add(lease)
        self._dirty.add(row)

    def release_lease(self, row: int) -> None:
        """Take the lease of the member at ``row`` back (suspend, remove)."""
        lease = self._row_lease[row]
        if lease != BAD:
            heapq.heappush(self._free_leases, lease)
            self._granted.discard(lease)
            self._row_lease[row] = BAD
        self._dirty.add(row)

    # ---- publish (BAT-3, HOST-1, HOST-2) ----
    def publish(self) -> None:
        """Upload what changed since the last publish (lengths of changed rows, page entries
        allocated or freed, holes and suspended rows as BAD / 0) as one delta, with one copy
        from a pinned staging buffer and one scatter, on the current stream, without waiting on
        the GPU; clear the residency of newly granted leases. Raises ValueError, publishing
        nothing, when the in-flight tokens over all rows exceed ``max_total_input_tokens``."""
        self._check_host_call("Batch.publish")
        if self.pending_readback:
            # the read-backs of advance() that have arrived are applied first; the newest is
            # waited for only when there are changes of the host to publish (the mirror must not
            # take an older read-back after this publish's delta)
            self.catch_up(wait=bool(self._dirty or self._granted or self._declared_rows))
        pages_only = False
        if self._settle:
            # page work for rows advance() moved (reserve top-ups, windowed releases), planned
            # from the lengths the host has: with a read-back still in flight they are a step or
            # two old, so such a publish only adds pages (a smaller reserve frees pages at a
            # publish without one in flight), leaves the device's lengths alone and uploads page
            # entries and allocated tokens only
            pages_only = self.pending_readback
            for row in sorted(self._settle):
                cache = self._rows[row]
                if cache is not None and not cache.suspended:
                    cache.retake_pages(wait=False, grow_only=pages_only)
            self._settle.clear()
        if not self._dirty and not self._granted and not self._declared_rows:
            return
        rows = sorted(self._dirty | self._declared_rows) if self._declared_rows else sorted(self._dirty)
        owners, values, reserves = [], [], []
        row_lease, members = self._row_lease, self._rows
        for row in rows:
            cache, lease = members[row], row_lease[row]
            if cache is None or lease == BAD:  # hole or suspended: BAD / 0
                owners.append(None)
                values.append((0, 0, BAD, 0, 0, 0))
                reserves.append(0)
            else:
                owners.append(cache)
                h, c, written, declared, allocated, reserve = cache.lengths_row()
                values.append((h, c, lease, written, declared, allocated))
                reserves.append(reserve)
        values = np.array(values, dtype=np.int32)
        lengths = self._mirror.lengths_after(rows, values)
        width = self._flush_width(lengths)
        if width > self.config.max_total_input_tokens:
            raise ValueError(
                f"Batch.publish: {width} in-flight tokens over all rows exceed "
                f"max_total_input_tokens ({self.config.max_total_input_tokens}), the bound of "
                f"the flush work list; nothing was published")
        leases = sorted(self._granted)
        self._mirror.publish(rows, owners, values, leases, self._clear_leases,
                             lengths=(ALLOCATED,) if pages_only else None)
        self._lengths_epoch += 1
        self._reserve_tokens[rows] = reserves
        self._urgent_at[rows] = self.urgent_capacity(values, np.asarray(reserves, dtype=np.int64))
        if self._reserve_rows and not pages_only:  # a pages-only publish may keep old pages
            self._reserve_rows.difference_update(rows)
        self._dirty.clear()
        self._granted.clear()
        self._declared_rows.clear()

    def _clear_leases(self, leases: torch.Tensor) -> None:
        """Empty residency for the device int64 ``leases`` (a lease that changed owner), in
        every selection group at once."""
        ops.clear_leases(self._residents, self._recencies, leases)

    @property
    def published(self) -> bool:
        return not self._dirty and not self._granted

    def host_tables(self) -> dict:
        """The host mirror of the device tables as numpy arrays (what the device holds after
        the last publish, unless ``advance`` moved lengths since): ``page_tables`` [G, max_rows,
        max_pages_per_row] and ``lengths`` [6, max_rows] (history, capacity, lease, written,
        declared, allocated tokens). Read-only views."""
        return self._mirror.host_view()

    # ---- per-step entry points (REQUIREMENTS §8) ----
    def group(self, group: Union[int, str]) -> GroupState:
        """A selection group's state, by index, by its ``selection_id`` or by the name of one of
        its layers."""
        if isinstance(group, str):
            for spec in self.config.selection_groups:
                if spec.key == ("id", group):
                    return self.groups[spec.index]
            if all(layer.name != group for layer in self.config.layers):
                raise KeyError(f"unknown selection group or layer {group!r}")
            return self.groups[self.config.group_of(group).index]
        if isinstance(group, bool) or not isinstance(group, int) or not 0 <= group < len(self.groups):
            raise KeyError(f"unknown selection group or layer {group!r} (there are "
                           f"{len(self.groups)} selection groups)")
        return self.groups[group]

    def resolve(self, group: Union[int, str], selected: torch.Tensor,
                out: Optional[torch.Tensor] = None, fetch: Union[bool, Sequence[str]] = False
                ) -> torch.Tensor:
        """OP-RESOLVE for one selection group: ``selected`` int32[max_rows, K] unit ordinals
        (negative = padding), or int32[max_rows, T', K] for a step of ``1 <= T' <= T`` query
        tokens per row (T = ``max_query_tokens``; MTP-2). Returns the index table of the same
        shape, entries ``lease*S + slot`` (BAD for padding and invalid ordinals): the batch's own
        unless ``out`` is given. Updates residency, the group's miss list and counters, and the
        group's write indices (``write_indices`` returns them).

        ``fetch``: also fetch the misses into the cells of every layer of the group (True) or of
        the named layers of it (a layer name or a sequence of them), as ``fetch(*layers)`` right
        after would; False (default) leaves the fetch to the caller, per layer or several at
        once. Resolve, write indices and fetch run in one call (OP-STEP: one op instead of three,
        which is what an eager step spends its host time on).

        A multi-token step resolves the union of each row's T' selections once (MTP-3, docs/MTP.md):
        a unit selected by several query tokens is one hit or one miss, in one slot, and every
        token's entry for it is the same. The batch's own tables for every T' share one address
        (fixed, BAT-1); T' is part of the shape, so a captured graph serves one T'."""
        index = self._group_index.get(group) if group.__class__ in (int, str) else None
        if (index is not None and not torch.compiler.is_compiling() and out is None
                and fetch.__class__ is bool and selected.__class__ is torch.Tensor
                and not self._fetch_events and self._step_ready()):
            # the eager path (_resolve_bound), when the selection is like the index table;
            # anything else takes the checks below and the op
            if self._resolve_bound(index, selected, fetch):
                self._writes_epoch[index] = self._lengths_epoch
                return self.groups[index].index_table
        state = self.group(group)
        self._check_step("Batch.resolve")
        sp = state.spec.sparse
        tokens = self._check_selection("selected", selected, sp)
        table = state.index_table if selected.dim() == 2 else state.index_views[tokens - 1]
        if out is not None:
            self._check_index_tensor("out", out, 0, tuple(selected.shape))
            table = out
        if fetch is False:
            cells = pools = positions = tables = ()
        else:
            if fetch is True:
                layers = state.spec.layers
            elif isinstance(fetch, str):
                layers = (fetch,)
            elif isinstance(fetch, (tuple, list)) and fetch:
                layers = tuple(fetch)
            else:
                raise TypeError(f"Batch.resolve: fetch must be False, True (every layer of the "
                                f"group) or a non-empty sequence of the group's layer names, got "
                                f"{fetch!r}")
            fetched, cells, pools, positions, tables = self._plan_of(layers)
            if fetched is not state:
                raise ValueError(f"Batch.resolve: fetch names layers of another selection group "
                                 f"than {state.spec.name!r}: {list(layers)}")
        if self._fetch_events:
            self._wait_fetches(state)
        ops.resolve_step(state.resident, state.recency, table, state.miss_list, state.miss_count,
                         state.counters, state.inflight_slots, state.write_table,
                         state.inflight_start, cells, selected, self.history, self.capacity,
                         self.lease, pools, positions, tables, sp.tokens_per_unit,
                         self.config.tokens_per_page, sp.max_inflight_tokens,
                         state.spec.window or 0, state.resolve_scratch)
        if not torch.compiler.is_compiling():  # traced: no host state (write_indices knows)
            self._writes_epoch[state.spec.index] = self._lengths_epoch
        return table

    def fetch(self, *layers: str) -> None:
        """OP-FETCH: copy every unit missed by the group's last resolve into the cells of each
        given layer, all of one selection group, in one launch (up to 8 buffers per launch).
        Every layer of the group must be fetched after each resolve of the group: per layer just
        before its attention, or several at once, which keeps more copies in flight."""
        state, cells, pools, positions, tables = self._plan_of(layers)
        self._check_step("Batch.fetch")
        if cells:
            ops.fetch(cells, pools, positions, tables, state.miss_list, state.miss_count,
                      state.spec.sparse.slots, state.spec.sparse.tokens_per_unit)

    def _plan_of(self, layers: tuple) -> tuple:
        """``_fetch_plan(layers)``, kept per tuple of layers outside torch.compile (traced once
        there: a cache would only add guards)."""
        if torch.compiler.is_compiling():
            return self._fetch_plan(layers, keep=False)
        return self._fetch_plans.get(layers) or self._fetch_plan(layers)

    def _fetch_plan(self, layers: tuple, keep: bool = True) -> tuple:
        """The checked arguments of ``fetch(*layers)``, kept per tuple of layers (a step names
        the same layers every time) unless ``keep`` is False: (group state, cells, host pools,
        positions, tables)."""
        if not layers:
            raise TypeError("Batch.fetch: name at least one layer")
        args = [self._layer_args(layer) for layer in layers]
        group = self.config.group_of(layers[0])
        for layer in layers[1:]:
            if self.config.group_of(layer) is not group:
                raise ValueError(f"Batch.fetch: layers {layers[0]!r} and {layer!r} are in different "
                                 f"selection groups; one fetch serves one group's miss list")
        if len(set(layers)) != len(layers):
            raise ValueError(f"Batch.fetch: a layer is named twice in {list(layers)}")
        cells, pools, positions, tables = ([x for a in args for x in a[i]] for i in range(4))
        plan = (self.groups[group.index], cells, pools, positions, tables)
        if keep:
            self._fetch_plans[layers] = plan
        return plan

    def fetch_sparse_pages(self, layer: str, selected: torch.Tensor,
                           out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """OP-FETCH-FUSED: resolve + fetch for a layer alone in its selection group (a shared
        group raises ValueError: resolve once, then fetch per layer). ``selected`` and the
        returned index table have ``resolve``'s shapes: int32[max_rows, K] or
        int32[max_rows, T', K]."""
        self._layer_args(layer)
        group = self.config.group_of(layer)
        if len(group.layers) != 1:
            raise ValueError(
                f"Batch.fetch_sparse_pages: layer {layer!r} shares selection group "
                f"{group.name!r} with {len(group.layers) - 1} other layer(s); call resolve once "
                f"per step and fetch per layer")
        return self.resolve(group.index, selected, out, fetch=(layer,))

    def write_indices(self, group: Union[int, str], out: Optional[torch.Tensor] = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """OP-WRITE: where each row writes its in-flight tokens' KV this step. Returns
        ``(indices int32[max_rows, I+U-1], start int32[max_rows])``: token ``start[r] + j`` of
        row r goes to cell token index ``indices[r, j]`` (cell ``// P``, row in cell ``% P``);
        BAD beyond the in-flight range and for holes and suspended rows. Tokens in
        ``[history, start)`` are written straight to host pages (``host_token_indices``).

        The group's resolve computes them in the same call (from the lengths and residency it
        leaves): without ``out``, after this step's resolve, they are returned as they are, the
        batch's own tensors, with no launch; after a publish or ``advance`` (or ``record_advance``)
        with no resolve since, and into an ``out``, the ``write_indices`` op computes them again.
        Inside ``torch.compile`` they are always resolve's: resolve the group first, as the
        model's write needs."""
        index = self._group_index.get(group) if group.__class__ in (int, str) else None
        if (index is not None and out is None and not torch.compiler.is_compiling()
                and self._writes_epoch[index] == self._lengths_epoch and self._step_ready()):
            # after this step's resolve: its tables, before any other Python
            state = self.groups[index]
            return state.write_table, state.inflight_start
        state = self.group(group)
        self._check_step("Batch.write_indices")
        if out is None:
            if (torch.compiler.is_compiling()
                    or self._writes_epoch[state.spec.index] == self._lengths_epoch):
                return state.write_table, state.inflight_start
            out = state.write_table
        sp = state.spec.sparse
        self._check_index_tensor("out", out, state.write_table.shape[1])
        ops.write_indices(out, state.inflight_start, state.resident, state.inflight_slots,
                          self.history, self.capacity, self.lease, sp.tokens_per_unit,
                          sp.max_inflight_tokens)
        return out, state.inflight_start

    def flush(self, new_history=None) -> None:
        """OP-FLUSH: write back every in-flight token below the row's new history from its cell
        to its host page, for every sparse buffer of every sparse layer, one launch per sparse
        pool group. ``new_history``: None (every in-flight token: the published capacity), a
        sequence of ``max_rows`` ints in [0, 2**31), or an int32[max_rows] tensor.

        Afterwards ``KVCache.resize`` may advance a row's history through what was flushed
        (SAFE-2) -- over the in-flight range only: tokens below it must have been declared
        written (``record_host_writes``) before the flush. The device watermark ``written`` is
        updated by the same rule (what ``advance`` respects). The host's watermark is exact:
        for None or a sequence the host applies the rule itself; for a tensor (whose values
        the host does not read: on CUDA that would synchronise) it takes the device's
        watermark through the read-back of the lengths, queued by the next ``record_advance``
        (``advance`` right after, or the first host call that needs a length) and applied when
        the host next needs a length, so it never claims more than the flush wrote. The device
        watermark sees only published declarations: publish after ``record_host_writes`` and
        before a flush to a tensor. Inside ``torch.compile`` or stream capture the host
        bookkeeping is skipped: call ``record_flush()`` (None or sequence targets) or
        ``record_advance()`` (tensor targets, or a graph that also advances) after the
        compiled call or the replay. The work-list bound (``max_total_input_tokens``) is
        enforced by ``publish``."""
        self._check_step("Batch.flush")
        if new_history.__class__ is torch.Tensor and not torch.compiler.is_compiling():
            # the eager path (_flush_bound): targets like the batch's history
            if self._flush_bound(new_history):
                if self.config.device.type != "cuda" or not torch.cuda.is_current_stream_capturing():
                    self._owed = True  # a read-back queued before this flush lacks its watermark
                return
        known = None  # host-visible per-row targets
        from_device = False  # the host takes the device's watermark through the read-back
        if new_history is None:
            target = self.capacity
        else:
            if isinstance(new_history, torch.Tensor):
                self._check_not_meta("new_history", new_history)
                from_device = True
                target, dev, where = new_history, self.config.device, new_history.device
                if where.type != dev.type or (dev.index is not None and where.index != dev.index):
                    target = new_history.to(dev)  # e.g. targets computed on the host
            elif isinstance(new_history, (int, float, np.integer)):
                raise TypeError(
                    f"Batch.flush: new_history must be None (every in-flight token), a sequence of "
                    f"{self.max_rows} ints (one per row) or an int32[{self.max_rows}] tensor, got "
                    f"{type(new_history).__name__} {new_history!r}")
            else:
                known = self._int_sequence("new_history", new_history)
                target = torch.tensor(known, dtype=INT32).to(self.config.device)
            self._check_rows_tensor("new_history", target)
        for pool, positions, cells, resident, slots, table, params in self._flush_args:
            ops.flush(pool, positions, cells, resident, slots, table, target, self.history,
                      self.capacity, self.lease, params)
        ops.flush_watermark(self.written, self._declared, target, self.history, self.capacity,
                            self.lease, self._shape_pairs)
        if torch.compiler.is_compiling():
            return
        if self.config.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return
        if from_device:  # a read-back queued before this flush lacks its watermark
            self._owed = True
        else:
            self.record_flush(known)

    def sync(self) -> None:
        """TP-3, the ordering point of the ranks of a host group (nothing without one): this
        rank signals that its writes to the shared host pools are done (``rank_signal``), then
        waits until every rank has signalled as often (``rank_wait``). Both are device ops, so
        they are captured with the step and hold inside CUDA graphs. Every write to the shared
        pools before the sync (this rank's share of ``flush``, host-direct writes) is visible to
        every rank after it, and every read before it (``fetch``) completes before any rank's
        write after it. Each rank writes back only its share of the sparse buffers
        (``HostGroup.split``), so the rule a model follows is: exactly one ``sync()`` per step,
        after the previous step's ``flush`` (and host-direct writes) and before this step's
        first ``resolve``/``fetch``; every rank makes the same calls. Host-direct writes go
        between two syncs (after one, read only after the next; from the CPU on CUDA, after the
        first has completed on the device: docs/TP.md). A rank that died or left
        makes it raise RuntimeError naming the rank and generation (CPU), or trap (CUDA;
        ``KVCacheManager.check_ranks`` then reports the rank), within the group's timeout."""
        self.manager._check_open("Batch.sync")
        if self._closed:
            raise RuntimeError("Batch.sync: the batch is closed")
        group = self.manager.host_group
        if group is not None:
            group.signal(self._shared_pools)
            group.wait(self._shared_pools)

    def record_flush(self, new_history: Optional[list] = None) -> None:
        """Host bookkeeping of a flush (the SAFE-2 watermark, KVCache.written): every seated
        row's tokens up to ``min(new_history[row], published capacity)`` are on its host pages
        when its tokens below the in-flight range were (the capacity when ``new_history`` is
        None). ``flush`` calls it for None and sequence targets; call it yourself after
        replaying a captured graph that contains such a flush. A graph whose flush takes a
        tensor of targets is followed by ``record_advance()`` instead (the device's own
        watermark comes back with the lengths). A row credits the cache that was published
        there, and only while it still sits there (a member removed or moved since has nothing
        of this flush to claim)."""
        self._check_host_call("Batch.record_flush")
        if self.pending_readback:
            # the device lengths are ahead of the host (advance): its watermark, computed by
            # the flush itself, comes back with a fresh read-back of the lengths
            self.record_advance()
            return
        L = self._mirror.host_lengths
        if new_history is None:
            target = L[CAPACITY]
        else:
            target = np.asarray(list(new_history), dtype=np.int64)
            if target.shape != (self.max_rows,):
                raise ValueError(f"Batch.record_flush: new_history must have {self.max_rows} "
                                 f"values (one per row), got {len(target)}")
        # the device's watermark (Batch.flush applies the same rule to the published values)
        watermark = rules.flushed_watermark(L[HISTORY], L[CAPACITY], L[WRITTEN], L[DECLARED],
                                            target, self._shapes, np.maximum, np.minimum, np.where)
        seated = L[LEASE] >= 0
        owners = self._mirror.published_owner
        still = [row for row in np.flatnonzero(seated).tolist()
                 if owners[row] is not None and owners[row] is self._rows[row]]
        grown = [(row, int(watermark[row])) for row in still
                 if watermark[row] > L[WRITTEN, row] and row not in self._declared_rows]
        declared = [(row, int(L[HISTORY, row]), int(L[CAPACITY, row]), int(target[row]))
                    for row in still if row in self._declared_rows]
        for row, w in grown:
            self._rows[row].take_written(w)
        for row, h, c, t in declared:  # declarations the device has not seen yet
            self._rows[row].record_flush(h, c, t)
        L[WRITTEN] = np.where(seated, watermark, L[WRITTEN])

    def record_host_writes(self, ends=None) -> None:
        """Declare, for every seated row with a lease, that its host-direct tokens were written
        straight to host pages (``KVCache.record_host_write``): ``ends`` None (each row's whole
        host-direct range of the published lengths) or a sequence of ``max_rows`` ints (a row's
        end; 0 declares nothing). Call it after writing through ``host_token_indices`` and
        before the step's ``flush``. Raises ValueError, declaring nothing, when an end is past
        its row's host-direct range."""
        self._check_host_call("Batch.record_host_writes")
        self.catch_up()
        if ends is not None:
            ends = self._int_sequence("ends", ends)
        L = self._mirror.host_lengths
        declarations = []
        for row, cache in enumerate(self._rows):
            if cache is None or self._row_lease[row] == BAD:
                continue
            end = (rules.host_direct_end(int(L[HISTORY, row]), int(L[CAPACITY, row]),
                                         self._shapes, max) if ends is None else ends[row])
            if end > cache.host_direct_end:
                raise ValueError(
                    f"Batch.record_host_writes: row {row}'s end ({end}) is past its host-direct "
                    f"range, which ends at {cache.host_direct_end}; nothing was declared")
            if end:
                declarations.append((cache, end))
        for cache, end in declarations:  # all checked: none can raise
            cache.record_host_write(end)

    def _flush_width(self, lengths: np.ndarray) -> int:
        """The most in-flight tokens a flush can write back over all rows with these host length
        rows: the flush work-list bound of OP-FLUSH."""
        # holes and suspended rows publish lengths 0 / 0 (width 0), and s0 <= c for h <= c:
        # every width is >= 0 without a mask (int32 suffices: c - I >= -2**31)
        h, c = lengths[HISTORY], lengths[CAPACITY]
        widest = 0
        for shape in self._shapes:
            widest = max(widest, int((c - rules.inflight_start(h, c, shape, np.maximum)).sum()))
        return widest

    def host_token_indices(self, layer: str, role: str, positions: torch.Tensor,
                           out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The prefill path: token indices of ``positions`` (int32[max_rows, N] token positions,
        negative = padding) in the buffer's view ``manager.buffer_view(layer, role)`` (token
        ``i`` is ``view[i // P, :, i % P]``), BAD for padding and positions beyond capacity.
        Write tokens ``[history, inflight_start)`` of a row straight to host pages with it, then
        declare them (``record_host_writes``) before the step's flush (docs/HOST_PATH.md)."""
        storage = self.manager.storage
        place = storage.place(layer, role)
        self._check_step("Batch.host_token_indices")
        if place.group is None:
            raise KeyError(f"buffer {role!r} of layer {layer!r} is zero-size: it has no pages")
        if not isinstance(positions, torch.Tensor) or positions.dim() != 2:
            raise ValueError("positions must be a 2-D int32 tensor [max_rows, N]")
        self._check_index_tensor("positions", positions, positions.shape[1])
        if out is None:
            out = torch.empty_like(positions)
        else:
            self._check_index_tensor("out", out, positions.shape[1])
        scale = storage.groups[place.group].scale
        ops.convert_token_indices(out, positions, self.page_tables[place.group], self.capacity,
                                  scale, place.pos, self.config.tokens_per_page)
        return out

    def record_fetch(self, group: Union[int, str]) -> None:
        """The ordering contract of REQUIREMENTS §8 across streams: call on the stream that ran a fetch
        of ``group`` (after it); the group's next ``resolve`` makes its stream wait for it.
        Not needed when every op of a group runs on one stream. CUDA only; eager only."""
        state = self.group(group)
        if self.config.device.type != "cuda":
            return
        event = self._fetch_events.setdefault(state.spec.index, torch.cuda.Event())
        event.record()

    def _wait_fetches(self, state: GroupState) -> None:
        event = self._fetch_events.pop(state.spec.index, None)
        if event is not None:
            torch.cuda.current_stream().wait_event(event)

    def cells(self, layer: str, role: str) -> torch.Tensor:
        """The cells of a sparse buffer: uint8[max_rows*S/E, chunks, P, B/chunks]; the token with
        index ``i`` (from write_indices or entry*U + t mod U) is ``[i // P, :, i % P]``."""
        try:
            return self._cells[(layer, role)]
        except KeyError:
            raise KeyError(f"no cells for buffer {role!r} of layer {layer!r} (unknown, dense "
                           f"or zero-size)") from None

    # ---- counters and inspection (OP-COUNT, OP-INSPECT) ----
    def hit_miss(self, group: Union[int, str]) -> torch.Tensor:
        """The group's live device counters int64[hits, misses, invalid]; no synchronisation."""
        return self.group(group).counters

    def hit_rate(self, group: Union[int, str]) -> dict:
        """Counters as Python numbers (synchronises), with hit_rate = hits / (hits + misses)."""
        hits, misses, invalid = self.group(group).counters.tolist()
        total = hits + misses
        return {"hits": hits, "misses": misses, "invalid": invalid,
                "hit_rate": hits / total if total else 0.0}

    def inspect(self, group: Union[int, str], row: int) -> dict:
        """A row's resident units, least to most recently used, and its pinned (in-flight)
        units, as Python data (synchronises). Uses the published lengths."""
        state = self.group(group)
        if isinstance(row, bool) or not isinstance(row, int) or not 0 <= row < self.max_rows:
            raise ValueError(f"Batch.inspect: row must be in [0, {self.max_rows}), got {row!r}")
        lease = int(self.lease[row])
        if lease == BAD:
            return {"lease": None, "resident": [], "pinned": []}
        resident = state.resident[lease].tolist()
        order = [resident[s] for s in state.recency[lease].tolist() if resident[s] != BAD]
        sp = state.spec.sparse
        h, c = int(self.history[row]), int(self.capacity[row])
        s0 = sp.inflight_start(h, c)
        first, end = s0 // sp.tokens_per_unit, ceil_div(c, sp.tokens_per_unit)
        pinned = [u for u in order if s0 < c and first <= u < end]
        return {"lease": lease, "resident": order, "pinned": pinned}

    # ---- lifetime ----
    def close(self, discard: bool = False) -> None:
        """Unseat every member and return the batch's memory to the manager's reserve. Refused
        (RuntimeError, nothing changed) while a member has tokens in flight, unless
        ``discard=True`` (see ``remove``)."""
        self._check_host_call("Batch.close")
        self.catch_up()
        members = list(self.members().values())
        if not discard:
            for cache in members:
                if cache.history_length < cache.capacity:
                    raise RuntimeError(
                        f"Batch.close: {cache!r} has tokens in flight; flush and advance history "
                        f"first, or pass discard=True to drop them")
        for cache in members:
            self.remove(cache, discard=True)
        self._closed = True
        self.manager.reserve.give_back(self._memory)

    # ---- checks ----
    def _check_host_call(self, what: str) -> None:
        self.manager._check_open(what)
        if self._closed:
            raise RuntimeError(f"{what}: the batch is closed")
        refuse_during_capture(self.config.device, what)

    def _step_ready(self) -> bool:
        """What ``_check_step`` asks, as a predicate (the eager fast paths; the checks raise)."""
        return (not self._dirty and not self._granted and not self._closed
                and not self.manager._closed)

    def _check_step(self, what: str) -> None:
        self.manager._check_open(what)
        if self._closed:
            raise RuntimeError(f"{what}: the batch is closed")
        if not self.published:
            raise RuntimeError(f"{what}: the batch has unpublished changes; call publish() first")

    def _layer_args(self, layer: str) -> tuple:
        try:
            return self._fetch_args[layer]
        except KeyError:
            self.config.layer(layer)  # KeyError for an unknown layer
            raise KeyError(f"layer {layer!r} has no sparse buffers") from None

    def _check_not_meta(self, name: str, t: torch.Tensor) -> None:
        if t.device.type == "meta":
            raise ValueError(f"{name} is on the meta device (it has no values); pass a tensor on "
                             f"{self.config.device}")

    def _check_rows_tensor(self, name: str, t) -> None:
        """An int32[max_rows] tensor on the batch's device."""
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be an int32[{self.max_rows}] tensor, got "
                            f"{type(t).__name__}")
        self._check_index_tensor(name, t, 0, (self.max_rows,))

    def _int_sequence(self, name: str, values, length: Optional[int] = -1) -> list[int]:
        """``values`` (a sequence, numpy array or tensor of ints in [0, 2**31)) as a list of
        ints, of ``length`` entries (-1: one per row; None: any)."""
        n = self.max_rows if length == -1 else length
        if isinstance(values, torch.Tensor):
            self._check_not_meta(name, values)
            values = values.tolist()
        elif isinstance(values, np.ndarray):
            values = values.tolist()
        if isinstance(values, (str, bytes, dict)) or not hasattr(values, "__len__"):
            count = "" if n is None else f"{n} "
            raise TypeError(f"{name} must be a sequence of {count}ints or a tensor (one value per "
                            f"row), got {type(values).__name__} {values!r}")
        values = list(values)
        if n is not None and len(values) != n:
            raise ValueError(f"{name} must have {n} values (one per row), got {len(values)}")
        if all(type(v) is int for v in values) and (
                not values or (min(values) >= 0 and max(values) <= INT32_MAX)):
            return values  # plain ints in range (the common case, checked without a loop)
        for v in values:
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise TypeError(f"{name} values must be ints, got {type(v).__name__} {v!r}")
            if not 0 <= v <= INT32_MAX:
                raise ValueError(f"{name} values must be in [0, 2**31 - 1], got {v}")
        return [int(v) for v in values]

    def _check_selection(self, name: str, t: torch.Tensor, sp) -> int:
        """Checks a selection for ``resolve`` (int32 [max_rows, K] or [max_rows, T', K] with
        1 <= T' <= max_query_tokens, on the device, contiguous); returns its T'."""
        if isinstance(t, torch.Tensor) and t.dim() == 2:
            self._check_index_tensor(name, t, sp.width)
            return 1
        T = sp.max_query_tokens
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            self._check_index_tensor(name, t, 0, ())  # a non-tensor, a wrong dtype or device
            raise ValueError(f"{name} must be 2-D ({self.max_rows}, {sp.width}) or 3-D "
                             f"({self.max_rows}, query tokens 1..{T}, {sp.width}), got "
                             f"{t.dim()}-D shape {tuple(t.shape)}")
        tokens = t.shape[1]
        if not 1 <= tokens <= T:
            self._check_index_tensor(name, t, 0, ())
            raise ValueError(f"{name} has {tokens} query tokens per row (shape {tuple(t.shape)}) "
                             f"but the selection group allows 1..{T} (max_query_tokens, MTP-2)")
        self._check_index_tensor(name, t, 0, (self.max_rows, tokens, sp.width))
        return tokens

    def _check_index_tensor(self, name: str, t: torch.Tensor, width: int,
                            shape: Optional[tuple] = None) -> None:
        """Checks an int32 device tensor of shape (max_rows, width), or ``shape`` when given
        (``()`` checks everything but the shape)."""
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
        device, dev = t.device, self.config.device
        if device.type == "meta":
            self._check_not_meta(name, t)
        if t.dtype != INT32:
            raise TypeError(f"{name} must be int32, got {t.dtype}")
        if device.type != dev.type or (dev.index is not None and device.index != dev.index):
            raise ValueError(f"{name} must be on {self.config.device}, got {device}")
        want = (self.max_rows, width) if shape is None else shape
        if want != () and tuple(t.shape) != want:
            raise ValueError(f"{name} must have shape {want}, got {tuple(t.shape)}")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
