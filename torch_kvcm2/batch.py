"""Batch (REQUIREMENTS §6-8, BAT-1..4, RES, OP): the public API of the rows a decode step works on.

A batch is three parts, each with its own state (docs/DESIGN.md, "Objects"):

* the row table (``rows.RowTable``): which cache sits in which row with which lease, each row's
  row flags, and ``publish``, which uploads what changed as one delta (HOST-1, HOST-2);
* the read-back (``readback.Readback``): the read-back ring that brings the host up to
  date with lengths ``advance`` moved on the device, and the reserve top-ups it queues (HOST-3);
* the device step (``device_step.DeviceStep``): the selection groups' residency state, the
  cells, and the per-step ops over these fixed tensors.

``Batch`` checks the caller's arguments and hands each call to its part. Every table has a fixed
address for the batch's lifetime, so a captured graph keeps working across membership changes
(BAT-1). Host-side calls (membership, ``publish``) refuse to run during stream capture;
per-step calls refuse to run with unpublished changes (BAT-4).
"""
from __future__ import annotations

import weakref
from typing import Optional, Sequence, Union

import numpy as np
import torch

from . import ops
from .arguments import (check_index_tensor, check_not_meta, check_row, check_rows_tensor,
                        check_selection, fits, int_sequence)
from ._util import ceil_div, refuse_during_capture
from .cache import KVCache
from .device_step import DeviceStep, GroupState
from .readback import Readback, readback_ring
from .memory import batch_memory_bytes, batch_tensor_specs
from .rows import RowTable
from .tables import TableMirror

__all__ = ["Batch", "GroupState"]

INT32 = torch.int32


