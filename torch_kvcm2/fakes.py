"""The fake (meta) kernels of ``torch.ops.torch_kvcm2.*`` (what torch.compile traces with).

Each checks the metadata the native checks check (so a compile-time error reads like the eager
one) and returns ``None``: each mirrors its op's ``check_*`` in ``csrc/checks.cpp``
(``check_rank_args`` in ``csrc/rank_sync.h`` for the rank ops) check for check -- dtypes, ranks,
shapes, devices, contiguity, integer arguments, list lengths -- raising RuntimeError with the
same words (tests/test_fake_checks.py holds both to a table of bad cases). Left out, because
they depend on the device or on data pointers, are the CUDA kernels' own checks beyond those:
resolve's miss_count 8-byte alignment, its shared memory per row against the device's limit and
its ``scratch`` (size from that layout, 16-byte alignment); fetch's bound on one unit's bytes;
flush's buffers per pool group and one tokens_per_page among them; resolve_gpu_history's shared
memory per row; clear_leases' selection groups per call; uva_view's device and registration.
``ops`` imports this module, so the fakes are registered with the ops' wrappers.
"""
from __future__ import annotations

import torch
from torch import Tensor

from . import _C
from .config import max_inflight_units

MISS_FIELDS = _C.MISS_FIELDS
NUM_COUNTERS = _C.NUM_COUNTERS
MISS_COUNT_WORDS = _C.MISS_COUNT_WORDS
GROUP_FIELDS = _C.GROUP_FIELDS
BUFFER_FIELDS = _C.BUFFER_FIELDS

# ---- fake (meta) kernels ------------------------------------------------------------------------
# Each mirrors its op's check_* in csrc/checks.cpp (rank_signal / rank_wait: check_rank_args in
# csrc/rank_sync.h), check for check, in the same order and naming the same argument, and raises
# RuntimeError as TORCH_CHECK does. They read metadata only; they run at trace time only.

#: Rows of a batch's lengths (csrc/rules.h: kLengthRows).
_LENGTH_ROWS = _C.LENGTH_ROWS
_MAX_WATERMARK_SHAPES = _C.MAX_WATERMARK_SHAPES
_INT32_MAX = 2**31 - 1
_HEADER_WORDS = _C.HEADER_WORDS  # csrc/rank_sync.h: kWords
_MAX_WORLD = _C.MAX_WORLD


def _check(cond, message) -> None:
    """TORCH_CHECK for a fake: RuntimeError with ``message`` (a string or a callable making it)."""
    torch._check(cond, message if callable(message) else lambda: message)


def _shape(t: Tensor) -> list:
    return list(t.shape)


def _int32_2d(t: Tensor, op: str, name: str) -> None:
    _check(t.dtype == torch.int32, lambda: f"{op}: {name} must be int32, got {t.dtype}")
    _check(t.dim() == 2, lambda: f"{op}: {name} must be 2-D, got {t.dim()}-D")
    _check(t.is_contiguous(), lambda: f"{op}: {name} must be contiguous")


def _int32_selection(t: Tensor, op: str, name: str) -> None:
    _check(t.dtype == torch.int32, lambda: f"{op}: {name} must be int32, got {t.dtype}")
    _check(t.dim() in (2, 3), lambda: f"{op}: {name} must be 2-D [rows, K] or 3-D [rows, query "
           f"tokens, K], got {t.dim()}-D")
    _check(t.dim() == 2 or t.shape[1] >= 1,
           lambda: f"{op}: {name} must have at least one query token, got shape {_shape(t)}")
    _check(t.is_contiguous(), lambda: f"{op}: {name} must be contiguous")


def _int32_1d(t: Tensor, n, op: str, name: str) -> None:
    _check(t.dtype == torch.int32, lambda: f"{op}: {name} must be int32, got {t.dtype}")
    _check(t.dim() == 1 and t.shape[0] == n,
           lambda: f"{op}: {name} must have shape [{n}], got {_shape(t)}")
    _check(t.is_contiguous(), lambda: f"{op}: {name} must be contiguous")


def _same_device(a: Tensor, b: Tensor, op: str, name: str) -> None:
    _check(a.device == b.device, lambda: f"{op}: {name} is on {b.device} but expected {a.device}")


