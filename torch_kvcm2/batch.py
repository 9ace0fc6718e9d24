"""Batch (SPEC §6-8, BAT-1..4, RES, OP): rows, leases, device tables, residency and the
per-step entry points.

Every table has a fixed address for the batch's lifetime, so a captured graph keeps working
across membership changes (BAT-1). Host-side calls (membership, ``publish``) refuse to run during
stream capture; per-step calls refuse to run with unpublished changes (BAT-4).
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Union

import torch

from . import ops
from ._util import ceil_div, refuse_during_capture
from .config import BAD, CacheConfig, SelectionGroup

if TYPE_CHECKING:
    from .cache import KVCache
    from .manager import KVCacheManager

INT32 = torch.int32


def _miss_list_rows(group: SelectionGroup, max_rows: int) -> int:
    return max_rows * (group.sparse.width + group.sparse.max_inflight_units)


def _sparse_buffers(config: CacheConfig, layer: str):
    """The non-zero sparse buffers of a layer: the ones with cells and copies (CFG-6)."""
    return [b for b in config.layer(layer).sparse_buffers if b.bytes_per_token > 0]


def batch_memory_bytes(config: CacheConfig, num_pool_groups: int, max_rows: int) -> dict:
    """GPU bytes (tables, residency, cells, scratch) and host bytes (pinned staging) of a batch."""
    pages = config.max_pages_per_row
    width = num_pool_groups * pages + 3
    gpu = num_pool_groups * max_rows * pages * 4 + 3 * max_rows * 4  # page tables, lengths, lease
    gpu += max_rows * width * 4 + 2 * max_rows * 8  # publish scratch (payload, rows, leases)
    for group in config.selection_groups:
        sp = group.sparse
        gpu += 2 * max_rows * sp.slots * 4 + max_rows * sp.width * 4  # resident, recency, index
        gpu += _miss_list_rows(group, max_rows) * ops.MISS_FIELDS * 4 + 4 + ops.NUM_COUNTERS * 8
        gpu += max_rows * (sp.max_inflight_units + sp.max_inflight_tokens + sp.tokens_per_unit) * 4
        for layer in group.layers:
            for buf in _sparse_buffers(config, layer):
                gpu += max_rows * sp.slots * sp.tokens_per_unit * buf.bytes_per_token  # cells
    host = 2 * (max_rows * width * 4 + 2 * max_rows * 8)  # double-buffered staging
    return {"gpu": gpu, "host": host}


@dataclass
class GroupState:
    """Residency state and per-step outputs of one selection group (SPEC §7)."""

    spec: SelectionGroup
    resident: torch.Tensor  # int32[max_rows, S]: unit held by each slot, -1 when empty
    recency: torch.Tensor  # int32[max_rows, S]: slots, least to most recently used
    index_table: torch.Tensor  # int32[max_rows, K]: entries lease*S + slot, BAD
    miss_list: torch.Tensor  # int32[rows, 4]: (lease, slot, row, unit)
    miss_count: torch.Tensor  # int32[4]: [0] the count (ops.MISS_COUNT_WORDS)
    counters: torch.Tensor  # int64[3]: cumulative hits, misses, invalid
    inflight_slots: torch.Tensor  # int32[max_rows, ceil(I/U)+1]: slot of in-flight unit k, BAD
    write_table: torch.Tensor  # int32[max_rows, I+U-1]: write_indices' output
    inflight_start: torch.Tensor  # int32[max_rows]: s0 per row (BAD for unseated rows)


class Batch:
    """The rows a decode step works on, with their device tables and cell state.

    ``Batch(manager, max_rows=None)``; ``max_rows`` defaults to (and may not exceed) the
    config's. The batch's GPU and host memory come from the manager's batch reserve; ``close()``
    returns it.
    """

    def __init__(self, manager: "KVCacheManager", max_rows: Optional[int] = None):
        config = manager.config
        max_rows = config.max_rows if max_rows is None else max_rows
        if isinstance(max_rows, bool) or not isinstance(max_rows, int) or not 0 < max_rows <= config.max_rows:
            raise ValueError(f"Batch: max_rows must be an int in [1, {config.max_rows}], got {max_rows!r}")
        refuse_during_capture(config.device, "Batch()")
        storage = manager.storage
        self.manager, self.config, self.max_rows = manager, config, max_rows
        self._memory = batch_memory_bytes(config, len(storage.groups), max_rows)
        manager._charge(self._memory)
        dev, pages = config.device, config.max_pages_per_row
        self.page_tables = [torch.full((max_rows, pages), BAD, dtype=INT32, device=dev)
                            for _ in storage.groups]
        self.history = torch.zeros(max_rows, dtype=INT32, device=dev)
        self.capacity = torch.zeros(max_rows, dtype=INT32, device=dev)
        self.lease = torch.full((max_rows,), BAD, dtype=INT32, device=dev)
        self.groups = [self._new_group_state(g) for g in config.selection_groups]
        self._cells: dict[tuple[str, str], torch.Tensor] = {}
        self._fetch_args: dict[str, tuple] = {}
        for group in config.selection_groups:
            for layer in group.layers:
                self._fetch_args[layer] = self._new_cells(group, layer)
        self._flush_args = self._new_flush_args()
        # publish staging: two host buffers (pinned on CUDA) and one device scratch
        self._width = len(storage.groups) * pages + 3
        pin = dev.type == "cuda"
        self._staging = [
            (torch.empty((max_rows, self._width), dtype=INT32, pin_memory=pin),
             torch.empty((2, max_rows), dtype=torch.int64, pin_memory=pin))
            for _ in range(2)
        ]
        self._staging_events: list[Optional[torch.cuda.Event]] = [None, None]
        self._flip = 0
        self._scratch = (torch.empty((max_rows, self._width), dtype=INT32, device=dev),
                         torch.empty((2, max_rows), dtype=torch.int64, device=dev))
        self._rows: list[Optional["KVCache"]] = [None] * max_rows
        self._row_lease = [BAD] * max_rows
        self._free_leases = list(range(max_rows))
        self._dirty: set[int] = set()
        self._granted: set[int] = set()  # leases whose residency publish() must clear
        self._published = [(0, 0, BAD)] * max_rows  # host mirror: (history, capacity, lease)
        self._fetch_events: dict[int, torch.cuda.Event] = {}
        self._closed = False
        for tensor in self.state_tensors():
            # Fixed addresses: guarded static addresses are installed in the compiled graph as
            # attributes (guarded by identity, which never changes) instead of lifted inputs, so
            # cudagraph trees neither copy them nor count their mutation as an input mutation.
            torch._dynamo.mark_static_address(tensor, guard=True)

    def _new_group_state(self, group: SelectionGroup) -> GroupState:
        dev, rows, sp = self.config.device, self.max_rows, group.sparse
        return GroupState(
            spec=group,
            resident=torch.full((rows, sp.slots), BAD, dtype=INT32, device=dev),
            recency=torch.arange(sp.slots, dtype=INT32, device=dev).repeat(rows, 1),
            index_table=torch.full((rows, sp.width), BAD, dtype=INT32, device=dev),
            miss_list=torch.zeros((_miss_list_rows(group, rows), ops.MISS_FIELDS), dtype=INT32,
                                  device=dev),
            miss_count=torch.zeros(ops.MISS_COUNT_WORDS, dtype=INT32, device=dev),
            counters=torch.zeros(ops.NUM_COUNTERS, dtype=torch.int64, device=dev),
            inflight_slots=torch.full((rows, sp.max_inflight_units), BAD, dtype=INT32, device=dev),
            write_table=torch.full((rows, sp.max_inflight_tokens + sp.tokens_per_unit - 1), BAD,
                                   dtype=INT32, device=dev),
            inflight_start=torch.full((rows,), BAD, dtype=INT32, device=dev),
        )

    def _new_cells(self, group: SelectionGroup, layer: str) -> tuple:
        """Cells of each non-zero sparse buffer of ``layer``: ``num_leases*S/E`` cells laid out
        like pages of that buffer; plus what fetch reads for each: its pool group's memory, its
        position in a slot, and the group's page table."""
        storage, P = self.manager.storage, self.config.tokens_per_page
        cells, pools, positions, tables = [], [], [], []
        for buf in _sparse_buffers(self.config, layer):
            place = storage.place(layer, buf.role)
            shape = (self.max_rows * group.sparse.slots // group.units_per_page, buf.chunks, P,
                     buf.bytes_per_token // buf.chunks)
            cell = torch.zeros(shape, dtype=torch.uint8, device=self.config.device)
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
        tensors = [*self.page_tables, self.history, self.capacity, self.lease]
        for state in self.groups:
            tensors += [state.resident, state.recency, state.index_table, state.miss_list,
                        state.miss_count, state.counters, state.inflight_slots, state.write_table,
                        state.inflight_start]
        for cells, pools, _, _ in self._fetch_args.values():
            tensors += cells + pools
        tensors += [args[0] for args in self._flush_args]
        unique = {id(t): t for t in tensors}
        return list(unique.values())

    def _new_flush_args(self) -> list[tuple]:
        """Per sparse pool group with cells: the arguments of its one flush launch, covering
        every non-zero sparse buffer of every sparse layer in it (OP-FLUSH)."""
        storage = self.manager.storage
        per_pool: dict[int, list] = {}
        for group, state in zip(self.config.selection_groups, self.groups):
            sp = group.sparse
            for layer in group.layers:
                for buf in _sparse_buffers(self.config, layer):
                    place = storage.place(layer, buf.role)
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
    def add(self, cache: "KVCache", row: Optional[int] = None) -> int:
        """Seat ``cache`` at the lowest free row (or ``row``) and give it a lease; returns the row."""
        self._check_host_call("Batch.add")
        if cache.manager is not self.manager:
            raise ValueError("Batch.add: the cache belongs to another manager")
        if cache.closed:
            raise RuntimeError("Batch.add: the cache is closed")
        if cache._batch is self:
            raise ValueError(f"Batch.add: the cache is already seated at row {cache._row}")
        if cache._batch is not None:
            raise ValueError("Batch.add: the cache is a member of another batch")
        if row is None:
            row = next((r for r, c in enumerate(self._rows) if c is None), None)
            if row is None:
                raise RuntimeError(f"Batch.add: all {self.max_rows} rows are occupied")
        else:
            self._check_row(row, "Batch.add")
        cache._batch, cache._row = self, row
        self._rows[row] = cache
        self._dirty.add(row)
        if not cache.suspended:
            self._grant_lease(cache)
        return row

    def remove(self, cache: "KVCache") -> None:
        """Unseat a member, leaving a hole that publishes BAD / 0 and is reused later."""
        self._check_host_call("Batch.remove")
        row = self._member_row(cache, "Batch.remove")
        self._release_lease(cache)
        self._rows[row] = None
        cache._batch = cache._row = None
        self._dirty.add(row)

    def move(self, cache: "KVCache", row: int) -> None:
        """Move a member to an empty row, keeping its lease (hence its residency)."""
        self._check_host_call("Batch.move")
        old = self._member_row(cache, "Batch.move")
        self._check_row(row, "Batch.move")
        self._rows[old], self._rows[row] = None, cache
        self._row_lease[old], self._row_lease[row] = BAD, self._row_lease[old]
        cache._row = row
        self._dirty.update((old, row))

    def row_of(self, cache: "KVCache") -> Optional[int]:
        return cache._row if cache._batch is self else None

    def members(self) -> dict[int, "KVCache"]:
        """Seated caches by row."""
        return {r: c for r, c in enumerate(self._rows) if c is not None}

    def _check_row(self, row, what: str) -> None:
        if isinstance(row, bool) or not isinstance(row, int) or not 0 <= row < self.max_rows:
            raise ValueError(f"{what}: row must be an int in [0, {self.max_rows}), got {row!r}")
        if self._rows[row] is not None:
            raise ValueError(f"{what}: row {row} is occupied")

    def _member_row(self, cache: "KVCache", what: str) -> int:
        if cache._batch is not self:
            raise ValueError(f"{what}: the cache is not a member of this batch")
        return cache._row

    def _grant_lease(self, cache: "KVCache") -> None:
        lease = heapq.heappop(self._free_leases)  # never empty: one lease per row
        self._row_lease[cache._row] = lease
        self._granted.add(lease)
        self._dirty.add(cache._row)

    def _release_lease(self, cache: "KVCache") -> None:
        lease = self._row_lease[cache._row]
        if lease != BAD:
            heapq.heappush(self._free_leases, lease)
            self._granted.discard(lease)
            self._row_lease[cache._row] = BAD
        self._dirty.add(cache._row)

    # ---- publish (BAT-3) ----
    def publish(self) -> None:
        """Upload the rows changed since the last publish, from pinned staging, on the current
        stream, without host synchronisation; clear the residency of newly granted leases."""
        self._check_host_call("Batch.publish")
        if not self._dirty and not self._granted:
            return
        rows, leases = sorted(self._dirty), sorted(self._granted)
        published = list(self._published)
        for row in rows:
            cache, lease = self._rows[row], self._row_lease[row]
            seated = cache is not None and lease != BAD
            published[row] = (cache.history_length, cache.capacity, lease) if seated else (0, 0, BAD)
        width = self._flush_width(published)
        if width > self.config.max_total_input_tokens:
            raise ValueError(
                f"Batch.publish: {width} in-flight tokens over all rows exceed "
                f"max_total_input_tokens ({self.config.max_total_input_tokens}), the bound of "
                f"the flush work list; nothing was published")
        payload, indices = self._staging[self._flip]
        event = self._staging_events[self._flip]
        if event is not None:
            event.synchronize()  # the copy from this buffer two publishes ago; normally done
        G, pages = len(self.page_tables), self.config.max_pages_per_row
        flat = []
        for row in rows:
            cache = self._rows[row]
            lease = self._row_lease[row]
            if cache is None or lease == BAD:  # hole or suspended: BAD / 0
                flat.extend([BAD] * (G * pages) + [0, 0, BAD])
                continue
            for page_list in cache._pages:
                flat.extend(page_list)
                flat.extend([BAD] * (pages - len(page_list)))
            flat.extend([cache.history_length, cache.capacity, lease])
        n, m = len(rows), len(leases)
        payload[:n].copy_(torch.tensor(flat, dtype=INT32).view(n, self._width))
        indices[0, :n].copy_(torch.tensor(rows, dtype=torch.int64))
        indices[1, :m].copy_(torch.tensor(leases, dtype=torch.int64))
        dev_payload, dev_indices = self._scratch
        dev_payload[:n].copy_(payload[:n], non_blocking=True)
        dev_indices.copy_(indices, non_blocking=True)
        if self.config.device.type == "cuda":
            self._staging_events[self._flip] = torch.cuda.Event()
            self._staging_events[self._flip].record()
        self._flip ^= 1
        row_index = dev_indices[0, :n]
        for g, table in enumerate(self.page_tables):
            table.index_copy_(0, row_index, dev_payload[:n, g * pages:(g + 1) * pages])
        self.history.index_copy_(0, row_index, dev_payload[:n, G * pages])
        self.capacity.index_copy_(0, row_index, dev_payload[:n, G * pages + 1])
        self.lease.index_copy_(0, row_index, dev_payload[:n, G * pages + 2])
        if m:
            lease_index = dev_indices[1, :m]
            for state in self.groups:
                slots = state.resident.shape[1]
                state.resident.index_fill_(0, lease_index, BAD)
                order = torch.arange(slots, dtype=INT32, device=self.config.device)
                state.recency.index_copy_(0, lease_index, order.expand(m, slots))
        self._published = published
        self._dirty.clear()
        self._granted.clear()

    @property
    def published(self) -> bool:
        return not self._dirty and not self._granted

    # ---- per-step entry points (SPEC §8) ----
    def group(self, group: Union[int, str]) -> GroupState:
        """A selection group's state, by index, by its ``selection_id`` or by the name of one of
        its layers."""
        if isinstance(group, str):
            for spec in self.config.selection_groups:
                if spec.key == ("id", group):
                    return self.groups[spec.index]
            return self.groups[self.config.group_of(group).index]
        if isinstance(group, bool) or not isinstance(group, int) or not 0 <= group < len(self.groups):
            raise KeyError(f"unknown selection group {group!r} (there are {len(self.groups)})")
        return self.groups[group]

    def resolve(self, group: Union[int, str], selected: torch.Tensor,
                out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """OP-RESOLVE for one selection group: ``selected`` int32[max_rows, K] unit ordinals
        (negative = padding). Returns the index table int32[max_rows, K] of entries
        ``lease*S + slot`` (BAD for padding and invalid ordinals), the batch's own unless ``out``
        is given. Updates residency, the group's miss list and counters."""
        state = self.group(group)
        self._check_step("Batch.resolve")
        sp = state.spec.sparse
        self._check_index_tensor("selected", selected, sp.width)
        table = state.index_table
        if out is not None:
            self._check_index_tensor("out", out, sp.width)
            table = out
        if self._fetch_events:
            self._wait_fetches(state)
        ops.resolve(state.resident, state.recency, table, state.miss_list, state.miss_count,
                    state.counters, state.inflight_slots, selected, self.history, self.capacity,
                    self.lease, sp.tokens_per_unit, self.config.tokens_per_page,
                    sp.max_inflight_tokens, state.spec.window or 0)
        return table

    def fetch(self, *layers: str) -> None:
        """OP-FETCH: copy every unit missed by the group's last resolve into the cells of each
        given layer, all of one selection group, in one launch (up to 8 buffers per launch).
        Every layer of the group must be fetched after each resolve of the group: per layer just
        before its attention, or several at once, which keeps more copies in flight."""
        if not layers:
            raise TypeError("Batch.fetch: name at least one layer")
        args = [self._layer_args(layer) for layer in layers]
        self._check_step("Batch.fetch")
        group = self.config.group_of(layers[0])
        for layer in layers[1:]:
            if self.config.group_of(layer) is not group:
                raise ValueError(f"Batch.fetch: layers {layers[0]!r} and {layer!r} are in different "
                                 f"selection groups; one fetch serves one group's miss list")
        if len(set(layers)) != len(layers):
            raise ValueError(f"Batch.fetch: a layer is named twice in {list(layers)}")
        cells, pools, positions, tables = ([x for a in args for x in a[i]] for i in range(4))
        state = self.groups[group.index]
        if cells:
            ops.fetch(cells, pools, positions, tables, state.miss_list, state.miss_count,
                      state.spec.sparse.slots, state.spec.sparse.tokens_per_unit)

    def fetch_sparse_pages(self, layer: str, selected: torch.Tensor,
                           out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """OP-FETCH-FUSED: resolve + fetch for a layer alone in its selection group (a shared
        group raises ValueError: resolve once, then fetch per layer). Returns the index table."""
        self._layer_args(layer)
        group = self.config.group_of(layer)
        if len(group.layers) != 1:
            raise ValueError(
                f"Batch.fetch_sparse_pages: layer {layer!r} shares selection group "
                f"{group.name!r} with {len(group.layers) - 1} other layer(s); call resolve once "
                f"per step and fetch per layer")
        table = self.resolve(group.index, selected, out)
        self.fetch(layer)
        return table

    def write_indices(self, group: Union[int, str], out: Optional[torch.Tensor] = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """OP-WRITE: where each row writes its in-flight tokens' KV this step. Returns
        ``(indices int32[max_rows, I+U-1], start int32[max_rows])``: token ``start[r] + j`` of
        row r goes to cell token index ``indices[r, j]`` (cell ``// P``, row in cell ``% P``);
        BAD beyond the in-flight range and for holes and suspended rows. Tokens in
        ``[history, start)`` are written straight to host pages (``host_token_indices``).
        Needs this step's resolve of the group."""
        state = self.group(group)
        self._check_step("Batch.write_indices")
        sp = state.spec.sparse
        table = state.write_table
        if out is not None:
            self._check_index_tensor("out", out, table.shape[1])
            table = out
        ops.write_indices(table, state.inflight_start, state.resident, state.inflight_slots,
                          self.history, self.capacity, self.lease, sp.tokens_per_unit,
                          sp.max_inflight_tokens)
        return table, state.inflight_start

    def flush(self, new_history=None) -> None:
        """OP-FLUSH: write back every in-flight token below the row's new history from its cell
        to its host page, for every sparse buffer of every sparse layer, one launch per sparse
        pool group. ``new_history``: None (every in-flight token: the published capacity), a
        sequence of ints, or an int32[max_rows] tensor.

        Afterwards ``KVCache.resize`` may advance a row's history through what was flushed
        (SAFE-2). When the host cannot see the values (a CUDA tensor) it takes the published
        capacity as the bound: the caller must not advance history past what it passed. Inside
        ``torch.compile`` or stream capture the host bookkeeping is skipped: call
        ``record_flush()`` after the compiled call or the replay. The work-list bound
        (``max_total_input_tokens``) is enforced by ``publish``."""
        self._check_step("Batch.flush")
        known = None  # host-visible per-row targets
        if new_history is None:
            target = self.capacity
        else:
            if not isinstance(new_history, torch.Tensor):
                known = [int(v) for v in new_history]
                new_history = torch.tensor(known, dtype=INT32)
            elif new_history.device.type == "cpu" and not torch.compiler.is_compiling():
                known = new_history.tolist()
            target = new_history.to(self.config.device)
            self._check_index_tensor("new_history", target.view(-1, 1), 1)
        for pool, positions, cells, resident, slots, table, params in self._flush_args:
            ops.flush(pool, positions, cells, resident, slots, table, target, self.history,
                      self.capacity, self.lease, params)
        if torch.compiler.is_compiling():
            return
        if self.config.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return
        self.record_flush(known)

    def record_flush(self, new_history: Optional[list] = None) -> None:
        """Host bookkeeping of a flush (the SAFE-2 watermark): every seated row's tokens up to
        ``min(new_history[row], published capacity)`` are on its host pages (the capacity when
        ``new_history`` is None). ``flush`` calls it; call it yourself after replaying a
        captured graph that contains a flush."""
        for row, cache in enumerate(self._rows):
            h, c, lease = self._published[row]
            if cache is not None and lease != BAD:
                done = c if new_history is None else min(int(new_history[row]), c)
                cache._flushed = max(cache._flushed, done)

    def _flush_width(self, published: list) -> int:
        """The most in-flight tokens a flush can write back over all rows with these published
        (history, capacity, lease) rows: the flush work-list bound of OP-FLUSH."""
        widest = 0
        for group in self.config.selection_groups:
            sp = group.sparse
            total = 0
            for h, c, lease in published:
                if lease != BAD:
                    total += max(c - sp.inflight_start(h, c), 0)
            widest = max(widest, total)
        return widest

    def host_token_indices(self, layer: str, role: str, positions: torch.Tensor,
                           out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The prefill path: token indices of ``positions`` (int32[max_rows, N] token positions,
        negative = padding) in the buffer's view ``manager.storage.view(layer, role)`` (token
        ``i`` is ``view[i // P, :, i % P]``), BAD for padding and positions beyond capacity.
        Write tokens ``[history, inflight_start)`` of a row straight to host pages with it."""
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
        """The ordering contract of SPEC §8 across streams: call on the stream that ran a fetch
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
    def close(self) -> None:
        """Unseat every member and return the batch's memory to the manager's reserve."""
        self._check_host_call("Batch.close")
        for cache in list(self.members().values()):
            self.remove(cache)
        self._closed = True
        self.manager._uncharge(self._memory)

    # ---- checks ----
    def _check_host_call(self, what: str) -> None:
        self.manager._check_open(what)
        if self._closed:
            raise RuntimeError(f"{what}: the batch is closed")
        refuse_during_capture(self.config.device, what)

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

    def _check_index_tensor(self, name: str, t: torch.Tensor, width: int) -> None:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
        if t.dtype != INT32:
            raise TypeError(f"{name} must be int32, got {t.dtype}")
        dev = self.config.device
        if t.device.type != dev.type or (dev.index is not None and t.device.index != dev.index):
            raise ValueError(f"{name} must be on {self.config.device}, got {t.device}")
        if tuple(t.shape) != (self.max_rows, width):
            raise ValueError(f"{name} must have shape ({self.max_rows}, {width}), got {tuple(t.shape)}")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
