"""Typed wrappers over ``torch.ops.torch_kvcm2.*`` and their fake (meta) kernels.

Every per-step op mutates preallocated tensors in place and returns nothing. The fakes check the
metadata the native checks check (so a compile-time error reads like the eager one) and return
``None``. All index tensors are int32; ``BAD`` (-1) marks "no page / no entry".
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor

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
    "flush_watermark",
    "locate_inflight",
    "max_inflight_units",
    "rank_signal",
    "rank_wait",
    "resolve",
    "resolve_step",
    "uva_view",
    "write_indices",
]

_ops = torch.ops.torch_kvcm2

#: Ops used only at setup, outside compiled or captured regions; not per-step state transitions.
SETUP_OPS = frozenset({"uva_view", "host_register"})

MISS_FIELDS = 4  # (lease, slot, row, unit) per miss-list entry
NUM_COUNTERS = 3  # hits, misses, invalid
#: A selection group's miss count, int32[4]: [0] the last resolve's entries; [2:4] the CUDA
#: resolve's reservation word, zero between resolves (allocate it zeroed); [1] padding.
MISS_COUNT_WORDS = 4


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
    ``window`` is 0 for full attention. ``scratch`` (CUDA only; ignored on CPU) is uint8 of at
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
        scratch, write_table, write_start,
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
        max_inflight_tokens, window, scratch,
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


def _check(cond: bool, message: str) -> None:
    torch._check(cond, lambda: message)


@torch.library.register_fake("torch_kvcm2::convert_page_indices")
def _(out, page_table, capacity, scale, pos, units_per_page, tokens_per_unit):
    _check(out.dtype == torch.int32 and page_table.dtype == torch.int32, "int32 tensors expected")
    _check(out.dim() == 2 and page_table.dim() == 2, "out and page_table must be 2-D")
    _check(out.shape[1] >= page_table.shape[1] * units_per_page, "convert_page_indices: out is too narrow")


@torch.library.register_fake("torch_kvcm2::convert_token_indices")
def _(out, selected, page_table, capacity, scale, pos, tokens_per_page):
    _check(out.shape == selected.shape, "convert_token_indices: out and selected differ in shape")


@torch.library.register_fake("torch_kvcm2::resolve")
def _fake_resolve(resident, recency, index_table, miss_list, miss_count, counters,
                  inflight_slots, selected, history, capacity, lease, tokens_per_unit,
                  tokens_per_page, max_inflight_tokens, window, scratch=None, write_table=None,
                  write_start=None):
    for name, t in (("selected", selected), ("index_table", index_table)):
        _check(t.dtype == torch.int32, f"resolve: {name} must be int32, got {t.dtype}")
        _check(t.dim() in (2, 3), f"resolve: {name} must be 2-D [rows, K] or 3-D "
               f"[rows, query tokens, K], got {t.dim()}-D")
    _check(index_table.shape == selected.shape, "resolve: index_table and selected differ in shape")
    _check(selected.dim() == 2 or selected.shape[1] >= 1,
           "resolve: selected must have at least one query token")
    width = selected.shape[1] * (selected.shape[2] if selected.dim() == 3 else 1)
    _check(miss_list.dim() == 2 and miss_list.shape[0] >= selected.shape[0] * (
        width + max_inflight_units(max_inflight_tokens, tokens_per_unit)),
        "resolve: miss_list has fewer rows than rows x (query tokens x K + in-flight units)")
    _check(recency.shape == resident.shape, "resolve: recency and resident differ in shape")
    _check(miss_count.shape == (MISS_COUNT_WORDS,), "resolve: miss_count must have shape [4]")
    _check((write_table is None) == (write_start is None),
           "resolve: pass both write_table and write_start, or neither")
    if write_table is not None:
        _check(write_table.dim() >= 1 and write_table.shape[0] == selected.shape[0],
               "resolve: write_table must have one row per selected row")
        _check(write_table.shape[1] >= max_inflight_tokens + tokens_per_unit - 1,
               "resolve: write_table is too narrow")


@torch.library.register_fake("torch_kvcm2::fetch")
def _fake_fetch(cells, host_pools, positions, page_tables, miss_list, miss_count, slots,
                tokens_per_unit):
    _check(len(cells) == len(host_pools) == len(positions) == len(page_tables),
           "fetch: one entry per buffer")
    _check(miss_count.shape == (MISS_COUNT_WORDS,), "fetch: miss_count must have shape [4]")


@torch.library.register_fake("torch_kvcm2::locate_inflight")
def _(inflight_slots, resident, history, capacity, lease, tokens_per_unit, max_inflight_tokens):
    _check(inflight_slots.dim() == 2, "locate_inflight: inflight_slots must be 2-D")


@torch.library.register_fake("torch_kvcm2::write_indices")
def _fake_write_indices(out, inflight_start, resident, inflight_slots, history, capacity, lease,
                        tokens_per_unit, max_inflight_tokens):
    _check(out.shape[1] >= max_inflight_tokens + tokens_per_unit - 1, "write_indices: out is too narrow")


@torch.library.register_fake("torch_kvcm2::resolve_step")
def _(resident, recency, index_table, miss_list, miss_count, counters, inflight_slots, write_table,
      write_start, cells, selected, history, capacity, lease, host_pools, positions, page_tables,
      tokens_per_unit, tokens_per_page, max_inflight_tokens, window, scratch=None):
    _fake_resolve(resident, recency, index_table, miss_list, miss_count, counters, inflight_slots,
                  selected, history, capacity, lease, tokens_per_unit, tokens_per_page,
                  max_inflight_tokens, window, scratch, write_table, write_start)
    if cells:
        _fake_fetch(cells, host_pools, positions, page_tables, miss_list, miss_count,
                    resident.shape[1], tokens_per_unit)


@torch.library.register_fake("torch_kvcm2::flush")
def _(host_pool, positions, cells, resident, inflight_slots, page_table, new_history, history,
      capacity, lease, unit_params):
    _check(len(positions) == len(cells) == len(resident) == len(inflight_slots),
           "flush: one entry per buffer")


@torch.library.register_fake("torch_kvcm2::flush_watermark")
def _(written, declared, new_history, history, capacity, lease, shapes):
    _check(len(shapes) % 2 == 0, "flush_watermark: shapes must be (U, I) pairs")


@torch.library.register_fake("torch_kvcm2::advance")
def _(lengths, counters, accepted):
    _check(lengths.dtype == torch.int32 and lengths.dim() == 2 and lengths.shape[0] == 6,
           "advance: lengths must be int32[6, rows]")
    _check(counters.dtype == torch.int64 and counters.shape == (2,),
           "advance: counters must be int64[2]")
    _check(accepted.dtype == torch.int32 and accepted.shape == (lengths.shape[1],),
           "advance: accepted must be int32[rows]")


@torch.library.register_fake("torch_kvcm2::clear_leases")
def _(resident, recency, leases):
    _check(len(resident) == len(recency), "clear_leases: one resident and recency per group")
    _check(leases.dtype == torch.int64 and leases.dim() == 1, "clear_leases: leases must be int64[n]")


@torch.library.register_fake("torch_kvcm2::rank_signal")
def _(header, gen, pools, rank, world):
    _check(header.dtype == torch.int64 and header.shape == (512,),
           "rank_signal: header must be int64[512]")
    _check(gen.dtype == torch.int64 and gen.numel() == 1, "rank_signal: gen must be int64[1]")
    _check(0 <= rank < world <= 64, "rank_signal: rank must be in [0, world), world <= 64")


@torch.library.register_fake("torch_kvcm2::rank_wait")
def _(header, pools, gen, rank, world, timeout_us):
    _check(header.dtype == torch.int64 and header.shape == (512,),
           "rank_wait: header must be int64[512]")
    _check(gen.dtype == torch.int64 and gen.numel() == 1, "rank_wait: gen must be int64[1]")
    _check(0 <= rank < world <= 64, "rank_wait: rank must be in [0, world), world <= 64")
    _check(timeout_us > 0, "rank_wait: timeout_us must be positive")


@torch.library.register_fake("torch_kvcm2::uva_view")
def _(host, register=True):
    return torch.empty_strided(host.shape, host.stride(), dtype=host.dtype, device="cuda")