def _lengths(like: Tensor, rows, history: Tensor, capacity: Tensor, lease: Tensor,
             op: str) -> None:
    _int32_1d(history, rows, op, "history")
    _int32_1d(capacity, rows, op, "capacity")
    _int32_1d(lease, rows, op, "lease")
    for t in (history, capacity, lease):
        _same_device(like, t, op, "history, capacity and lease")


def _cells_and_host(cell: Tensor, pool: Tensor, pos: int, like: Tensor, b: int, op: str) -> None:
    _check(cell.dtype == torch.uint8 and pool.dtype == torch.uint8,
           lambda: f"{op}: buffer {b}: cells and host pools must be uint8")
    _check(cell.dim() == 4,
           lambda: f"{op}: buffer {b}: cells must be 4-D [n, chunks, tokens_per_page, bytes]")
    _check(pool.dim() == 3,
           lambda: f"{op}: buffer {b}: host pool must be 3-D [num_slots, scale, page_bytes]")
    _check(cell.is_contiguous(), lambda: f"{op}: buffer {b}: cells must be contiguous")
    page_bytes = cell.shape[1] * cell.shape[2] * cell.shape[3]
    _check(0 <= pos < pool.shape[1], lambda: f"{op}: buffer {b}: position {pos} outside the "
           f"pool's {pool.shape[1]} pages per slot")
    _check(page_bytes == 0 or (pool.shape[2] == page_bytes and pool.stride(2) == 1),
           lambda: f"{op}: buffer {b}: cells pages of {page_bytes} bytes differ from host pool "
           f"{_shape(pool)} (pages must be contiguous)")
    _same_device(like, cell, op, "cells")
    _same_device(like, pool, op, "host pools")


def _unit_shape(tokens_per_unit: int, tokens_per_page: int, max_inflight_tokens: int,
                window: int, sinks: int, op: str) -> None:
    """A selection group's unit, page, in-flight, window and sink parameters."""
    _check(tokens_per_unit > 0 and tokens_per_page > 0 and tokens_per_page % tokens_per_unit == 0,
           f"{op}: tokens_per_unit must be positive and divide tokens_per_page")
    _check(max_inflight_tokens > 0 and window >= 0,
           f"{op}: max_inflight_tokens must be positive and window non-negative (0 = none)")
    _check(sinks >= 0 and (sinks == 0 or window > 0),
           f"{op}: sinks must be non-negative, and 0 without a window (window 0)")


def _inflight_slots(inflight_slots: Tensor, rows, tokens_per_unit: int,
                    max_inflight_tokens: int, op: str) -> None:
    _check(tokens_per_unit > 0 and max_inflight_tokens > 0,
           lambda: f"{op}: tokens_per_unit and max_inflight_tokens must be positive")
    _int32_2d(inflight_slots, op, "inflight_slots")
    units = max_inflight_units(max_inflight_tokens, tokens_per_unit)
    _check(inflight_slots.shape[0] == rows and inflight_slots.shape[1] == units,
           lambda: f"{op}: inflight_slots must have shape [{rows}, {units}], got "
           f"{_shape(inflight_slots)}")


def _scale_and_pos(scale: int, pos: int, op: str) -> None:
    _check(scale > 0 and 0 <= pos < scale,
           lambda: f"{op}: need 0 <= pos < scale, got pos={pos} scale={scale}")


@torch.library.register_fake("torch_kvcm2::convert_page_indices")
def _(out, page_table, capacity, scale, pos, units_per_page, tokens_per_unit):
    """check_convert_page_indices, all of it."""
    op = "convert_page_indices"
    _int32_2d(out, op, "out")
    _int32_2d(page_table, op, "page_table")
    _int32_1d(capacity, page_table.shape[0], op, "capacity")
    _same_device(out, page_table, op, "page_table")
    _same_device(out, capacity, op, "capacity")
    _scale_and_pos(scale, pos, op)
    _check(units_per_page > 0 and tokens_per_unit > 0,
           f"{op}: units_per_page and tokens_per_unit must be positive")
    _check(out.shape[0] == page_table.shape[0],
           lambda: f"{op}: out has {out.shape[0]} rows but page_table has {page_table.shape[0]}")
    _check(out.shape[1] >= page_table.shape[1] * units_per_page,
           lambda: f"{op}: out is too narrow: {out.shape[1]} columns for {page_table.shape[1]} "
           f"pages of {units_per_page} units")


