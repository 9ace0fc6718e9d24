"""GPU-resident history (RSD-1, RSD-2): which rows of a batch keep their sparse history in GPU
pages as well, and the host side of moving them there and back.

The batch that holds ``CacheConfig.gpu_history_bytes`` (one open batch at a time) has
``gpu_history_slots`` GPU pages after the cells of every sparse buffer (one index space per
buffer, ``Batch.cells``). A row is on GPU pages or on cells, as a whole (docs/DESIGN.md, "GPU-resident history"): its page ordinals
``[0, ceil(allocated / P))`` each hold one GPU page slot, the same slot in every sparse buffer.
Its tokens are written to its GPU pages (``resolve_gpu_history`` gives the write table) and,
through ``flush_gpu_history``, to its host pages, which therefore always hold every token of
its history: the GPU copy is an accelerator that is dropped without copying a byte.

Decided at each publish, for the rows it publishes (``plan``):

* a seated row on cells is promoted when it has no host-direct range (``s0 == h`` for every
  selection group) and free slots cover its pages: its history ``[0, h)`` is copied host ->
  GPU pages once (whole pages, on the current stream, before the step that reads them);
* a GPU row grows and shrinks its pages with its allocated tokens; it is demoted when the free
  slots cannot cover its growth or a host-direct range appears (a long prefill chunk): its
  pages are freed (no byte to host), its lease is cleared (stale cell copies of units
  written since on GPU pages) and seeded from the freed pages device to device (``seed``), and
  it continues on cells, exact because the host pages hold all its history;
* a row that leaves (a hole, a suspended row) frees its pages.

Rows are promoted in row order while slots last (first come, first served); no row is demoted
to make room for another. A publish that only tops up pages (a read-back in flight) promotes
nothing.
"""
from __future__ import annotations

import numpy as np
import torch

from . import lengths as rules
from . import ops
from .config import BAD
from .memory import ALLOCATED, CAPACITY, HISTORY, LEASE, sparse_buffers


def _to_device(array: np.ndarray, device) -> torch.Tensor:
    """``array`` on ``device`` without the host waiting for the device: a copy from pageable
    memory synchronises with the stream, so behind a queue of decode steps the host waited for
    all of them (P-DEMOTE's demoting publish took 16.9 ms of host time on an H100, 2026-12-07).
    On CUDA the array goes through pinned memory from torch's caching host allocator, which keeps
    the block until the copy has read it."""
    host = torch.from_numpy(np.ascontiguousarray(array))
    if torch.device(device).type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


