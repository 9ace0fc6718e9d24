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
  pages are freed, its lease is cleared (stale cell copies of units written since on GPU
  pages) and it continues on cells from a cold start, exact because the host pages hold all
  its history;
* a row that leaves (a hole, a suspended row) frees its pages.

Rows are promoted in row order while slots last (first come, first served); no row is demoted
to make room for another. A publish that only tops up pages (a read-back in flight) promotes
nothing.
"""
from __future__ import annotations

import numpy as np
import torch

from . import lengths as rules
from .config import BAD
from .memory import ALLOCATED, CAPACITY, HISTORY, LEASE, sparse_buffers


class GpuHistory:
    """The host bookkeeping of one batch's GPU history pages."""

    def __init__(self, batch, mirror):
        config = batch.config
        self.config, self.mirror = config, mirror
        self.manager = batch.manager
        self.slots = batch.gpu_history_slots
        self.P, self.R, self.MP = config.tokens_per_page, batch.max_rows, config.max_pages_per_row
        self.free = list(range(self.slots - 1, -1, -1))  # a stack: the lowest slot first
        self.pages = np.full((self.R, self.MP), BAD, dtype=np.int32)  # per row, as planned
        self.held = np.zeros(self.R, dtype=np.int64)  # page ordinals [0, held) hold a slot
        self.on_gpu = np.zeros(self.R, dtype=bool)
        self.shapes = [(g.sparse.tokens_per_unit, g.sparse.max_inflight_tokens)
                       for g in config.selection_groups]
        self.flag_base = mirror.gpu_offset + self.R * self.MP

    @property
    def enabled(self) -> bool:
        return self.slots > 0

    def rows(self) -> int:
        return int(self.on_gpu.sum())

    def used_slots(self) -> int:
        return self.slots - len(self.free)

    def plan(self, rows: list, values: np.ndarray, fresh: list, pages_only: bool) -> tuple:
        """Residency for the published ``rows`` (their length rows ``values``, int32[n, 6];
        ``fresh[i]``: the row has another owner than at its last publish): returns (delta
        index, delta value, rows demoted, promotions) where promotions are ``(row, slot ids of
        pages [0, ceil(h/P)))`` whose history must be copied before the step; the delta sets
        the rows' GPU page entries and flags in the table store."""
        index, value, demoted, promoted = [], [], [], []
        h, c, lease, allocated = (values[:, k].astype(np.int64)
                                  for k in (HISTORY, CAPACITY, LEASE, ALLOCATED))
        s0 = h.copy()
        for shape in self.shapes:
            s0 = np.maximum(s0, rules.inflight_start(h, c, shape, np.maximum))
        direct = s0 > h
        need = -(-allocated // self.P)
        for i, row in enumerate(rows):
            if self.on_gpu[row] and (fresh[i] or lease[i] < 0):
                self._release(row, index, value)  # its request left: the pages are its
            if lease[i] < 0:  # a hole or a suspended row
                continue
            if self.on_gpu[row]:
                # (a pages-only publish holds host lengths older than the device's: it only
                # grows the pages)
                if (direct[i] and not pages_only) or not self._resize(row, int(need[i]), index,
                                                                       value):
                    self._release(row, index, value)
                    demoted.append(row)
                    self.manager.counts.demotions += 1
            elif not pages_only and not direct[i] and need[i] <= len(self.free):
                self.on_gpu[row] = True
                index.append(np.array([self.flag_base + row]))
                value.append(np.array([1], dtype=np.int32))
                self._resize(row, int(need[i]), index, value)
                promoted.append((row, self.pages[row, :-(-int(h[i]) // self.P)].copy()))
                self.manager.counts.promotions += 1
        if not index:
            return None, None, demoted, promoted
        return np.concatenate(index), np.concatenate(value), demoted, promoted

    def _resize(self, row: int, need: int, index: list, value: list) -> bool:
        """Row ``row`` holds slots for page ordinals [0, need); False (nothing changed) when
        the free slots cannot cover the growth."""
        held = int(self.held[row])
        if need > held:
            if need - held > len(self.free):
                return False
            taken = [self.free.pop() for _ in range(need - held)]
            self.pages[row, held:need] = taken
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

    def copy_in(self, batch, promoted: list) -> None:
        """Promotions: each row's history pages, host -> its GPU pages in every sparse buffer,
        whole pages, on the current stream (RSD-1). Pages past the history hold what the host
        page holds; the step writes its in-flight tokens over them."""
        if not promoted:
            return
        manager, config = self.manager, self.config
        step = batch._step
        for row, gpu in promoted:
            if not len(gpu):
                continue
            cache = batch._table.caches[row]
            gpu_index = torch.as_tensor(gpu.astype(np.int64), device=config.device)
            for group in config.selection_groups:
                cell_pages = step.cell_pages[group.index]
                for layer in group.layers:
                    for buf in sparse_buffers(config, layer):
                        host = cache.host_pages(layer, buf.role)[:len(gpu)]
                        kept = host >= 0  # a windowed group's released pages hold nothing
                        host = torch.as_tensor(host[kept], device=config.device)
                        target = gpu_index[torch.as_tensor(kept, device=config.device)]
                        space = step.cells[(layer, buf.role)]
                        view = manager.buffer_view(layer, buf.role)
                        space.index_copy_(0, target + cell_pages, view.index_select(0, host))
                        manager.counts.promoted_bytes += len(gpu) * self.P * buf.bytes_per_token