@torch.library.register_fake("torch_kvcm2::convert_token_indices")
def _(out, selected, page_table, capacity, scale, pos, tokens_per_page):
    """check_convert_token_indices, all of it."""
    op = "convert_token_indices"
    _int32_2d(out, op, "out")
    _int32_2d(selected, op, "selected")
    _int32_2d(page_table, op, "page_table")
    _int32_1d(capacity, page_table.shape[0], op, "capacity")
    _same_device(out, selected, op, "selected")
    _same_device(out, page_table, op, "page_table")
    _same_device(out, capacity, op, "capacity")
    _scale_and_pos(scale, pos, op)
    _check(tokens_per_page > 0, f"{op}: tokens_per_page must be positive")
    _check(out.shape == selected.shape,
           lambda: f"{op}: out has shape {_shape(out)} but selected has {_shape(selected)}")
    _check(selected.shape[0] <= page_table.shape[0], lambda: f"{op}: selected has "
           f"{selected.shape[0]} rows but page_table only {page_table.shape[0]}")


def _check_write_indices(out, inflight_start, resident, inflight_slots, history, capacity, lease,
                         tokens_per_unit, max_inflight_tokens, op="write_indices",
                         out_name="out", start_name="inflight_start"):
    _int32_2d(out, op, out_name)
    _int32_2d(resident, op, "resident")
    rows = out.shape[0]
    _int32_1d(inflight_start, rows, op, start_name)
    _lengths(out, rows, history, capacity, lease, op)
    for t in (inflight_start, resident, inflight_slots):
        _same_device(out, t, op, "every tensor")
    _inflight_slots(inflight_slots, rows, tokens_per_unit, max_inflight_tokens, op)
    span = max_inflight_tokens + tokens_per_unit - 1
    _check(out.shape[1] >= span, lambda: f"{op}: {out_name} is too narrow: {out.shape[1]} "
           f"columns, an in-flight range can hold {span} tokens")


def _check_resolve(resident, recency, index_table, miss_list, miss_count, counters,
                   inflight_slots, selected, history, capacity, lease, tokens_per_unit,
                   tokens_per_page, max_inflight_tokens, window, sinks):
    op = "resolve"
    _int32_2d(resident, op, "resident")
    _int32_2d(recency, op, "recency")
    _int32_selection(index_table, op, "index_table")
    _int32_2d(miss_list, op, "miss_list")
    _int32_selection(selected, op, "selected")
    rows = selected.shape[0]
    _int32_1d(miss_count, MISS_COUNT_WORDS, op, "miss_count")
    _lengths(resident, rows, history, capacity, lease, op)
    _check(counters.dtype == torch.int64 and counters.dim() == 1
           and counters.shape[0] == NUM_COUNTERS and counters.is_contiguous(),
           f"{op}: counters must be a contiguous int64 tensor of shape [{NUM_COUNTERS}]")
    for t in (recency, index_table, miss_list, miss_count, counters, inflight_slots, selected):
        _same_device(resident, t, op, "every tensor")
    _inflight_slots(inflight_slots, rows, tokens_per_unit, max_inflight_tokens, op)
    _check(recency.shape == resident.shape, lambda: f"{op}: recency has shape "
           f"{_shape(recency)} but resident has {_shape(resident)}")
    _check(index_table.shape == selected.shape, lambda: f"{op}: index_table has shape "
           f"{_shape(index_table)} but selected has {_shape(selected)}")
    _unit_shape(tokens_per_unit, tokens_per_page, max_inflight_tokens, window, sinks, op)
    slots = resident.shape[1]
    units_per_page = tokens_per_page // tokens_per_unit
    _check(slots > 0 and slots % units_per_page == 0, lambda: f"{op}: slots ({slots}) must be a "
           f"positive multiple of units per page ({units_per_page})")
    _check(slots <= 65535, lambda: f"{op}: at most 65535 slots per lease, got {slots}")
    width = selected.shape[1] * (selected.shape[2] if selected.dim() == 3 else 1)
    _check(width <= 65535, lambda: f"{op}: at most 65535 selected columns per row (query tokens "
           f"x K), got {width}")
    per_row = width + max_inflight_units(max_inflight_tokens, tokens_per_unit)
    _check(miss_list.shape[1] == MISS_FIELDS and miss_list.shape[0] >= rows * per_row,
           lambda: f"{op}: miss_list must have shape [>= {rows * per_row}, {MISS_FIELDS}], got "
           f"{_shape(miss_list)}")
    _check(resident.shape[0] * slots <= _INT32_MAX, f"{op}: too many entries for int32")


