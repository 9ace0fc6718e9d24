"""The device step of a batch (REQUIREMENTS §7-8, OP-*): each selection group's residency state
and outputs, the cells, and the per-step ops over these fixed tensors.

Every call goes through the ops (``torch_kvcm2.ops``); the argument lists of the common calls
are assembled once, at construction (``_resolve_args``, ``_flush_args``), and an eager call only
puts the caller's tensor into its place. The ops' native checks check every call; the batch's
own checks (``arguments``) run first where the caller's tensor does not fit the bound shape, so a
refusal names the caller's argument.

State besides the tensors: per group the lengths epoch its last resolve saw (``writes_epoch``:
its write table is current while the table store's epoch has not moved since). Fetches on
another stream are ordered by ``FetchStream`` (``overlap.py``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch

from . import lengths as rules
from . import ops
from .config import BAD, SelectionGroup
from .memory import ALLOCATED, CAPACITY, DECLARED, HISTORY, LEASE, WRITTEN, sparse_buffers

INT32 = torch.int32
_ops = torch.ops.torch_kvcm2
# the overloads themselves: a call through the op packet first picks the overload
_RESOLVE_STEP, _FLUSH = _ops.resolve_step.default, _ops.flush.default
_RESOLVE_GROUPS = _ops.resolve_groups.default
_WATERMARK, _ADVANCE = _ops.flush_watermark.default, _ops.advance.default
_RESOLVE_GPU, _FLUSH_GPU = _ops.resolve_gpu_history.default, _ops.flush_gpu_history.default


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


class GroupLists(NamedTuple):
    """``resolve_groups``' per-group tensor lists before the selections, in the op's order
    (one entry per resolved group; ``cells`` every fetched buffer's, ``scratch`` the groups'
    resolve scratch, indexed by their group_params)."""

    resident: list
    recency: list
    index_table: list
    miss_list: list
    miss_count: list
    counters: list
    inflight_slots: list
    write_table: list
    inflight_start: list
    cells: list
    scratch: list


class DeviceStep:
    """Group states, cells and the step ops of one batch (module docstring)."""

    def __init__(self, batch, allocated: dict, mirror):
        self.manager, self.config = batch.manager, batch.config
        self.max_rows = batch.max_rows
        self.mirror = mirror  # tables.TableMirror: its epoch dates the write tables
        self.page_tables = mirror.page_tables
        self.lengths = L = mirror.lengths  # int32[6, max_rows], the table store's length rows
        self.history, self.capacity, self.lease = L[HISTORY], L[CAPACITY], L[LEASE]
        # RSD-1: rows whose history is on GPU pages (their flags and page tables in the table
        # store); resolve reads resolve_lease, the lease with those rows as holes (published
        # with them; the lease itself without GPU history pages)
        self.gpu_slots = batch.gpu_history_slots
        self.gpu_rows, self.gpu_pages = mirror.gpu_rows, mirror.gpu_pages
        self.resolve_lease = mirror.resolve_lease if self.gpu_slots else self.lease
        self.written, self.declared, self.allocated = L[WRITTEN], L[DECLARED], L[ALLOCATED]
        self.advance_counters = allocated["advance_counters"]
        self.step_targets = allocated["step_targets"]  # int32[max_rows]: history + accepted
        self.device = self.history.device  # with its index: what arguments.fits compares
        self.groups = [self._new_group_state(g, allocated) for g in self.config.selection_groups]
        # per selection group: the cells' pages of each of its buffers (GPU pages follow them)
        self.cell_pages = [self.max_rows * g.sparse.slots // g.units_per_page
                           for g in self.config.selection_groups]
        if self.gpu_slots:  # write_indices(out=)'s call for the GPU rows' write tables alone
            self.no_selection = torch.empty((self.max_rows, 0), dtype=INT32, device=self.device)
        # the read-back gathers these into counter_stage (memory.counter_words' order)
        self.counter_parts = [state.counters for state in self.groups] + [self.advance_counters]
        self.counter_stage = allocated["counter_stage"]
        self.cells: dict[tuple[str, str], torch.Tensor] = {}
        # per sparse layer: its cells, host pools, positions in a slot and page tables
        self.fetch_args: dict[str, tuple] = {}
        for group in self.config.selection_groups:
            for layer in group.layers:
                self.fetch_args[layer] = self._new_cells(group, layer, allocated)
        self.fetch_plans: dict[tuple, tuple] = {}  # fetch(*layers)'s checked arguments
        self.flush_args = self._new_flush_args()
        self.shape_pairs = [n for shape in rules.shapes_of(self.config) for n in shape]
        self.writes_epoch = [-1] * len(self.groups)
        self.selection_shapes = [tuple(s.index_table.shape) for s in self.groups]
        self.rows_shape = (self.max_rows,)
        # the bound argument lists: per group (without, with the fetch of all its layers), and
        # the flush's per pool group plus its watermark
        self.resolve_args = [(self._resolve_args(s, s.index_table, ()),
                              self._resolve_args(s, s.index_table, self.fetch_plan(s.spec.layers)))
                             for s in self.groups]
        # every group at once (resolve_groups), without and with the fetch of all its layers
        self.groups_args = [self._groups_args(self.groups, [s.index_table for s in self.groups],
                                              fetch) for fetch in (False, True)]
        self.watermark_args = ((self.written, self.declared),
                               (self.history, self.capacity, self.lease, self.shape_pairs))

    # ---- construction ----
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
            counters=allocated[f"counters{g}"],  # read back with the lengths
            inflight_slots=allocated[f"inflight_slots{g}"].fill_(BAD),
            write_table=allocated[f"write_table{g}"].fill_(BAD),
            inflight_start=allocated[f"inflight_start{g}"].fill_(BAD),
            resolve_scratch=allocated.get(f"resolve_scratch{g}"),
        )
        state.recency.copy_(torch.arange(sp.slots, dtype=INT32).expand(rows, sp.slots))
        return state

    def _new_cells(self, group: SelectionGroup, layer: str, allocated: dict) -> tuple:
        """Cells of each non-zero sparse buffer of ``layer`` (``num_leases*S/E`` cells laid out
        like pages of that buffer), with what fetch reads for each: its pool group's memory,
        its position in a slot, and the group's page table."""
        storage = self.manager.storage
        cells, pools, positions, tables = [], [], [], []
        for buf in sparse_buffers(self.config, layer):
            place = storage.place(layer, buf.role)
            cell = allocated[f"cells:{layer}:{buf.role}"]
            self.cells[(layer, buf.role)] = cell
            cells.append(cell)
            pool, pos = storage.pool(layer, buf.role)
            pools.append(pool)
            positions.append(pos)
            tables.append(self.page_tables[place.group])
        return cells, pools, positions, tables

    def _new_flush_args(self) -> list[tuple]:
        """Per sparse pool group with cells, the arguments of its one flush launch, covering
        every non-zero sparse buffer of every sparse layer in it (OP-FLUSH), as (before the
        targets, after them). With a host group (TP-3) only this rank's share: the buffers of
        the layers, or the pool groups, it owns (``HostGroup.split``); ``shared_pools`` are the
        host pools every rank orders on."""
        storage, host_group = self.manager.storage, self.manager.host_group
        layer_index = {layer.name: i for i, layer in enumerate(self.config.layers)}
        self.shared_pools = [g.device_data for g in storage.groups if g.sparse]
        per_pool: dict[int, list] = {}
        self.flush_token_bytes = 0  # bytes per token one flush writes back (for the metrics)
        for group, state in zip(self.config.selection_groups, self.groups):
            sp = group.sparse
            for layer in group.layers:
                for buf in sparse_buffers(self.config, layer):
                    place = storage.place(layer, buf.role)
                    if host_group is not None and not host_group.owns(layer_index[layer],
                                                                      place.group):
                        continue
                    self.flush_token_bytes += buf.bytes_per_token
                    per_pool.setdefault(place.group, []).append((
                        place.pos, self.cells[(layer, buf.role)], state.resident,
                        state.inflight_slots, (sp.slots, sp.tokens_per_unit, sp.max_inflight_tokens)))
        args = []
        self.gpu_flush_args = []
        for pool, entries in per_pool.items():
            positions, cells, resident, slots, params = zip(*entries)
            args.append(((storage.groups[pool].device_data, list(positions), list(cells),
                          list(resident), list(slots), self.page_tables[pool]),
                         (self.history, self.capacity, self.lease,
                          [p for ps in params for p in ps])))
            if self.gpu_slots:  # (cell pages, U, I) per buffer: the GPU pages follow the cells
                self.gpu_flush_args.append((
                    (storage.groups[pool].device_data, list(positions), list(cells),
                     self.gpu_rows, self.gpu_pages, self.page_tables[pool]),
                    (self.history, self.capacity, self.lease,
                     [x for cell, (_, U, I) in zip(cells, params)
                      for x in (cell.shape[0] - self.gpu_slots, U, I)])))
        return args

    def state_tensors(self) -> list[torch.Tensor]:
        """Every tensor the per-step ops read or write (tables, residency, outputs, cells and the
        host pools' device views), each once; their addresses never change (BAT-1)."""
        tensors = [*self.page_tables, self.history, self.capacity, self.lease, self.written,
                   self.declared, self.allocated, self.advance_counters, self.step_targets]
        if self.gpu_slots:
            tensors += [self.gpu_rows, self.gpu_pages, self.resolve_lease]
        for state in self.groups:
            tensors += [state.resident, state.recency, state.index_table, state.miss_list,
                        state.miss_count, state.counters, state.inflight_slots, state.write_table,
                        state.inflight_start]
            if state.resolve_scratch is not None:
                tensors.append(state.resolve_scratch)
        for cells, pools, _, _ in self.fetch_args.values():
            tensors += cells + pools
        tensors += [before[0] for before, _ in self.flush_args]
        unique = {id(t): t for t in tensors}
        return list(unique.values())

    # ---- fetch plans ----
    def fetch_plan(self, layers: tuple) -> tuple:
        """The checked arguments of a fetch of ``layers`` (all of one selection group): (group
        state, cells, host pools, positions, tables); kept per tuple of layers outside
        torch.compile (traced once there: a cache would only add guards)."""
        if not torch.compiler.is_compiling():
            plan = self.fetch_plans.get(layers)
            if plan is not None:
                return plan
        if not layers:
            raise TypeError("Batch.fetch: name at least one layer")
        args = [self._layer_args(layer) for layer in layers]
        group = self.config.group_of(layers[0])
        for layer in layers[1:]:
            if self.config.group_of(layer) is not group:
                raise ValueError(f"Batch.fetch: layers {layers[0]!r} and {layer!r} are in "
                                 f"different selection groups; one fetch serves one group's miss "
                                 f"list")
        if len(set(layers)) != len(layers):
            raise ValueError(f"Batch.fetch: a layer is named twice in {list(layers)}")
        cells, pools, positions, tables = ([x for a in args for x in a[i]] for i in range(4))
        plan = (self.groups[group.index], cells, pools, positions, tables)
        if not torch.compiler.is_compiling():
            self.fetch_plans[layers] = plan
        return plan

    def _layer_args(self, layer: str) -> tuple:
        try:
            return self.fetch_args[layer]
        except KeyError:
            self.config.layer(layer)  # KeyError for an unknown layer
            raise KeyError(f"layer {layer!r} has no sparse buffers") from None

    # ---- the step ops ----
    def _resolve_args(self, state: GroupState, table: torch.Tensor, plan: tuple) -> tuple:
        """``resolve_step``'s arguments around the selection: (before it, after it); ``plan``
        a fetch plan, or () for no fetch."""
        sp = state.spec.sparse
        cells, pools, positions, tables = plan[1:] if plan else ([], [], [], [])
        return ((state.resident, state.recency, table, state.miss_list, state.miss_count,
                 state.counters, state.inflight_slots, state.write_table, state.inflight_start,
                 list(cells)),
                (self.history, self.capacity, self.resolve_lease, list(pools), list(positions),
                 list(tables), sp.tokens_per_unit, self.config.tokens_per_page,
                 sp.max_inflight_tokens, state.spec.window or 0, state.resolve_scratch,
                 state.spec.sinks))

    def _groups_args(self, states: list, tables: list, fetch: bool) -> tuple:
        """``resolve_groups``' arguments around the selections for ``states`` (group states in
        group order) writing ``tables``: (before them, after them); ``fetch`` every layer of
        each group. Each host pool and page table is passed once (``buffer_params`` index them)."""
        before = GroupLists(*([] for _ in GroupLists._fields))
        pools, page_tables, params, buffer_params = [], [], [], []

        def index_of(items: list, t: torch.Tensor) -> int:
            for i, x in enumerate(items):
                if x is t:
                    return i
            items.append(t)
            return len(items) - 1

        for state, table in zip(states, tables):
            sp = state.spec.sparse
            cells = []
            if fetch:
                _, cells, group_pools, group_positions, group_tables = \
                    self.fetch_plan(state.spec.layers)
                for pool, pos, page_table in zip(group_pools, group_positions, group_tables):
                    buffer_params += [index_of(pools, pool), pos, index_of(page_tables, page_table)]
            for name, t in (("resident", state.resident), ("recency", state.recency),
                            ("index_table", table), ("miss_list", state.miss_list),
                            ("miss_count", state.miss_count), ("counters", state.counters),
                            ("inflight_slots", state.inflight_slots),
                            ("write_table", state.write_table),
                            ("inflight_start", state.inflight_start)):
                getattr(before, name).append(t)
            before.cells.extend(cells)
            scratch = -1
            if state.resolve_scratch is not None:
                scratch = len(before.scratch)
                before.scratch.append(state.resolve_scratch)
            params += [sp.tokens_per_unit, sp.max_inflight_tokens, state.spec.window or 0,
                       state.spec.sinks, scratch, len(cells)]
        return (before, (self.history, self.capacity, self.resolve_lease, pools, page_tables,
                                self.config.tokens_per_page, params, buffer_params))

    # ---- GPU-resident history (RSD-1) ----
    def resolve_gpu_rows(self, state: GroupState, selected: torch.Tensor, table: torch.Tensor,
                         write_table: torch.Tensor) -> None:
        """After a resolve of ``state``'s group: its rows on GPU pages."""
        sp, spec = state.spec.sparse, state.spec
        _RESOLVE_GPU(table, write_table, state.inflight_start, state.counters, selected,
                     self.gpu_rows, self.gpu_pages, self.history, self.capacity, self.lease,
                     self.max_rows * sp.slots, self.gpu_slots, sp.tokens_per_unit,
                     self.config.tokens_per_page, sp.max_inflight_tokens, spec.window or 0,
                     spec.sinks)

    def resolve_groups_bound(self, selected: list, fetch: bool) -> None:
        """The eager resolve of every group at once, each selection of the bound shape."""
        before, after = self.groups_args[fetch]
        _RESOLVE_GROUPS(*before, selected, *after)
        if self.gpu_slots:
            for state, sel in zip(self.groups, selected):
                self.resolve_gpu_rows(state, sel, state.index_table, state.write_table)
        epoch = self.mirror.epoch
        for index in range(len(self.groups)):
            self.writes_epoch[index] = epoch

    def resolve_groups(self, states: list, selected: list, tables: list, fetch: bool) -> None:
        """Any resolve of several groups at once: ``states`` in group order, each with its
        selection and output table."""
        before, after = self._groups_args(states, tables, fetch)
        ops.resolve_groups(*before, selected, *after)
        if self.gpu_slots:
            for state, sel, table in zip(states, selected, tables):
                self.resolve_gpu_rows(state, sel, table, state.write_table)
        if not torch.compiler.is_compiling():  # traced: no host state (write_indices knows)
            for state in states:
                self.writes_epoch[state.spec.index] = self.mirror.epoch

    def resolve_bound(self, index: int, selected: torch.Tensor, fetch: bool) -> torch.Tensor:
        """The eager resolve of a selection of the bound shape (``arguments.fits``)."""
        before, after = self.resolve_args[index][fetch]
        _RESOLVE_STEP(*before, selected, *after)
        if self.gpu_slots:
            state = self.groups[index]
            self.resolve_gpu_rows(state, selected, state.index_table, state.write_table)
        self.writes_epoch[index] = self.mirror.epoch
        return self.groups[index].index_table

    def resolve(self, state: GroupState, selected: torch.Tensor, table: torch.Tensor,
                plan: tuple) -> torch.Tensor:
        """Any resolve: ``table`` the output (the batch's own or the caller's), ``plan`` a fetch
        plan of the group's layers or ()."""
        before, after = self._resolve_args(state, table, plan)
        ops.resolve_step(*before, selected, *after)
        if self.gpu_slots:
            self.resolve_gpu_rows(state, selected, table, state.write_table)
        if not torch.compiler.is_compiling():  # traced: no host state (write_indices knows)
            self.writes_epoch[state.spec.index] = self.mirror.epoch
        return table

    def fetch(self, plan: tuple) -> None:
        state, cells, pools, positions, tables = plan
        if cells:
            ops.fetch(cells, pools, positions, tables, state.miss_list, state.miss_count,
                      state.spec.sparse.slots, state.spec.sparse.tokens_per_unit)

    def write_tables_current(self, index: int) -> bool:
        return self.writes_epoch[index] == self.mirror.epoch

    def write_indices(self, state: GroupState, out: torch.Tensor) -> None:
        sp = state.spec.sparse
        ops.write_indices(out, state.inflight_start, state.resident, state.inflight_slots,
                          self.history, self.capacity, self.resolve_lease, sp.tokens_per_unit,
                          sp.max_inflight_tokens)
        if self.gpu_slots:  # the GPU rows' write tables alone: no selection, no count
            self.resolve_gpu_rows(state, self.no_selection, self.no_selection, out)

    def flush(self, target: torch.Tensor) -> None:
        """Every pool group's flush to ``target`` (int32[max_rows] on the device), then the
        device watermark by the same rule."""
        for before, after in self.flush_args:  # every argument list is bound: lists already
            _FLUSH(*before, target, *after)
        for before, after in self.gpu_flush_args:
            _FLUSH_GPU(*before, target, *after)
        before, after = self.watermark_args
        _WATERMARK(*before, target, *after)

    def advance(self, accepted: torch.Tensor) -> None:
        _ADVANCE(self.lengths, self.advance_counters, accepted)

    def finish(self, accepted: torch.Tensor) -> None:
        """The accepted tokens to host pages, then history over them: flush to history +
        accepted (into the fixed ``step_targets``), then advance by ``accepted``."""
        torch.add(self.history, accepted, out=self.step_targets)
        self.flush(self.step_targets)
        self.advance(accepted)

    def clear_leases(self, leases: torch.Tensor) -> None:
        """Empty residency for the device int64 ``leases`` (leases that changed owner), in every
        selection group at once."""
        ops.clear_leases([s.resident for s in self.groups], [s.recency for s in self.groups],
                         leases)