class GpuHistory:
    """The host bookkeeping of one batch's GPU history pages."""

    def __init__(self, batch, mirror, step):
        config = batch.config
        self.config, self.mirror, self.step = config, mirror, step  # step: the DeviceStep
        self.manager = batch.manager
        self.slots = batch.gpu_history_slots
        self.P, self.R, self.MP = config.tokens_per_page, batch.max_rows, config.max_pages_per_row
        self.free = list(range(self.slots - 1, -1, -1))  # a stack: the lowest slot first
        self.pages = np.full((self.R, self.MP), BAD, dtype=np.int32)  # per row, as planned
        self.held = np.zeros(self.R, dtype=np.int64)  # page ordinals [0, held) hold a slot
        self.on_gpu = np.zeros(self.R, dtype=bool)
        self.shapes = rules.shapes_of(config)  # each distinct one once: plan's s0
        self.seed_shapes = None  # built by _seed_shapes (by warm, when enabled)
        self.flag_base = mirror.flag_offset
        self.lease_base = mirror.resolve_lease_offset
        if self.enabled:
            self.warm()

    def warm(self) -> None:
        """Runs the seed's launches once with nothing to copy, when the batch is built: the
        first launch of a kernel in a process loads it (CUDA loads modules lazily), and the seed
        launches kernels a decode step does not (the per-shape fetch, ``_foreach_copy_``) and
        takes a pinned block of its size, so without this the first demotion paid for all three
        on the host (P-DEMOTE: 17 ms, docs/DESIGN.md). No state changes: the fetch's miss count
        is 0 and the copy is between scratch tensors."""
        device = self.config.device
        widest = max((key[2] for key in self._seed_shapes()), default=0)  # the most slots S
        _to_device(np.zeros(4 + 6 * widest + self.MP, dtype=np.int32), device)  # the largest list
        count = torch.zeros(4, dtype=torch.int32, device=device)
        misses = torch.zeros(1, 4, dtype=torch.int32, device=device)
        table = torch.full((1, 1), BAD, dtype=torch.int32, device=device)
        for (U, _, S, *_), (rows, cells, pools) in self._seed_shapes().items():
            if cells:
                ops.fetch(cells, pools, [0] * len(cells), [table] * len(cells), misses, count, S, U)
            scratch = [torch.zeros(2, dtype=torch.int32, device=device) for _ in rows]
            torch._foreach_copy_(scratch, [count[:2]] * len(rows))

    @property
    def enabled(self) -> bool:
        return self.slots > 0

    def rows(self) -> int:
        return int(self.on_gpu.sum())

    def used_slots(self) -> int:
        return self.slots - len(self.free)

    def plan(self, rows: list, values: np.ndarray, fresh: list, moving: np.ndarray,
             pages_only: bool) -> tuple:
        """Residency for the published ``rows`` (their length rows ``values``, int32[n, 6];
        ``fresh[i]``: the row has another owner than at its last publish; ``moving[i]``: its
        lengths, pages or owner changed, so it may move on or off GPU pages): returns (delta
        index, delta value, demotions, promotions) where demotions are ``(row, history,
        capacity, its GPU page slots)`` (the slots are free now; ``seed`` reads them before any
        other write) and promotions ``(row, slot ids of pages [0, ceil(h/P)))`` whose history
        must be copied before the step; the delta sets the rows' GPU page entries, flags and
        the lease resolve reads (BAD for a row on GPU pages) in the table store."""
        index, value, demoted, promoted = [], [], [], []
        h, c, lease, allocated = (values[:, k].astype(np.int64)
                                  for k in (HISTORY, CAPACITY, LEASE, ALLOCATED))
        s0 = h.copy()
        for shape in self.shapes:
            s0 = np.maximum(s0, rules.inflight_start(h, c, shape, np.maximum))
        direct = s0 > h
        need = -(-allocated // self.P)
        at = np.asarray(rows, dtype=np.int64)
        on = self.on_gpu[at]
        # the rows with something to do; a steady decode step has none (a row on GPU pages
        # whose pages fit, the others too many for the free slots)
        busy = on & (np.asarray(fresh) | (lease < 0) | (direct & (not pages_only))
                     | (need != self.held[at]))
        if not pages_only:
            busy |= ~on & moving & (lease >= 0) & ~direct & (need <= len(self.free))
        for i in np.flatnonzero(busy).tolist():
            row = rows[i]
            if self.on_gpu[row] and (fresh[i] or lease[i] < 0):
                self._release(row, index, value)  # its request left: the pages are its
            if lease[i] < 0:  # a hole or a suspended row
                continue
            if self.on_gpu[row]:
                # (a pages-only publish holds host lengths older than the device's: it only
                # grows the pages)
                if (direct[i] and not pages_only) or not self._resize(row, int(need[i]), index,
                                                                       value):
                    pages = self.pages[row, :int(self.held[row])].copy()
                    self._release(row, index, value)
                    # lengths older than the device's (pages only) seed nothing: a cold lease
                    demoted.append((row, int(h[i]), int(c[i]), pages[:0] if pages_only else pages))
                    self.manager.counts.demotions += 1
            elif (not pages_only and moving[i] and not direct[i]
                  and need[i] <= len(self.free)):
                self.on_gpu[row] = True
                index.append(np.array([self.flag_base + row]))
                value.append(np.array([1], dtype=np.int32))
                self._resize(row, int(need[i]), index, value)
                promoted.append((row, self.pages[row, :-(-int(h[i]) // self.P)].copy()))
                self.manager.counts.promotions += 1
        # every published row's lease, as resolve reads it
        leases = (self.lease_base + at, np.where(self.on_gpu[at], BAD, lease).astype(np.int32))
        if not index:  # a steady step: the leases alone, one entry per row already
            return leases[0], leases[1], demoted, promoted
        index, value = np.concatenate(index + [leases[0]]), np.concatenate(value + [leases[1]])
        # one entry per store index, the last planned (a row released and promoted again in
        # one publish plans its flag and pages twice): a scatter of duplicates is undefined on
        # CUDA, and a delta holds at most one entry per table slot
        last = len(index) - 1 - np.unique(index[::-1], return_index=True)[1]
        return index[last], value[last], demoted, promoted

    def _resize(self, row: int, need: int, index: list, value: list) -> bool:
        """Row ``row`` holds slots for page ordinals [0, need); False (nothing changed) when
        the free slots cannot cover the growth."""
        held = int(self.held[row])
        if need > held:
            if need - held > len(self.free):
                return False
            n = need - held  # the top of the stack, as that many pops would take it
            self.pages[row, held:need] = self.free[:-n - 1:-1]
            del self.free[-n:]
        elif need < held:
            self.free.extend(self.pages[row, need:held].tolist())
            self.pages[row, need:held] = BAD
        else:
            return True
        lo, hi = min(need, held), max(need, held)
        base = self.mirror.gpu_offset + row * self.MP
        index.append(np.arange(base + lo, base + hi, dtype=np.int64))
        value.append(self.pages[row, lo:hi].copy())
        self.held[row] = need
        return True

    def _release(self, row: int, index: list, value: list) -> None:
        """Row ``row`` leaves GPU pages: its slots are free and its entries and flag BAD / 0."""
        self._resize(row, 0, index, value)
        self.on_gpu[row] = False
        index.append(np.array([self.flag_base + row]))
        value.append(np.array([0], dtype=np.int32))

    def seed(self, table, demoted: list) -> None:
        """Demotions (RSD-2): each row's cleared lease is seeded from its GPU pages, device to
        device, in every selection group (``seed_plan``): the units copied into every sparse
        buffer's cells, their slots' residency and the lease's recency set. Runs after the
        publish that cleared the leases and before anything writes the freed pages.

        Groups of one shape seed the same units into the same slots, so each shape is one
        OP-FETCH over all its layers' buffers, its miss list the seeds (lease, slot k, row 0,
        unit) and its "host" pool each buffer's own cells viewed as pages, the page table the
        row's GPU page slots after the cells: one launch where a copy per layer cost 3.5 ms of
        host time at 61 layers (docs/DESIGN.md, P-DEMOTE)."""
        device = self.config.device
        for row, h, c, pages in demoted:
            if not len(pages):
                continue
            lease = int(table.leases[row])
            dst, src = [], []
            for (U, I, S, window, sinks, cell_pages, E), (rows, cells, pools) in \
                    self._seed_shapes().items():
                units, recency = seed_plan(h, c, U, self.P, I, S, window, sinks, len(pages) * E)
                n, at = len(units), 4 + 4 * len(units) + len(pages)
                # one int32 array, one copy to the device: the miss count, the misses (lease,
                # slot k, row 0, unit), the page table, the lease's residency and recency rows
                packed = np.empty(at + 2 * S, dtype=np.int32)
                packed[:4] = (n, 0, 0, 0)
                misses = packed[4:4 + 4 * n].reshape(n, 4)
                misses[:, 0], misses[:, 1], misses[:, 2], misses[:, 3] = lease, np.arange(n), 0, units
                packed[4 + 4 * n:at] = cell_pages + pages
                packed[at:at + n], packed[at + n:at + S] = units, BAD
                packed[at + S:] = recency
                packed = _to_device(packed, device)
                for recency_rows, resident_rows in rows:  # whole rows: views made at warm
                    dst += [recency_rows[lease], resident_rows[lease]]
                src += [packed[at + S:], packed[at:at + S]] * len(rows)
                if n and cells:
                    ops.fetch(cells, pools, [0] * len(cells),
                              [packed[4 + 4 * n:at].view(1, -1)] * len(cells),
                              packed[4:4 + 4 * n].view(n, 4), packed[:4], S, U)
            torch._foreach_copy_(dst, src)

    def _seed_shapes(self) -> dict:
        """Per seed shape (U, I, S, window, sinks, cell pages, E), shared by the groups that
        seed the same units into the same slots: per group its recency and residency as lists
        of row views (a demotion picks its lease's: making views costs µs a call on the host,
        two per group), their layers' sparse cells and those cells viewed as pages (what
        ``seed``'s fetch reads); built by ``warm``."""
        if self.seed_shapes is None:
            step, shapes = self.step, {}
            for group, state in zip(self.config.selection_groups, step.groups):
                sp = group.sparse
                key = (sp.tokens_per_unit, sp.max_inflight_tokens, sp.slots, group.window or 0,
                       group.sinks, step.cell_pages[group.index], group.units_per_page)
                rows, cells, pools = shapes.setdefault(key, ([], [], []))
                rows.append((state.recency.unbind(0), state.resident.unbind(0)))
                for layer in group.layers:
                    cells += step.fetch_args[layer][0]
                    pools += [cell.view(cell.shape[0], 1, -1) for cell in step.fetch_args[layer][0]]
            self.seed_shapes = shapes
        return self.seed_shapes

    def copy_in(self, table, promoted: list) -> None:
        """Promotions: each row's history pages, host -> its GPU pages in every sparse buffer,
        whole pages, on the current stream (RSD-1). Pages past the history hold what the host
        page holds; the step writes its in-flight tokens over them."""
        if not promoted:
            return
        manager, config = self.manager, self.config
        step = self.step
        for row, gpu in promoted:
            if not len(gpu):
                continue
            cache = table.caches[row]
            gpu_index = _to_device(gpu.astype(np.int64), config.device)
            for group in config.selection_groups:
                cell_pages = step.cell_pages[group.index]
                for layer in group.layers:
                    for buf in sparse_buffers(config, layer):
                        host = cache.host_pages(layer, buf.role)[:len(gpu)]
                        kept = host >= 0  # a windowed group's released pages hold nothing
                        host = _to_device(host[kept], config.device)
                        target = gpu_index[_to_device(kept, config.device)]
                        space = step.cells[(layer, buf.role)]
                        view = manager.buffer_view(layer, buf.role)
                        space.index_copy_(0, target + cell_pages, view.index_select(0, host))
                        manager.counts.promoted_bytes += len(host) * self.P * buf.bytes_per_token


def seed_plan(h: int, c: int, U: int, P: int, I: int, S: int, window: int, sinks: int,
              units_on_gpu: int) -> tuple[np.ndarray, np.ndarray]:
    """The seeds of a row demoted onto a cleared lease of S slots, as the reference model's
    ``demote`` makes them (tests/reference_resident.py): its in-flight units ascending, then its whole
    history units on live pages (a window releases pages), newest first, at most S, all below
    ``units_on_gpu``; seed k takes slot k (a cleared lease's empty slots in recency order).
    Returns (the units of slots 0..n-1, the lease's recency afterwards: the slots not seeded in
    their order, then the seeded slots by ascending unit, so the newest is the most recent),
    int64 arrays."""
    h = max(h, 0)
    c = max(c, h)
    E = P // U
    s0 = rules.inflight_start(h, c, (U, I), max)
    inflight = np.arange(s0 // U, -(-c // U)) if s0 < c else np.arange(0)
    newest = np.arange(h // U - 1, max(h // U - 1 - S, -1), -1)  # the S newest at most
    if window:  # units on the released pages between the sink pages and the window
        sink_units = rules.sink_pages(sinks, P) * E
        first_live = rules.first_live_page(h, P, window) * E
        newest = np.arange(h // U - 1, -1, -1)
        newest = newest[(newest < sink_units) | (newest >= first_live)]
    units = np.concatenate([inflight, newest[:max(S - len(inflight), 0)]])
    units = units[units < units_on_gpu][:S]
    n = len(units)
    recency = np.concatenate([np.arange(n, S), np.argsort(units, kind="stable")])
    return units, recency