def _check_resolve_write(write_table, write_start, selected, resident, inflight_slots, history,
                         capacity, lease, tokens_per_unit, max_inflight_tokens):
    _check((write_table is None) == (write_start is None),
           "resolve: pass both write_table and write_start, or neither")
    if write_table is None:
        return
    _check(write_table.dim() >= 1 and write_table.shape[0] == selected.shape[0],
           lambda: f"resolve: write_table must have one row per selected row "
           f"({selected.shape[0]}), got shape {_shape(write_table)}")
    _check_write_indices(write_table, write_start, resident, inflight_slots, history, capacity,
                         lease, tokens_per_unit, max_inflight_tokens, "resolve", "write_table",
                         "write_start")


@torch.library.register_fake("torch_kvcm2::resolve")
def _fake_resolve(resident, recency, index_table, miss_list, miss_count, counters,
                  inflight_slots, selected, history, capacity, lease, tokens_per_unit,
                  tokens_per_page, max_inflight_tokens, window, scratch=None, write_table=None,
                  write_start=None, sinks=0):
    """check_resolve and check_resolve_write, all of them. Left out: the CUDA kernel's own
    checks (csrc/cuda/resolve.cu), which depend on the device or on data pointers: miss_count's
    8-byte alignment, the shared memory a row needs against the device's limit, and ``scratch``
    (its size follows the shared-memory layout; its 16-byte alignment)."""
    _check_resolve(resident, recency, index_table, miss_list, miss_count, counters,
                   inflight_slots, selected, history, capacity, lease, tokens_per_unit,
                   tokens_per_page, max_inflight_tokens, window, sinks)
    _check_resolve_write(write_table, write_start, selected, resident, inflight_slots, history,
                         capacity, lease, tokens_per_unit, max_inflight_tokens)


