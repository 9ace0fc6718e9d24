"""Typed wrappers over ``torch.ops.torch_kvcm2.*`` and the layouts the ops share.

Every per-step op mutates preallocated tensors in place and returns nothing. Their fake (meta)
kernels, which torch.compile traces with, are in ``fakes.py``, registered when this module is
imported. All index tensors are int32; ``BAD`` (-1) marks "no page / no entry".
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor

from . import _C
from .config import max_inflight_units  # noqa: F401  (re-exported: the one home of the rule)

__all__ = [
    "MISS_COUNT_WORDS",
    "MISS_FIELDS",
    "NUM_COUNTERS",
    "SETUP_OPS",
    "advance",
    "clear_leases",
    "convert_page_indices",
    "convert_token_indices",
    "fetch",
    "flush",
    "flush_gpu_history",
    "flush_watermark",
    "locate_inflight",
    "max_inflight_units",
    "rank_signal",
    "rank_wait",
    "BUFFER_FIELDS",
    "GROUP_FIELDS",
    "resolve",
    "resolve_gpu_history",
    "resolve_groups",
    "resolve_step",
    "uva_view",
    "write_indices",
]

_ops = torch.ops.torch_kvcm2

#: Ops used only at setup, outside compiled or captured regions; not per-step state transitions.
SETUP_OPS = frozenset({"uva_view", "host_register"})

# The layouts the ops share with this module, defined once in the native library (csrc/rules.h,
# groups.h, rank_sync.h) and exported by torch_kvcm2._C:
#: (lease, slot, row, unit) per miss-list entry
MISS_FIELDS = _C.MISS_FIELDS
#: hits, misses, invalid
NUM_COUNTERS = _C.NUM_COUNTERS
#: A selection group's miss count, int32[4]: [0] the last resolve's entries; [2:4] the CUDA
#: resolve's reservation word, zero between resolves (allocate it zeroed); [1] padding.
MISS_COUNT_WORDS = _C.MISS_COUNT_WORDS
#: ``resolve_groups``' group_params per group: (tokens_per_unit, max_inflight_tokens, window,
#: sinks, index into scratch or -1, buffers to fetch); its buffer_params per buffer: (index into
#: host_pools, position in a slot, index into page_tables).
GROUP_FIELDS = _C.GROUP_FIELDS
BUFFER_FIELDS = _C.BUFFER_FIELDS


def convert_page_indices(
    out: Tensor,
    page_table: Tensor,
    capacity: Tensor,
    scale: int = 1,
    pos: int = 0,
    units_per_page: int = 1,
    tokens_per_unit: int = 1,
) -> None:
    """OP-INDEX, page form. Writes ``out[r, j]`` = ``(slot*scale + pos)*E + j%E`` with
    ``slot = page_table[r, j // E]`` (E = ``units_per_page``) for units ``j`` below the row's
    capacity (``j*tokens_per_unit < capacity[r]``); BAD for BAD slots, past capacity and for
    columns beyond ``page_table``'s width.

    ``page_table`` int32[R, P], ``capacity`` int32[R], ``out`` int32[R, W] with W >= P*E (a
    narrower ``out`` raises). Mutates ``out``.
    """
    _ops.convert_page_indices(out, page_table, capacity, scale, pos, units_per_page, tokens_per_unit)


def convert_token_indices(
    out: Tensor,
    selected: Tensor,
    page_table: Tensor,
    capacity: Tensor,
    scale: int,
    pos: int,
    tokens_per_page: int,
) -> None:
    """OP-INDEX, token form. Writes ``out[r, j]`` = ``(page_table[r, t//P]*scale + pos)*P + t%P``
    for the token position ``t = selected[r, j]``; BAD for padding (t < 0), t >= capacity[r], a
    page beyond the table or a BAD page. ``selected`` and ``out`` int32[R, K]. Mutates ``out``.
    """
    _ops.convert_token_indices(out, selected, page_table, capacity, scale, pos, tokens_per_page)


def resolve(
    resident: Tensor,
    recency: Tensor,
    index_table: Tensor,
    miss_list: Tensor,
    miss_count: Tensor,
    counters: Tensor,
    inflight_slots: Tensor,
    selected: Tensor,
    history: Tensor,
    capacity: Tensor,
    lease: Tensor,
    tokens_per_unit: int,
    tokens_per_page: int,
    max_inflight_tokens: int,
    window: int = 0,
    scratch: Optional[Tensor] = None,
    write_table: Optional[Tensor] = None,
    write_start: Optional[Tensor] = None,
    sinks: int = 0,
) -> None:
    """OP-RESOLVE for one selection group over every row (REQUIREMENTS §8; docs/DESIGN.md).

    State ``resident``/``recency`` int32[num_leases, S]; ``selected`` and ``index_table``
    int32[R, K], or int32[R, T', K] for T' query tokens per row (MTP-2): a row's T'*K columns are
    resolved as one selection in (query token, column) order, which resolves the union of its
    tokens' selections once (MTP-3; docs/MTP.md), and ``K`` below means T'*K.
    ``miss_list`` int32[>= R*(K + max_inflight_units), 4] is overwritten with this
    call's misses and ``miss_count[0]`` with their number (``miss_count`` int32[4], 8-byte
    aligned, created zeroed: ``[2:4]`` is the CUDA kernel's reservation word, which every
    resolve leaves zero); ``counters`` int64[3] (hits, misses, invalid) accumulate; ``history``/``capacity``/``lease`` int32[R] are the published tables.
    ``inflight_slots`` int32[R, ceil(I/U)+1] is overwritten with each row's in-flight slot
    records (as ``locate_inflight`` computes them), which write_indices and flush read.
    ``window`` is 0 for full attention; ``sinks`` (tokens, 0 without a window) keeps the units
    of a windowed group's first ``ceil(sinks / tokens_per_page)`` pages selectable behind the
    window (TIER-3; csrc/rules.h's RowRange). ``scratch`` (CUDA only; ignored on CPU) is uint8 of at
    least ``R * memory.resolve_scratch_bytes(T'*K)`` bytes: the table region of rows whose
    resolve does not fit shared memory (docs/MTP.md); without it such rows raise.
    ``write_table`` and ``write_start`` (both or neither): also OP-WRITE's outputs, what
    ``write_indices(write_table, write_start, resident, inflight_slots, history, capacity,
    lease, ...)`` would write right after, in the same call (on CUDA by the resolve kernel), for
    rows of distinct leases (as a batch has; two rows of one lease race on CUDA anyway).
    """
    _ops.resolve(
        resident, recency, index_table, miss_list, miss_count, counters, inflight_slots, selected,
        history, capacity, lease, tokens_per_unit, tokens_per_page, max_inflight_tokens, window,
        scratch, write_table, write_start, sinks,
    )


def fetch(
    cells: Sequence[Tensor],
    host_pools: Sequence[Tensor],
    positions: Sequence[int],
    page_tables: Sequence[Tensor],
    miss_list: Tensor,
    miss_count: Tensor,
    slots: int,
    tokens_per_unit: int,
) -> None:
    """OP-FETCH: copies each listed missed unit of every given buffer from its host page into its
    cell, chunk by chunk. Per buffer ``b``: ``cells[b]`` uint8[num_cells, chunks, P, B/chunks];
    its host pages are ``host_pools[b][slot, positions[b]]``, where ``host_pools[b]`` is its pool
    group's whole pool uint8[num_slots, scale, page_bytes] (``Storage.pool``; the same tensor for
    buffers of one group) and ``page_tables[b]`` that group's int32 page table. The first
    ``miss_count[0]`` entries of ``miss_list`` are fetched (``miss_count`` int32[4], as resolve
    leaves it). Entries with bad values (BAD page, out of range) are skipped. Mutates ``cells``.
    """
    _ops.fetch(list(cells), list(host_pools), list(positions), list(page_tables), miss_list,
               miss_count, slots, tokens_per_unit)


def resolve_step(
    resident: Tensor,
    recency: Tensor,
    index_table: Tensor,
    miss_list: Tensor,
    miss_count: Tensor,
    counters: Tensor,
    inflight_slots: Tensor,
    write_table: Tensor,
    write_start: Tensor,
    cells: Sequence[Tensor],
    selected: Tensor,
    history: Tensor,
    capacity: Tensor,
    lease: Tensor,
    host_pools: Sequence[Tensor],
    positions: Sequence[int],
    page_tables: Sequence[Tensor],
    tokens_per_unit: int,
    tokens_per_page: int,
    max_inflight_tokens: int,
    window: int = 0,
    scratch: Optional[Tensor] = None,
    sinks: int = 0,
) -> None:
    """OP-STEP: one selection group's part of a decode step in one call, with the results of
    ``resolve(..., write_table, write_start)`` and then, when ``cells`` is not empty,
    ``fetch(cells, host_pools, positions, page_tables, miss_list, miss_count, S,
    tokens_per_unit)`` (S = ``resident.size(1)``), bit for bit: the arguments are theirs. Every
    argument is checked before any part runs. It saves host time: one call instead of three
    (resolve, write_indices, fetch). Mutates what they mutate.
    """
    _ops.resolve_step(
        resident, recency, index_table, miss_list, miss_count, counters, inflight_slots,
        write_table, write_start, list(cells), selected, history, capacity, lease,
        list(host_pools), list(positions), list(page_tables), tokens_per_unit, tokens_per_page,
        max_inflight_tokens, window, scratch, sinks,
    )


def resolve_groups(
    resident: Sequence[Tensor],
    recency: Sequence[Tensor],
    index_table: Sequence[Tensor],
    miss_list: Sequence[Tensor],
    miss_count: Sequence[Tensor],
    counters: Sequence[Tensor],
    inflight_slots: Sequence[Tensor],
    write_table: Sequence[Tensor],
    write_start: Sequence[Tensor],
    cells: Sequence[Tensor],
    scratch: Sequence[Tensor],
    selected: Sequence[Tensor],
    history: Tensor,
    capacity: Tensor,
    lease: Tensor,
    host_pools: Sequence[Tensor],
    page_tables: Sequence[Tensor],
    tokens_per_page: int,
    group_params: Sequence[int],
    buffer_params: Sequence[int],
) -> None:
    """OP-STEP for several selection groups in one call: group ``g``'s part is ``resolve_step``
    with ``resident[g]``, ..., ``write_start[g]``, ``selected[g]``, and from
    ``group_params[6g:6g+6]`` = (tokens_per_unit, max_inflight_tokens, window, sinks, s, n):
    ``scratch[s]`` (none when s is -1) and the next ``n`` entries of ``cells`` (the groups' runs
    in group order; n = 0: no fetch), cell ``b`` fetched from ``host_pools[i]`` at position
    ``pos`` with ``page_tables[j]`` for ``buffer_params[3b:3b+3]`` = (i, pos, j): each pool and
    page table is passed once, however many buffers use it. The groups must share no tensor they
    mutate. Bit for bit the results of ``resolve_step`` per group; every argument is checked
    before any part runs. On CUDA the groups' resolves run side by side (each its own launch, on
    the current stream and side streams forked from it and joined back) and every group's fetch
    is one launch (part by part from 32 rows), so a step's copies run side by side instead of
    one group's after another's resolve (P-STEP-1).
    """
    _ops.resolve_groups(
        list(resident), list(recency), list(index_table), list(miss_list), list(miss_count),
        list(counters), list(inflight_slots), list(write_table), list(write_start), list(cells),
        list(scratch), list(selected), history, capacity, lease, list(host_pools),
        list(page_tables), tokens_per_page, list(group_params), list(buffer_params),
    )


def locate_inflight(
    inflight_slots: Tensor,
    resident: Tensor,
    history: Tensor,
    capacity: Tensor,
    lease: Tensor,
    tokens_per_unit: int,
    max_inflight_tokens: int,
) -> None:
    """``inflight_slots[r, k]`` = the lowest slot of the lease holding in-flight unit
    ``floor(s0/U) + k`` of row r, BAD when none (or unseated). int32[R, ceil(I/U)+1]. Mutates
    ``inflight_slots``; write_indices and flush read it. ``resolve`` already writes these
    records; this op recomputes them from residency alone (after changing lengths or residency
    without a resolve)."""
    _ops.locate_inflight(inflight_slots, resident, history, capacity, lease, tokens_per_unit,
                         max_inflight_tokens)


def resolve_gpu_history(
    index_table: Tensor,
    write_table: Tensor,
    write_start: Tensor,
    counters: Tensor,
    selected: Tensor,
    gpu_rows: Tensor,
    gpu_pages: Tensor,
    history: Tensor,
    capacity: Tensor,
    lease: Tensor,
    cell_entries: int,
    gpu_slots: int,
    tokens_per_unit: int,
    tokens_per_page: int,
    max_inflight_tokens: int,
    window: int = 0,
    sinks: int = 0,
) -> None:
    """RSD-1: resolve and OP-WRITE for the rows of one selection group whose history is on GPU
    pages (``gpu_rows[r] != 0`` and a lease), which ``resolve`` was given as holes. The index
    space of each sparse buffer is its cells (``cell_entries`` = leases x S entries) followed
    by ``gpu_slots`` GPU pages of E = P/U entries; ``gpu_pages[r, p]`` (int32[R, pages]) is the
    GPU page slot of the row's page ordinal p, BAD for none.

    Per such row: ``index_table[r, j]`` = ``cell_entries + page*E + u % E`` for a selected,
    selectable unit u whose page is on the GPU (MTP: the columns of every query token, as
    ``resolve`` takes them), BAD otherwise; ``write_table[r, j]`` = ``entry*U + t % U`` for
    in-flight token ``t = s0 + j < c`` (BAD beyond, or without a GPU page), ``write_start[r]`` =
    s0. Each distinct selected ordinal counts once in ``counters``: a hit with a GPU entry, else
    invalid (not selectable; or no GPU page, which is bad data for such a row). Nothing is
    missed, fetched or made resident. Other rows keep what ``resolve`` wrote. Mutates
    ``index_table``, ``write_table``, ``write_start`` and ``counters``."""
    _ops.resolve_gpu_history(index_table, write_table, write_start, counters, selected, gpu_rows,
                             gpu_pages, history, capacity, lease, cell_entries, gpu_slots,
                             tokens_per_unit, tokens_per_page, max_inflight_tokens, window, sinks)


def flush_gpu_history(
    host_pool: Tensor,
    positions: Sequence[int],
    spaces: Sequence[Tensor],
    gpu_rows: Tensor,
    gpu_pages: Tensor,
    page_table: Tensor,
    new_history: Tensor,
    history: Tensor,
    capacity: Tensor,
    lease: Tensor,
    unit_params: Sequence[int],
) -> None:
    """RSD-1's flush for one sparse pool group: per row whose history is on GPU pages
    (``gpu_rows[r] != 0`` and a lease), the tokens ``[s0, min(new_history, c))`` of each buffer
    from its GPU page (page ``cell_pages + gpu_pages[r, t // P]`` of ``spaces[b]``, the buffer's
    cells followed by its GPU pages) to its host page (``page_table[r, t // P]``, row ``t % P``).
    ``unit_params`` per buffer: (cell_pages, tokens_per_unit, max_inflight_tokens). ``flush``
    leaves these rows alone (resolve saw them as holes, so no in-flight slot is recorded).
    Mutates ``host_pool``."""
    _ops.flush_gpu_history(host_pool, positions, spaces, gpu_rows, gpu_pages, page_table,
                           new_history, history, capacity, lease, unit_params)


def write_indices(
    out: Tensor,
    inflight_start: Tensor,
    resident: Tensor,
    inflight_slots: Tensor,
    history: Tensor,
    capacity: Tensor,
    lease: Tensor,
    tokens_per_unit: int,
    max_inflight_tokens: int,
) -> None:
    """OP-WRITE: ``out[r, j]`` = the cell token index ``entry*U + t % U`` of in-flight token
    ``t = s0 + j`` of row r (its cell is ``index // P``, its row in the cell ``index % P``), BAD
    beyond the row's in-flight range, for holes and suspended rows, and where no slot holds the
    unit. ``inflight_start[r]`` receives s0 (BAD for unseated rows). ``out`` int32[R, W] with
    ``W >= I + U - 1``. Mutates ``out`` and ``inflight_start``.
    """
    _ops.write_indices(out, inflight_start, resident, inflight_slots, history, capacity, lease,
                       tokens_per_unit, max_inflight_tokens)


def flush(
    host_pool: Tensor,
    positions: Sequence[int],
    cells: Sequence[Tensor],
    resident: Sequence[Tensor],
    inflight_slots: Sequence[Tensor],
    page_table: Tensor,
    new_history: Tensor,
    history: Tensor,
    capacity: Tensor,
    lease: Tensor,
    unit_params: Sequence[int],
) -> None:
    """OP-FLUSH for one sparse pool group, ``host_pool`` uint8[num_slots, scale, page_bytes]: per
    seated row and buffer ``b`` (at ``positions[b]`` in a slot), writes the tokens of
    ``[s0, min(new_history[r], capacity[r]))`` from their cells to their host pages (``s0`` from
    the buffer's selection group: ``unit_params[3b:3b+3]`` = slots, tokens_per_unit,
    max_inflight_tokens). Reads residency only. Mutates ``host_pool``.
    """
    _ops.flush(host_pool, list(positions), list(cells), list(resident), list(inflight_slots),
               page_table, new_history, history, capacity, lease, list(unit_params))


def flush_watermark(
    written: Tensor,
    declared: Tensor,
    new_history: Tensor,
    history: Tensor,
    capacity: Tensor,
    lease: Tensor,
    shapes: Sequence[int],
) -> None:
    """OP-FLUSH's watermark (SAFE-2), int32[rows] tensors: per seated row (``lease >= 0``),
    ``written = max(written, min(new_history, capacity))`` when every token below the in-flight
    range is on host pages already (``max(written, declared)`` at least the largest in-flight
    start over the ``(tokens_per_unit, max_inflight_tokens)`` pairs flattened in ``shapes``);
    else unchanged. Mutates ``written``.
    """
    _ops.flush_watermark(written, declared, new_history, history, capacity, lease, list(shapes))


def advance(lengths: Tensor, counters: Tensor, accepted: Tensor) -> None:
    """HOST-3, ``Batch.advance``'s device step: ``lengths`` a batch's int32[6, rows] (history,
    capacity, lease, written, declared, allocated), ``accepted`` int32[rows], ``counters``
    int64[2]. Per seated row (lease >= 0): refused (unchanged, ``counters[0] += 1``) when
    ``accepted`` is negative, exceeds the width ``capacity - history``, or would move history past
    ``written``; else history += accepted and capacity = history + width, cut at ``allocated``
    (then ``counters[1] += 1``). Mutates ``lengths`` (history and capacity) and ``counters``.
    """
    _ops.advance(lengths, counters, accepted)


def clear_leases(resident: Sequence[Tensor], recency: Sequence[Tensor], leases: Tensor) -> None:
    """BAT-3: empty residency of ``leases`` (int64[n], leases that changed owner) in every
    selection group ``g``: ``resident[g][l] = BAD`` and ``recency[g][l] = 0, 1, ..., S-1``; a
    lease outside the group's rows is skipped. Mutates ``resident`` and ``recency``."""
    _ops.clear_leases(list(resident), list(recency), leases)


def uva_view(host: Tensor, register: bool = True) -> Tensor:
    """A CUDA tensor aliasing the memory of the CPU tensor ``host`` through its device-mapped
    address. ``register=True`` registers the storage as pinned and mapped when it is not yet;
    ``register=False`` registers nothing and aliases the host address itself, for memory whose
    ranges are registered as they commit (``host_region``; needs a device whose registered
    memory's device pointer equals its host pointer, else RuntimeError). CUDA builds only;
    setup-time only.
    """
    return _ops.uva_view(host, register)


def rank_signal(header: Tensor, gen: Tensor, pools: Sequence[Tensor], rank: int,
                world: int) -> None:
    """TP-3, after this rank's flush: ``gen[0] += 1``, then ``header[16 + rank] = gen[0]`` with
    release (system-scope) ordering, so a rank that sees the counter also sees every write of
    the flush before it. ``header``: the shared rank header int64[512] (its device view on
    CUDA); ``gen``: int64[1] on the same device; ``pools``: the host pools the flush wrote
    (read: the op orders after the flush). Mutates ``header`` and ``gen``."""
    _ops.rank_signal(header, gen, list(pools), rank, world)


def rank_wait(header: Tensor, pools: Sequence[Tensor], gen: Tensor, rank: int, world: int,
              timeout_us: int) -> None:
    """TP-3/TP-4, before the next step's first fetch: returns once every rank ``r < world``
    has ``header[16 + r] >= gen[0]`` (acquire). A rank whose left flag (``header[80 + r]``) is
    set first, or no progress for ``timeout_us``, writes the header's failure record and then
    raises RuntimeError naming the rank and generation (CPU) or traps (CUDA: the context is
    lost). ``pools`` are declared written, so every later read of them (fetch) orders after
    the wait in compiled code; the op writes no byte of them. Mutates ``header``."""
    _ops.rank_wait(header, list(pools), gen, rank, world, timeout_us)


from . import fakes  # noqa: E402,F401  (registers every op's fake kernel)