class Batch:
    """The rows a decode step works on, with their device tables and cell state.

    ``Batch(manager, max_rows=None)``; ``max_rows`` defaults to (and may not exceed) the
    config's. The batch's GPU and host memory (``memory.batch_tensor_specs``) come from the
    manager's batch reserve; ``close()`` returns it.

    Device tables (fixed addresses, BAT-1): ``page_tables[g]`` int32[max_rows,
    max_pages_per_row] per pool group, ``history``, ``capacity``, ``lease`` int32[max_rows], and
    ``written`` int32[max_rows] (the SAFE-2 watermark ``Batch.advance`` respects);
    ``groups[σ]`` the residency state of each selection group; ``advance_counters``.
    """

    def __init__(self, manager, max_rows: Optional[int] = None):
        config = manager.config
        max_rows = config.max_rows if max_rows is None else max_rows
        if isinstance(max_rows, bool) or not isinstance(max_rows, int) or not 0 < max_rows <= config.max_rows:
            raise ValueError(f"Batch: max_rows must be an int in [1, {config.max_rows}], got {max_rows!r}")
        refuse_during_capture(config.device, "Batch()")
        manager.check_open("Batch()")
        self.manager, self.config, self.max_rows = manager, config, max_rows
        # RSD-1: the GPU history pages, when no other open batch holds them
        reserve = manager.reserve
        reserve.collect()  # the closed batches' tensors first: their memory is this one's
        self.gpu_history_slots = config.gpu_history_slots if reserve.history_free else 0
        self._memory = batch_memory_bytes(config, len(manager.storage.groups), max_rows,
                                          self.gpu_history_slots)
        reserve.take(self._memory)
        if self.gpu_history_slots:
            reserve.history_free = False
        try:
            self._build(manager, config, max_rows)
        except BaseException:
            self._give_back()  # a failed construction holds nothing
            raise

    def _give_back(self) -> None:
        self.manager.reserve.give_back(self._memory)
        self.manager.reserve.returned.add(self)
        if self.gpu_history_slots:
            self.manager.reserve.history_free = True

    def _build(self, manager, config, max_rows: int) -> None:
        dev = config.device
        pin = dev.type == "cuda"
        allocated = {}
        for spec in batch_tensor_specs(config, len(manager.storage.groups), max_rows,
                                       self.gpu_history_slots):
            if spec.name in ("snapshot", "counter_snapshot"):
                allocated[spec.name] = readback_ring(spec, dev)
            elif spec.medium == "host":
                allocated[spec.name] = torch.zeros(spec.shape, dtype=spec.dtype, pin_memory=pin)
            else:
                allocated[spec.name] = torch.zeros(spec.shape, dtype=spec.dtype, device=dev)
        mirror = TableMirror(config, len(manager.storage.groups), max_rows, allocated,
                             manager.requests, self.gpu_history_slots)
        self._step = step = DeviceStep(self, allocated, mirror)
        self._table = table = RowTable(self, mirror, step)
        self._readback = table.readback = Readback(table, allocated["snapshot"], step.counter_parts,
                                              step.counter_stage, allocated["counter_snapshot"])
        self._readback.flush_token_bytes = step.flush_token_bytes
        manager.batches.add(self)
        # a batch collected unclosed still adds its newest arrived counters to the manager's
        self._retire = weakref.finalize(self, manager.counts.retire, self._readback.arrived)
        self.page_tables = step.page_tables
        self.history, self.capacity, self.lease = step.history, step.capacity, step.lease
        self.written, self.advance_counters = step.written, step.advance_counters
        self.groups = step.groups
        # what group() accepts, to the group's index: layer names, selection ids, indices
        self._group_index = {layer: spec.index for spec in config.selection_groups
                             for layer in spec.layers}
        for spec in config.selection_groups:
            self._group_index[spec.index] = spec.index
            if spec.key[0] == "id":
                self._group_index[spec.key[1]] = spec.index
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

    def state_tensors(self) -> list[torch.Tensor]:
        """Every tensor the per-step ops read or write (tables, residency, outputs, cells and the
        host pools' device views), each once; their addresses never change (BAT-1)."""
        return self._step.state_tensors()

    def _bound(self, tensor, shape) -> bool:
        """The one fast-path guard of the step calls: an eager call on a published, open batch
        whose tensor already has the bound shape, dtype and device, so the ops' own checks are
        the only ones needed. Anything else takes the checked path, whose refusal names the
        caller's argument; traced calls always do."""
        return (tensor.__class__ is torch.Tensor and not torch.compiler.is_compiling()
                and self._table.ready and fits(tensor, shape, self._step.device))

    # ---- membership (BAT-2) ----
    def add(self, cache: KVCache, row: Optional[int] = None) -> int:
        """Seat ``cache`` at the lowest free row (or ``row``) and give it a lease; returns the row."""
        return self._table.add(cache, row)

    def remove(self, cache: KVCache, discard: bool = False) -> None:
        """Unseat a member, leaving a hole that publishes BAD / 0 and is reused later.

        Refused (RuntimeError, nothing changed) while tokens are in flight (history <
        capacity): their KV lives in the lease's cells, which the next member gets. Flush and
        advance history first, or pass ``discard=True`` (the abort path): capacity shrinks back
        to history, dropping the in-flight tokens, so nothing stale is ever read."""
        self._table.remove(cache, discard)

    def move(self, cache: KVCache, row: int) -> None:
        """Move a member to an empty row, keeping its lease (hence its residency)."""
        self._table.move(cache, row)

    def row_of(self, cache: KVCache) -> Optional[int]:
        batch, row = cache.seated_in
        return row if batch is self else None

    def members(self) -> dict[int, KVCache]:
        """Seated caches by row."""
        return self._table.members()

    def lease_of(self, row: int) -> Optional[int]:
        """The lease of the member at ``row`` (None for a hole or a suspended member), as the
        next publish uploads it."""
        lease = self._table.leases[row]
        return None if lease < 0 else lease

    # ---- publish (BAT-3, HOST-1, HOST-2) ----
    def publish(self) -> None:
        """Upload what changed since the last publish (lengths of changed rows, page entries
        allocated or freed, holes and suspended rows as BAD / 0) as one delta, with one copy
        from a pinned staging buffer and one scatter, on the current stream, without waiting on
        the GPU; clear the residency of newly granted leases. Raises ValueError, publishing
        nothing, when the in-flight tokens over all rows exceed ``max_total_input_tokens``."""
        self._table.publish()

    @property
    def published(self) -> bool:
        return not self._table.unpublished

    def host_tables(self) -> dict:
        """The host mirror of the device tables as numpy arrays (what the device holds after
        the last publish, unless ``advance`` moved lengths since): ``page_tables`` [G, max_rows,
        max_pages_per_row] and ``lengths`` [6, max_rows] (history, capacity, lease, written,
        declared, allocated tokens). Read-only views."""
        self._check_usable("Batch.host_tables")
        return self._table.mirror.host_view()

    # ---- the lengths of many rows at once (HOST-3, HOST-4) ----
    def resize_rows(self, rows, capacity=None, history=None) -> list[int]:
        """``KVCache.resize`` for many rows in one call: ``rows`` a sequence of seated rows,
        ``capacity`` / ``history`` None or one int per row (a sequence, numpy array or CPU
        tensor). Each row is checked by resize's rules (over numpy arrays for rows published as
        they are) and changed all or nothing; rows whose lengths break a rule (ValueError),
        whose cache is suspended, or whose pages the pools cannot supply are left unchanged.
        Returns the rows that failed (empty when all succeeded). Bad arguments (not a member,
        wrong lengths of the sequences, capture in progress) raise before anything changes."""
        return self._table.resize_rows(rows, capacity, history)

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

        The host learns the new lengths without a per-step synchronisation: eagerly,
        ``advance`` queues a copy of the lengths to pinned memory, which ``poll()`` applies
        (a ``publish`` without host changes applies it too once it has arrived, never waiting).
        After replaying a captured graph or a compiled call that contains ``advance``, call
        ``record_advance()``. Windowed pages behind the window are released, and reserves taken
        again, at the first ``publish`` after the read-back is applied."""
        step = self._step
        if self._bound(accepted, step.rows_shape):
            step.advance(accepted)
        else:
            self._table.check_step("Batch.advance")
            check_rows_tensor("accepted", accepted, self.config.device, self.max_rows)
            step.advance(accepted)
            if torch.compiler.is_compiling():
                return
        self._readback.queue_readback(moved=True)  # not while capturing

    def finish_step(self, accepted: torch.Tensor, host_writes: bool = False) -> None:
        """The end of a step in the order the write contract needs (docs/ENGINE.md), one call
        instead of four: with ``host_writes`` first declare every seated row's host-direct
        tokens written (``record_host_writes()``, after a prefill chunk wrote them through
        ``host_token_indices``) and publish the declarations; then write back each row's
        accepted in-flight tokens (``flush`` to history + ``accepted``) and move its history
        over them on the device (``advance(accepted)``), queuing the read-back of the lengths.
        ``accepted`` int32[max_rows] on the batch's device, as for ``advance`` (0 for a row that
        keeps its tokens in flight). Without ``host_writes`` it is capturable and traceable:
        after a replay or a compiled call, call ``record_advance()``."""
        table, step = self._table, self._step
        if host_writes:
            table.record_host_writes(None)
            table.publish()  # declarations only: per-step calls still run
        compiling = torch.compiler.is_compiling()
        if not self._bound(accepted, step.rows_shape):
            table.check_step("Batch.finish_step")
            check_rows_tensor("accepted", accepted, self.config.device, self.max_rows)
        step.finish(accepted)
        if not compiling:
            self._readback.queue_readback(moved=True)  # and the watermark; not when capturing

    def record_advance(self) -> None:
        """Queue the read-back of the device lengths after ``advance`` (on the current stream;
        ``advance`` calls it eagerly; call it after replaying a graph that contains
        ``advance``). ``poll()`` applies it."""
        self._readback.record_advance()

    def poll(self) -> None:
        """The one device -> host call of a step: read back the device's lengths and counters
        (what ``advance``, ``finish_step`` and ``flush`` changed) and apply them, waiting for
        the copy. Call it once per step where the engine already waits for its sampled tokens,
        before the host changes rows (``resize``, ``remove``, ``suspend``, ``publish`` of
        changes ...), which refuse with a message naming it while the device holds lengths the
        host has not read. Getters (``KVCache.history_length``, ``capacity``, ``repr``),
        ``metrics()`` and ``stats()`` never wait and never change state: they show the lengths
        and counters as of the last poll (``metrics()`` also any newer read-back that has
        arrived). Without an ``advance`` since the last poll it queues a read-back of its own,
        so counters count from the first step whatever ends the step. Refused during stream
        capture."""
        self._table.check_host_call("Batch.poll")
        readback = self._readback
        if not readback.pending:  # (an owed read-back is queued by catch_up itself)
            readback.queue_readback()
        readback.catch_up(wait=True)

    @property
    def pending_readback(self) -> bool:
        """The device holds lengths the host has not read back (an ``advance``, ``finish_step``
        or flush to a tensor of targets since the last ``poll``): calls that change rows refuse
        until ``poll()``."""
        return self._readback.pending

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
                out: Optional[torch.Tensor] = None, fetch: bool = False) -> torch.Tensor:
        """OP-RESOLVE for one selection group: ``selected`` int32[max_rows, K] unit ordinals
        (negative = padding), or int32[max_rows, T', K] for a step of ``1 <= T' <= T`` query
        tokens per row (T = ``max_query_tokens``; MTP-2). Returns the index table of the same
        shape, entries ``lease*S + slot`` (BAD for padding and invalid ordinals): the batch's own
        unless ``out`` is given. Updates residency, the group's miss list and counters, and the
        group's write indices (``write_indices`` returns them).

        ``fetch``: also fetch the misses into the cells of every layer of the group (True), as
        ``fetch(*layers)`` right after would: resolve, write indices and fetch in one call
        (OP-STEP: one op instead of three, which is what an eager step spends its host time
        on). False (default) leaves the fetch to the caller: ``fetch`` per layer or several at
        once, or ``FetchStream`` to overlap it with attention.

        A multi-token step resolves the union of each row's T' selections once (MTP-3, docs/MTP.md):
        a unit selected by several query tokens is one hit or one miss, in one slot, and every
        token's entry for it is the same. The batch's own tables for every T' share one address
        (fixed, BAT-1); T' is part of the shape, so a captured graph serves one T'."""
        step = self._step
        index = self._group_index.get(group) if isinstance(group, (int, str)) else None
        if not isinstance(fetch, bool):
            raise TypeError(f"Batch.resolve: fetch must be True (every layer of the group) or "
                            f"False, got {fetch!r}")
        if index is not None and out is None and self._bound(selected,
                                                             step.selection_shapes[index]):
            return step.resolve_bound(index, selected, fetch)  # the bound arguments
        state = self.group(group)
        self._table.check_step("Batch.resolve")
        sp, device = state.spec.sparse, self.config.device
        tokens = check_selection("selected", selected, device, self.max_rows, sp)
        table = state.index_table if selected.dim() == 2 else state.index_views[tokens - 1]
        if out is not None:
            check_index_tensor("out", out, device, tuple(selected.shape))
            table = out
        plan = step.fetch_plan(state.spec.layers) if fetch else ()
        return step.resolve(state, selected, table, plan)

    def resolve_groups(self, selected: Sequence[Optional[torch.Tensor]], fetch: bool = True
                       ) -> list[Optional[torch.Tensor]]:
        """OP-STEP for several selection groups in one call: ``selected[g]`` is group ``g``'s
        selection (in ``config.selection_groups`` order; one entry per group), as ``resolve``
        takes it, or None to leave that group out. Returns each group's index table (the
        batch's own; None for a group left out). ``fetch``: also fetch every layer of each
        resolved group (False: the caller fetches, per layer or per group, as after ``resolve``).

        The results are those of ``resolve(g, selected[g], fetch=fetch)`` for each group, bit for
        bit. What it saves: on CUDA the groups' resolves run side by side (each its own launch,
        on the current stream and the library's side streams forked from it and joined back)
        and every group's fetch is one launch (part by part from 32 rows), so the groups' copies
        run side by side rather than one group's after another's resolve, which is most of a
        small batch's step (P-STEP-1); on the host one call instead of one per group. It suits
        an engine that knows every group's selection before the step's attention (an indexer
        computed up front, or a step replayed with the selections of the last one); a model
        whose indexer runs layer by layer resolves per group as it goes (P-STEP-1 says which is
        faster at which batch size)."""
        step = self._step
        if not isinstance(selected, (list, tuple)) or len(selected) != len(step.groups):
            raise TypeError(f"Batch.resolve_groups: selected must be a list with one entry (a "
                            f"selection or None) per selection group ({len(step.groups)}), got "
                            f"{type(selected).__name__}"
                            + (f" of {len(selected)}" if isinstance(selected, (list, tuple))
                               else ""))
        if not isinstance(fetch, bool):
            raise TypeError(f"Batch.resolve_groups: fetch must be True or False, got {fetch!r}")
        if all(self._bound(t, shape) for t, shape in zip(selected, step.selection_shapes)):
            step.resolve_groups_bound(list(selected), fetch)  # the bound arguments
            return [state.index_table for state in step.groups]
        self._table.check_step("Batch.resolve_groups")
        states, selections, tables = [], [], []
        out: list[Optional[torch.Tensor]] = [None] * len(step.groups)
        for state, sel in zip(step.groups, selected):
            if sel is None:
                continue
            sp = state.spec.sparse
            tokens = check_selection(f"selected[{state.spec.index}]", sel, self.config.device,
                                     self.max_rows, sp)
            table = state.index_table if sel.dim() == 2 else state.index_views[tokens - 1]
            states.append(state)
            selections.append(sel)
            tables.append(table)
            out[state.spec.index] = table
        if states:
            step.resolve_groups(states, selections, tables, fetch)
        return out

    def fetch(self, *layers: str) -> None:
        """OP-FETCH: copy every unit missed by the group's last resolve into the cells of each
        given layer, all of one selection group, in one launch (up to 8 buffers per launch).
        Every layer of the group must be fetched after each resolve of the group: per layer just
        before its attention, or several at once, which keeps more copies in flight."""
        plan = self._step.fetch_plan(layers)
        self._table.check_step("Batch.fetch")
        self._step.fetch(plan)

    def write_indices(self, group: Union[int, str], out: Optional[torch.Tensor] = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """OP-WRITE: where each row writes its in-flight tokens' KV this step. Returns
        ``(indices int32[max_rows, I+U-1], start int32[max_rows])``: token ``start[r] + j`` of
        row r goes to cell token index ``indices[r, j]`` (cell ``// P``, row in cell ``% P``);
        BAD beyond the in-flight range and for holes and suspended rows. Tokens in
        ``[history, start)`` are written straight to host pages (``host_token_indices``).

        The group's resolve computes them in the same call (from the lengths and residency it
        leaves). Without ``out`` they are resolve's, the batch's own tensors, with no launch,
        eager and compiled alike: resolve the group first, as the model's write needs (eagerly,
        a call after a publish or ``advance`` with no resolve of the group since raises
        RuntimeError; a traced call cannot tell). Into an ``out`` the ``write_indices`` op
        computes them now, from the lengths and residency the device holds."""
        step = self._step
        index = self._group_index.get(group) if isinstance(group, (int, str)) else None
        if (index is not None and out is None and not torch.compiler.is_compiling()
                and step.write_tables_current(index) and self._table.ready):
            state = self.groups[index]  # after this step's resolve: its tables
            return state.write_table, state.inflight_start
        state = self.group(group)
        self._table.check_step("Batch.write_indices")
        if out is None:
            if not (torch.compiler.is_compiling() or step.write_tables_current(state.spec.index)):
                raise RuntimeError(
                    f"Batch.write_indices: selection group {state.spec.index} has not been "
                    f"resolved since the last publish or advance, so its write indices are "
                    f"stale; resolve it first, or pass out= to compute them now")
            return state.write_table, state.inflight_start
        check_index_tensor("out", out, self.config.device,
                           (self.max_rows, state.write_table.shape[1]))
        step.write_indices(state, out)
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
        (``advance`` right after) or by ``poll()``, and applied by ``poll()``, so it never
        claims more than the flush wrote. The device
        watermark sees only published declarations: publish after ``record_host_writes`` and
        before a flush to a tensor. Inside ``torch.compile`` or stream capture the host
        bookkeeping is skipped: ``poll()`` after the compiled call or the replay reads the
        watermark the flush left on the device (``record_advance()`` queues that read-back
        without waiting). The work-list bound (``max_total_input_tokens``) is
        enforced by ``publish``."""
        step, compiling = self._step, torch.compiler.is_compiling()
        known = None  # host-visible per-row targets
        if self._bound(new_history, step.rows_shape):
            target = new_history  # the bound shape: no checks before the ops'
        else:
            self._table.check_step("Batch.flush")
            device = self.config.device
            if new_history is None:
                target = self.capacity
            elif isinstance(new_history, torch.Tensor):
                check_not_meta("new_history", new_history, device)
                target, where = new_history, new_history.device
                if where.type != device.type or (device.index is not None
                                                 and where.index != device.index):
                    target = new_history.to(device)  # e.g. targets computed on the host
            elif isinstance(new_history, (int, float, np.integer)):
                raise TypeError(
                    f"Batch.flush: new_history must be None (every in-flight token), a sequence of "
                    f"{self.max_rows} ints (one per row) or an int32[{self.max_rows}] tensor, got "
                    f"{type(new_history).__name__} {new_history!r}")
            else:
                known = int_sequence("new_history", new_history, self.max_rows, device)
                target = torch.tensor(known, dtype=INT32).to(device)
            check_rows_tensor("new_history", target, device, self.max_rows)
        step.flush(target)
        if compiling or (step.device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            return
        if isinstance(new_history, torch.Tensor):
            self._readback.owed = True  # a read-back queued before this flush lacks its watermark
        else:
            self._table.record_flush(known)

    def record_host_writes(self, ends=None) -> None:
        """Declare, for every seated row with a lease, that its host-direct tokens were written
        straight to host pages (``KVCache.record_host_write``): ``ends`` None (each row's whole
        host-direct range of the published lengths) or a sequence of ``max_rows`` ints (a row's
        end; 0 declares nothing). Call it after writing through ``host_token_indices`` and
        before the step's ``flush``. Raises ValueError, declaring nothing, when an end is past
        its row's host-direct range."""
        self._table.record_host_writes(ends)

    def host_token_indices(self, layer: str, role: str, positions: torch.Tensor,
                           out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Token indices of ``positions`` (int32[max_rows, N] token positions, negative =
        padding) in the buffer's view ``manager.buffer_view(layer, role)`` (token ``i`` is
        ``view[i // P, :, i % P]``), BAD for padding and positions beyond capacity, through the
        page table of the buffer's pool group, for any buffer with pages. For a sparse buffer it
        is the prefill path: write tokens ``[history, inflight_start)`` of a row straight to host
        pages with it, then declare them (``record_host_writes``) before the step's flush
        (docs/HOST_PATH.md). For a dense buffer (an indexer's keys) it is where every token of
        ``[0, capacity)`` lives in its GPU pool, to write the new ones and read the history."""
        storage = self.manager.storage
        place = storage.place(layer, role)
        self._table.check_step("Batch.host_token_indices")
        if place.group is None:
            raise KeyError(f"buffer {role!r} of layer {layer!r} is zero-size: it has no pages")
        if not isinstance(positions, torch.Tensor) or positions.dim() != 2:
            raise ValueError("positions must be a 2-D int32 tensor [max_rows, N]")
        device, shape = self.config.device, (self.max_rows, positions.shape[1])
        check_index_tensor("positions", positions, device, shape)
        if out is None:
            out = torch.empty_like(positions)
        else:
            check_index_tensor("out", out, device, shape)
        ops.convert_token_indices(out, positions, self.page_tables[place.group], self.capacity,
                                  storage.groups[place.group].scale, place.pos,
                                  self.config.tokens_per_page)
        return out

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
        self.manager.check_open("Batch.sync")
        if self._table.closed:
            raise RuntimeError("Batch.sync: the batch is closed")
        group = self.manager.host_group
        if group is not None:
            group.signal(self._step.shared_pools)
            group.wait(self._step.shared_pools)

    def page_table(self, layer: str, role: str) -> torch.Tensor:
        """The device page table of the buffer's pool group, int32[max_rows, max_pages_per_row]
        (``page_tables[manager.buffer(layer, role).pool_group]``): entry ``[r, p]`` is the slot
        of page ``p`` of the member at row ``r`` (BAD where it has none), as of the last
        publish. Fixed address. KeyError for an unknown or zero-size buffer."""
        self._check_usable("Batch.page_table")
        group = self.manager.buffer(layer, role).pool_group
        if group is None:
            raise KeyError(f"buffer {role!r} of layer {layer!r} is zero-size: it has no pages")
        return self.page_tables[group]

    def cells(self, layer: str, role: str) -> torch.Tensor:
        """The cells of a sparse buffer: uint8[max_rows*S/E, chunks, P, B/chunks]; the token with
        index ``i`` (from write_indices or entry*U + t mod U) is ``[i // P, :, i % P]``."""
        self._check_usable("Batch.cells")
        try:
            return self._step.cells[(layer, role)]
        except KeyError:
            raise KeyError(f"no cells for buffer {role!r} of layer {layer!r} (unknown, dense "
                           f"or zero-size)") from None

    # ---- counters and inspection (OP-COUNT, OP-INSPECT) ----
    def hit_miss(self, group: Union[int, str]) -> torch.Tensor:
        """The group's live device counters int64[hits, misses, invalid]; no synchronisation."""
        self._check_usable("Batch.hit_miss")
        return self.group(group).counters

    def _check_usable(self, what: str) -> None:
        """RuntimeError once the batch or its manager is closed: its tensors must not be used."""
        self.manager.check_open(what)
        if self._table.closed:
            raise RuntimeError(f"{what}: the batch is closed")

    def hit_rate(self, group: Union[int, str]) -> dict:
        """Counters as Python numbers (synchronises), with hit_rate = hits / (hits + misses)."""
        hits, misses, invalid = self.hit_miss(group).tolist()
        total = hits + misses
        return {"hits": hits, "misses": misses, "invalid": invalid,
                "hit_rate": hits / total if total else 0.0}

    def latest_counters(self) -> np.ndarray:
        """The device counters (per selection group hits, misses, invalid; then ``advance``'s
        refused and short rows) of the newest read-back that has arrived, int64, without
        waiting or applying it (what ``KVCacheManager.metrics`` sums)."""
        return self._readback.latest_counters()

    def row_counts(self) -> dict:
        """``{"seated": members, "suspended": members without a lease, "gpu_history": members
        whose sparse history is on GPU pages (RSD-1)}``, from the host."""
        table = self._table
        return {"seated": table.seated, "suspended": table.seated - table.leased,
                "gpu_history": table.gpu.rows()}

    def gpu_history_bytes(self) -> int:
        """GPU bytes the rows' GPU-resident history holds now (pages in use x
        ``config.gpu_history_page_bytes``), from the host."""
        return self._table.gpu.used_slots() * self.config.gpu_history_page_bytes

    def inspect(self, group: Union[int, str], row: int) -> dict:
        """A row's resident units, least to most recently used, and its pinned (in-flight)
        units, as Python data (synchronises). Uses the published lengths."""
        state = self.group(group)
        check_row(row, self.max_rows, "Batch.inspect")
        lease = int(self.lease[row])
        if lease < 0:
            return {"lease": None, "resident": [], "pinned": []}
        resident = state.resident[lease].tolist()
        order = [resident[s] for s in state.recency[lease].tolist() if resident[s] >= 0]
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
        ``discard=True`` (see ``remove``). Waits for the device (``poll``). Closing again, or
        after the manager's close, does nothing."""
        table = self._table
        if table.closed or self.manager.closed:  # again, or after the manager released it all
            table.closed = True
            return
        table.check_host_call("Batch.close")
        self.poll()  # closing waits for the device: the members' final lengths, its counters
        members = list(table.members().values())
        if not discard:
            for cache in members:
                if cache.history_length < cache.capacity:
                    raise RuntimeError(
                        f"Batch.close: {cache!r} has tokens in flight; flush and advance history "
                        f"first, or pass discard=True to drop them")
        for cache in members:
            table.remove(cache, discard=True)
        self._retire()  # the final counters (the poll above), kept by the manager
        self.manager.batches.discard(self)
        table.closed = True
        self._give_back()