def _check_fetch(cells, host_pools, positions, page_tables, miss_list, miss_count, slots,
                 tokens_per_unit):
    op = "fetch"
    _int32_2d(miss_list, op, "miss_list")
    _check(miss_list.shape[1] == MISS_FIELDS,
           lambda: f"{op}: miss_list must have {MISS_FIELDS} columns, got {miss_list.shape[1]}")
    _int32_1d(miss_count, MISS_COUNT_WORDS, op, "miss_count")
    _same_device(miss_list, miss_count, op, "miss_count")
    _check(len(cells) == len(host_pools) == len(positions) == len(page_tables),
           lambda: f"{op}: cells, host_pools, positions and page_tables must have one entry per "
           f"buffer, got {len(cells)}, {len(host_pools)}, {len(positions)}, {len(page_tables)}")
    _check(slots > 0 and tokens_per_unit > 0,
           f"{op}: slots and tokens_per_unit must be positive")
    for b, cell in enumerate(cells):
        _cells_and_host(cell, host_pools[b], positions[b], miss_list, b, op)
        _same_device(miss_list, page_tables[b], op, "page_tables")
        _int32_2d(page_tables[b], op, "page_tables[b]")
        tokens_per_page = cell.shape[2]
        _check(tokens_per_page % tokens_per_unit == 0,
               lambda: f"{op}: buffer {b}: tokens_per_unit must divide tokens_per_page")
        _check(slots % (tokens_per_page // tokens_per_unit) == 0,
               f"{op}: slots must be a multiple of units per page")
        _check(tokens_per_page // tokens_per_unit <= _INT32_MAX,
               lambda: f"{op}: buffer {b}: too many units per page")


@torch.library.register_fake("torch_kvcm2::fetch")
def _fake_fetch(cells, host_pools, positions, page_tables, miss_list, miss_count, slots,
                tokens_per_unit):
    """check_fetch, all of it. Left out: the CUDA kernel's bound on one unit's bytes over all
    buffers (2^31 - 1, computed from its vector widths)."""
    _check_fetch(cells, host_pools, positions, page_tables, miss_list, miss_count, slots,
                 tokens_per_unit)


@torch.library.register_fake("torch_kvcm2::locate_inflight")
def _(inflight_slots, resident, history, capacity, lease, tokens_per_unit, max_inflight_tokens):
    """check_locate_inflight, all of it."""
    op = "locate_inflight"
    _int32_2d(inflight_slots, op, "inflight_slots")
    _int32_2d(resident, op, "resident")
    rows = inflight_slots.shape[0]
    _lengths(inflight_slots, rows, history, capacity, lease, op)
    _same_device(inflight_slots, resident, op, "resident")
    _inflight_slots(inflight_slots, rows, tokens_per_unit, max_inflight_tokens, op)


@torch.library.register_fake("torch_kvcm2::write_indices")
def _fake_write_indices(out, inflight_start, resident, inflight_slots, history, capacity, lease,
                        tokens_per_unit, max_inflight_tokens):
    """check_write_indices, all of it."""
    _check_write_indices(out, inflight_start, resident, inflight_slots, history, capacity, lease,
                         tokens_per_unit, max_inflight_tokens)


@torch.library.register_fake("torch_kvcm2::resolve_gpu_history")
def _fake_resolve_gpu_history(index_table, write_table, write_start, counters, selected,
                              gpu_rows, gpu_pages, history, capacity, lease, cell_entries,
                              gpu_slots, tokens_per_unit, tokens_per_page, max_inflight_tokens,
                              window, sinks):
    """check_resolve_gpu_history, all of it. Left out: the CUDA kernel's shared-memory bound
    on the columns of a row (a set of at least twice as many words), which depends on the
    device."""
    op = "resolve_gpu_history"
    _int32_selection(index_table, op, "index_table")
    _int32_selection(selected, op, "selected")
    _check(index_table.shape == selected.shape, lambda: f"{op}: index_table has shape "
           f"{_shape(index_table)} but selected has {_shape(selected)}")
    rows = selected.shape[0]
    _int32_2d(write_table, op, "write_table")
    _int32_1d(write_start, rows, op, "write_start")
    _int32_1d(gpu_rows, rows, op, "gpu_rows")
    _int32_2d(gpu_pages, op, "gpu_pages")
    _check(write_table.shape[0] == rows and gpu_pages.shape[0] == rows,
           lambda: f"{op}: write_table and gpu_pages need one row per selected row ({rows}), got "
           f"{_shape(write_table)} and {_shape(gpu_pages)}")
    _lengths(selected, rows, history, capacity, lease, op)
    _check(counters.dtype == torch.int64 and counters.dim() == 1
           and counters.shape[0] == NUM_COUNTERS and counters.is_contiguous(),
           f"{op}: counters must be a contiguous int64 tensor of shape [{NUM_COUNTERS}]")
    for t in (index_table, write_table, write_start, counters, gpu_rows, gpu_pages):
        _same_device(selected, t, op, "every tensor")
    _unit_shape(tokens_per_unit, tokens_per_page, max_inflight_tokens, window, sinks, op)
    _check(write_table.shape[1] >= max_inflight_tokens + tokens_per_unit - 1,
           lambda: f"{op}: write_table is too narrow: {write_table.shape[1]} columns, an "
           f"in-flight range can hold {max_inflight_tokens + tokens_per_unit - 1} tokens")
    _check(cell_entries >= 0 and gpu_slots >= 0,
           f"{op}: cell_entries and gpu_slots must be non-negative")
    entries = cell_entries + gpu_slots * (tokens_per_page // tokens_per_unit)
    _check(entries * tokens_per_unit <= _INT32_MAX, lambda: f"{op}: {entries} entries of "
           f"{tokens_per_unit} tokens exceed the int32 token indices")
    width = selected.shape[1] * selected.shape[2] if selected.dim() == 3 else selected.shape[1]
    _check(width <= 65535, lambda: f"{op}: at most 65535 selected columns per row (query tokens "
           f"x K), got {width}")


@torch.library.register_fake("torch_kvcm2::flush_gpu_history")
def _fake_flush_gpu_history(host_pool, positions, spaces, gpu_rows, gpu_pages, page_table,
                            new_history, history, capacity, lease, unit_params):
    """check_flush_gpu_history, all of it."""
    op = "flush_gpu_history"
    _int32_2d(page_table, op, "page_table")
    rows = page_table.shape[0]
    _int32_1d(new_history, rows, op, "new_history")
    _int32_1d(gpu_rows, rows, op, "gpu_rows")
    _int32_2d(gpu_pages, op, "gpu_pages")
    _check(gpu_pages.shape[0] == rows, lambda: f"{op}: gpu_pages needs one row per page_table "
           f"row ({rows}), got {_shape(gpu_pages)}")
    _lengths(page_table, rows, history, capacity, lease, op)
    for t in (new_history, gpu_rows, gpu_pages, host_pool):
        _same_device(page_table, t, op, "every tensor")
    n = len(spaces)
    _check(len(positions) == n and len(unit_params) == 3 * n,
           f"{op}: positions and spaces need one entry per buffer and unit_params three ints per "
           f"buffer")
    for b, space in enumerate(spaces):
        _cells_and_host(space, host_pool, positions[b], page_table, b, op)
        cell_pages, unit, inflight = unit_params[3 * b:3 * b + 3]
        _check(0 <= cell_pages <= space.shape[0] and unit > 0 and inflight > 0
               and space.shape[2] % unit == 0,
               lambda: f"{op}: buffer {b}: bad unit_params (cell_pages {cell_pages}, "
               f"tokens_per_unit {unit}, max_inflight_tokens {inflight}) for {space.shape[0]} "
               f"pages of {space.shape[2]} tokens")


@torch.library.register_fake("torch_kvcm2::resolve_groups")
def _(resident, recency, index_table, miss_list, miss_count, counters, inflight_slots,
      write_table, write_start, cells, scratch, selected, history, capacity, lease, host_pools,
      page_tables, tokens_per_page, group_params, buffer_params):
    """check_resolve_groups (csrc/resolve_groups.cpp): the lists' lengths, the group and buffer
    fields, and resolve_step's checks per group. Left out: what resolve's and fetch's fakes
    leave out, and that no two groups share memory they mutate (data pointers)."""
    op = "resolve_groups"
    n = len(resident)
    for lst in (recency, index_table, miss_list, miss_count, counters, inflight_slots,
                write_table, write_start, selected):
        _check(len(lst) == n, lambda: f"{op}: every per-group list must have one entry per group "
               f"({n} resident tables), got one of {len(lst)}")
    _check(len(group_params) == n * GROUP_FIELDS,
           lambda: f"{op}: group_params must have {GROUP_FIELDS} entries per group "
           f"({n * GROUP_FIELDS}), got {len(group_params)}")
    _check(len(buffer_params) == len(cells) * BUFFER_FIELDS,
           lambda: f"{op}: buffer_params must have {BUFFER_FIELDS} entries per buffer "
           f"({len(cells) * BUFFER_FIELDS}), got {len(buffer_params)}")
    first = 0
    for g in range(n):
        U, I, window, sinks, s, nb = group_params[g * GROUP_FIELDS:(g + 1) * GROUP_FIELDS]
        _check(-1 <= s < len(scratch), lambda: f"{op}: group {g}: scratch index {s} outside "
               f"[-1, {len(scratch)})")
        _check(nb >= 0 and first + nb <= len(cells), lambda: f"{op}: group {g}: {nb} buffers from "
               f"buffer {first} exceed the {len(cells)} given")
        pools, positions, tables = [], [], []
        for b in range(first, first + nb):
            i, pos, j = buffer_params[b * BUFFER_FIELDS:(b + 1) * BUFFER_FIELDS]
            _check(0 <= i < len(host_pools) and 0 <= j < len(page_tables),
                   lambda: f"{op}: buffer {b}: host pool {i} or page table {j} outside the "
                   f"{len(host_pools)} and {len(page_tables)} given")
            pools.append(host_pools[i])
            positions.append(pos)
            tables.append(page_tables[j])
        _check_resolve(resident[g], recency[g], index_table[g], miss_list[g], miss_count[g],
                       counters[g], inflight_slots[g], selected[g], history, capacity, lease, U,
                       tokens_per_page, I, window, sinks)
        _check_resolve_write(write_table[g], write_start[g], selected[g], resident[g],
                             inflight_slots[g], history, capacity, lease, U, I)
        if nb:
            _check_fetch(cells[first:first + nb], pools, positions, tables, miss_list[g],
                         miss_count[g], resident[g].shape[1], U)
        first += nb
    _check(first == len(cells), lambda: f"{op}: the groups fetch {first} buffers but "
           f"{len(cells)} are given")


@torch.library.register_fake("torch_kvcm2::resolve_step")
def _(resident, recency, index_table, miss_list, miss_count, counters, inflight_slots, write_table,
      write_start, cells, selected, history, capacity, lease, host_pools, positions, page_tables,
      tokens_per_unit, tokens_per_page, max_inflight_tokens, window, scratch=None, sinks=0):
    """resolve_step's checks (csrc/resolve_step.cpp), all of them: resolve's and fetch's, or no host
    pools, positions or page tables without cells. Left out: what resolve's and fetch's fakes
    leave out."""
    _check_resolve(resident, recency, index_table, miss_list, miss_count, counters,
                   inflight_slots, selected, history, capacity, lease, tokens_per_unit,
                   tokens_per_page, max_inflight_tokens, window, sinks)
    _check_resolve_write(write_table, write_start, selected, resident, inflight_slots, history,
                         capacity, lease, tokens_per_unit, max_inflight_tokens)
    if cells:
        _check_fetch(cells, host_pools, positions, page_tables, miss_list, miss_count,
                     resident.shape[1], tokens_per_unit)
    else:
        _check(not host_pools and not positions and not page_tables,
               "resolve_step: no cells, so no host pools, positions or page tables either")


@torch.library.register_fake("torch_kvcm2::flush")
def _(host_pool, positions, cells, resident, inflight_slots, page_table, new_history, history,
      capacity, lease, unit_params):
    """check_flush, all of it. Left out: the CUDA kernel's own checks (csrc/cuda/flush.cu): at
    most its fixed number of buffers per pool group, and one tokens_per_page for all of them."""
    op = "flush"
    _int32_2d(page_table, op, "page_table")
    rows = page_table.shape[0]
    _int32_1d(new_history, rows, op, "new_history")
    _same_device(page_table, new_history, op, "new_history")
    _lengths(page_table, rows, history, capacity, lease, op)
    _same_device(page_table, host_pool, op, "host_pool")
    n = len(cells)
    _check(len(positions) == n and len(resident) == n and len(inflight_slots) == n
           and len(unit_params) == 3 * n,
           f"{op}: positions, cells, resident, inflight_slots need one entry per buffer and "
           "unit_params three ints per buffer")
    for b, cell in enumerate(cells):
        _cells_and_host(cell, host_pool, positions[b], page_table, b, op)
        _int32_2d(resident[b], op, "resident[b]")
        _same_device(page_table, resident[b], op, "resident")
        _same_device(page_table, inflight_slots[b], op, "inflight_slots")
        slots, unit, inflight = unit_params[3 * b:3 * b + 3]
        _check(slots == resident[b].shape[1] and unit > 0 and inflight > 0
               and cell.shape[2] % unit == 0 and slots % (cell.shape[2] // unit) == 0,
               lambda: f"{op}: buffer {b}: bad unit_params (slots {slots}, tokens_per_unit "
               f"{unit}, max_inflight_tokens {inflight})")
        _check(cell.shape[2] // unit <= _INT32_MAX,
               lambda: f"{op}: buffer {b}: too many units per page")
        _inflight_slots(inflight_slots[b], rows, unit, inflight, op)
        _check(cell.shape[0] * (cell.shape[2] // unit) >= resident[b].shape[0] * slots,
               lambda: f"{op}: buffer {b}: fewer cells than leases x slots")


@torch.library.register_fake("torch_kvcm2::flush_watermark")
def _(written, declared, new_history, history, capacity, lease, shapes):
    """check_flush_watermark, all of it."""
    op = "flush_watermark"
    _check(written.dim() == 1, lambda: f"{op}: written must be int32[rows], got {_shape(written)}")
    rows = written.shape[0]
    _int32_1d(written, rows, op, "written")
    _int32_1d(declared, rows, op, "declared")
    _int32_1d(new_history, rows, op, "new_history")
    _same_device(written, declared, op, "declared")
    _same_device(written, new_history, op, "new_history")
    _lengths(written, rows, history, capacity, lease, op)
    _check(len(shapes) % 2 == 0 and len(shapes) <= 2 * _MAX_WATERMARK_SHAPES,
           lambda: f"{op}: shapes must be (tokens_per_unit, max_inflight_tokens) pairs, at most "
           f"{_MAX_WATERMARK_SHAPES}, got {len(shapes)} ints")
    for i in range(0, len(shapes), 2):
        unit, inflight = shapes[i], shapes[i + 1]
        _check(0 < unit <= _INT32_MAX and 0 <= inflight <= _INT32_MAX,
               lambda: f"{op}: shape {i // 2} needs tokens_per_unit > 0 and max_inflight_tokens "
               f">= 0, got ({unit}, {inflight})")


@torch.library.register_fake("torch_kvcm2::advance")
def _(lengths, counters, accepted):
    """check_advance, all of it."""
    op = "advance"
    _check(lengths.dtype == torch.int32 and lengths.dim() == 2
           and lengths.shape[0] == _LENGTH_ROWS and lengths.is_contiguous(),
           lambda: f"{op}: lengths must be contiguous int32[{_LENGTH_ROWS}, rows], got "
           f"{lengths.dtype} {_shape(lengths)}")
    _int32_1d(accepted, lengths.shape[1], op, "accepted")
    _check(counters.dtype == torch.int64 and counters.dim() == 1 and counters.shape[0] == 2
           and counters.is_contiguous(),
           lambda: f"{op}: counters must be contiguous int64[2], got {counters.dtype} "
           f"{_shape(counters)}")
    _same_device(lengths, accepted, op, "accepted")
    _same_device(lengths, counters, op, "counters")


@torch.library.register_fake("torch_kvcm2::clear_leases")
def _(resident, recency, leases):
    """check_clear_leases, all of it. Left out: the CUDA kernel's bound on the number of
    selection groups one call clears (csrc/cuda/advance.cu)."""
    op = "clear_leases"
    _check(len(resident) == len(recency), lambda: f"{op}: resident and recency need one tensor "
           f"per selection group, got {len(resident)} and {len(recency)}")
    _check(leases.dtype == torch.int64 and leases.dim() == 1 and leases.is_contiguous(),
           lambda: f"{op}: leases must be contiguous int64[n], got {leases.dtype} "
           f"{_shape(leases)}")
    for g, (res, rec) in enumerate(zip(resident, recency)):
        _int32_2d(res, op, "resident[g]")
        _int32_2d(rec, op, "recency[g]")
        _check(res.shape == rec.shape, lambda: f"{op}: group {g}: resident and recency differ "
               f"in shape: {_shape(res)} and {_shape(rec)}")
        _same_device(leases, res, op, "resident")
        _same_device(leases, rec, op, "recency")


def _check_rank_args(op, header, gen, rank, world):
    _check(header.dtype == torch.int64 and header.is_contiguous() and header.dim() == 1
           and header.numel() == _HEADER_WORDS,
           lambda: f"{op}: header must be a contiguous int64[{_HEADER_WORDS}] tensor, got "
           f"{header.dtype}{_shape(header)}")
    _check(gen.dtype == torch.int64 and gen.numel() == 1,
           lambda: f"{op}: gen must be an int64[1] tensor, got {gen.dtype}{_shape(gen)}")
    _check(gen.device == header.device, lambda: f"{op}: gen ({gen.device}) and header "
           f"({header.device}) must be on one device")
    _check(1 <= world <= _MAX_WORLD,
           lambda: f"{op}: world must be in [1, {_MAX_WORLD}], got {world}")
    _check(0 <= rank < world, lambda: f"{op}: rank must be in [0, world={world}), got {rank}")


@torch.library.register_fake("torch_kvcm2::rank_signal")
def _(header, gen, pools, rank, world):
    """check_rank_args, all of it (the kernels' "needs CPU / CUDA tensors" follows from
    dispatch on header's device once gen is on it too)."""
    _check_rank_args("rank_signal", header, gen, rank, world)


@torch.library.register_fake("torch_kvcm2::rank_wait")
def _(header, pools, gen, rank, world, timeout_us):
    """check_rank_args and the positive timeout, all of it (as rank_signal's fake)."""
    _check_rank_args("rank_wait", header, gen, rank, world)
    _check(timeout_us > 0, lambda: f"rank_wait: timeout_us must be positive, got {timeout_us}")


@torch.library.register_fake("torch_kvcm2::uva_view")
def _(host, register=True):
    """uva_view's metadata checks (csrc/cuda/uva.cu): a contiguous CPU tensor with storage.
    Left out: everything about the device and the registration (CUDA runtime state)."""
    _check(host.device.type == "cpu", lambda: f"uva_view: expected a CPU tensor, got one on "
           f"{host.device}")
    _check(host.is_contiguous(), "uva_view: the tensor must be contiguous")
    _check(host.untyped_storage().nbytes() > 0, "uva_view: the tensor's storage is empty")
    return torch.empty_strided(host.shape, host.stride(), dtype=host.dtype, device="cuda")
