"""The reference model of GPU-resident history (docs/REQUIREMENTS.md §15f, RSD-1..3): resolve,
write indices, flush and demotion over one index space per sparse buffer (cells, then GPU history
pages), in plain Python over the base model of tests/reference.py (residency, rows, flush)."""
from __future__ import annotations

from reference import (BAD, ResidencyState, RowRange, check_res1, flush, resolve, resolve_multi,
                       write_indices)


# --------------------------------------------------------------------------------------------
# RSD: GPU-resident history, offload only under pressure (docs/REQUIREMENTS.md §15f)
# --------------------------------------------------------------------------------------------
#
# Written from docs/REQUIREMENTS.md §15f (RSD-1, RSD-2) and docs/DESIGN.md's decisions, not from kernels.
#
# Residency is per page. Each row of a selection group has a GPU history page table
# ``gpu_pages[r]``: one GPU page slot id per page ordinal of the row, BAD when that page is not
# GPU-resident. A request-level policy (all of a request's pages or none) is one use of it;
# "full", "mixed" and "none" rows all follow the one rule below.
#
# One index space per sparse buffer: the buffer's tensor holds the cells first (num_leases*S
# units: entry ``l*S + slot``, as OP-RESOLVE gives it), then ``gpu_slots`` GPU history pages,
# each laid out like a page of the buffer. GPU page slot p covers the E = P // U units
# ``num_leases*S + p*E + k`` (k in [0, E)); because S % E == 0 (CFG-3) it is exactly page
# ``num_leases*S/E + p`` of the tensor, and token t of a unit on it sits at row ``t % P``.
# The entry of unit u of row r on a GPU-resident page is therefore
#     num_leases*S + gpu_pages[r][u // E]*E + u % E
# and one index table, one attention kernel and one captured graph serve any mix of rows.
#
# Rules, per seated row and unit u ("on the GPU" = its page is GPU-resident, `gpu_page_of`):
# * resolve: a selected, selectable unit on the GPU gets its GPU entry and counts as a hit; it is
#   never admitted into cells, makes no miss and touches no slot's residency or recency. In-flight
#   units on the GPU are not admitted (their tokens are written to the GPU page). Step 0 also
#   drops from the lease's cells every unit on the GPU (such a copy is stale: the page is the
#   one place the unit is written and read), so no unit is ever both in cells and on the GPU.
#   Units not on the GPU follow OP-RESOLVE exactly; a row with no GPU page is today's row.
# * write_indices: token t of an in-flight unit on the GPU goes to token index
#   ``(GPU entry of t // U)*U + t % U`` in the same space; other tokens as OP-WRITE.
# * flush: the tokens OP-FLUSH copies (lo = s0, hi = min(new_history, c)) of a unit on the GPU
#   are copied from its GPU page; the others from cells as OP-FLUSH.
# * demote: the row's GPU pages are dropped without a byte to host (everything below the flushed
#   watermark is on host pages already); before that, the lease's cells are seeded from the GPU
#   pages device-to-device (see `demote`).
# * A page marked GPU-resident holds every token of it that is history (RSD-RES-3 below). So
#   tokens written straight to host pages (a long prefill's [h, s0), an import) must be written
#   to the row's GPU page as well, and a page becomes GPU-resident only when it holds all of its
#   history (a page that enters the row's capacity has none).


def gpu_page_of(gpu_row, u: int, units_per_page: int, gpu_slots: int) -> int:
    """The GPU page slot holding unit ``u`` of a row whose GPU history page table is ``gpu_row``
    (a list of slot ids per page ordinal, or None), BAD when the unit is not on the GPU: ``u``
    negative, its page ``u // E`` beyond the table, a negative id (any negative id is "no page"),
    or an id outside ``[0, gpu_slots)``.

    Decision (bad device data): an out-of-range id reads as "not resident", so the unit follows
    the cells rules, whose bytes come from the host page: it is read exactly, never out of
    bounds, and every op (resolve, write_indices, flush, demote) agrees on it."""
    if u < 0 or gpu_row is None:
        return BAD
    page = u // units_per_page
    if page >= len(gpu_row):
        return BAD
    slot = gpu_row[page]
    if slot < 0 or slot >= gpu_slots:
        return BAD
    return slot


def gpu_entry(num_leases: int, slots: int, gpu_page: int, units_per_page: int, u: int) -> int:
    """The entry of unit ``u`` held by GPU page slot ``gpu_page``: after the ``num_leases*S``
    cell units, ``E`` units per page: ``num_leases*S + gpu_page*E + u % E``."""
    return num_leases * slots + gpu_page * units_per_page + u % units_per_page


def _gpu_row(gpu_pages, r):
    return gpu_pages[r] if gpu_pages is not None and r < len(gpu_pages) else None


def resolve_resident(state: ResidencyState, selected, history, capacity, lease, U, P, I,
                     gpu_pages, gpu_slots, window=0, sinks=0):
    """OP-RESOLVE with GPU-resident history (RSD-1). ``gpu_pages`` one GPU history page table per
    row (a list of page slot ids, BAD = not resident; a missing or empty row has none);
    ``gpu_slots`` the number of GPU page slots. Mutates ``state``; returns ``(index_table,
    misses, deltas)`` exactly as ``resolve`` does.

    ``resolve`` with the units on the GPU (`gpu_page_of`) outside the lease's cells: they are
    dropped from its slots, in flight neither pinned nor admitted, selected a hit
    (``hits += 1``, once per distinct ordinal) that marks no slot, and their entry is
    ``gpu_entry`` (num_leases*S + page*E + u % E), never a cell; the recency of the slots only
    sees the units not on the GPU. A row without GPU pages gives exactly what ``resolve``
    gives. Counters stay [hits, misses, invalid]."""
    return resolve(state, selected, history, capacity, lease, U, P, I, window, sinks,
                   _outside(state.num_leases, state.slots, P // U, gpu_pages, gpu_slots))


def resolve_resident_multi(state: ResidencyState, selected, history, capacity, lease, U, P, I,
                           gpu_pages, gpu_slots, window=0, sinks=0):
    """MTP-3 with GPU-resident history: the union of a row's T' selections is resolved once by
    ``resolve_resident``; each query token's column takes the union's entry for its ordinal."""
    return resolve_multi(state, selected, history, capacity, lease, U, P, I, window, sinks,
                         _outside(state.num_leases, state.slots, P // U, gpu_pages, gpu_slots))


def _outside(num_leases: int, S: int, E: int, gpu_pages, gpu_slots: int):
    """``resolve``'s (and ``write_indices``', ``flush``'s) ``outside``: the GPU entry of row r's
    unit u when its page is on the GPU, else BAD."""
    def outside(r, u):
        page = gpu_page_of(_gpu_row(gpu_pages, r), u, E, gpu_slots)
        return BAD if page == BAD else gpu_entry(num_leases, S, page, E, u)
    return outside


def check_res_resident(state: ResidencyState, history, capacity, lease, U, P, I, gpu_pages,
                       gpu_slots, window=0, sinks=0) -> None:
    """RES-1 and RES-2 with GPU-resident history, for the state a resolve (or a demote after
    it) leaves:

    * RES-1 as ``check_res1``;
    * RES-2: every in-flight unit of a seated row is in its lease's cells or on the GPU;
    * one place: no cell of a seated row's lease holds a unit on one of the row's GPU pages."""
    check_res1(state)
    E = P // U
    for r, ell in enumerate(lease):
        if not (0 <= ell < state.num_leases):
            continue
        rng = RowRange(history[r], capacity[r], U, P, I, window, sinks)
        gpu_row = _gpu_row(gpu_pages, r)
        held = set(state.resident[ell])
        for u in rng.inflight_units():
            assert u in held or gpu_page_of(gpu_row, u, E, gpu_slots) != BAD, (
                f"RES-2: row {r} (lease {ell}) in-flight unit {u} neither in cells nor on the GPU")
        for s, u in enumerate(state.resident[ell]):
            assert u == BAD or gpu_page_of(gpu_row, u, E, gpu_slots) == BAD, (
                f"one place: row {r} (lease {ell}) slot {s} holds unit {u}, which is on GPU page "
                f"{gpu_page_of(gpu_row, u, E, gpu_slots)}")


def check_index_space(index_table, selected, history, capacity, lease, U, P, I, num_leases, S,
                      gpu_pages, gpu_slots, window=0, sinks=0) -> None:
    """The index table of ``resolve_resident`` reads each selected unit from one place: a
    selectable unit on the GPU has exactly its GPU entry; any other non-BAD entry is a cell of
    the row's own lease (``[l*S, l*S + S)``); padding, unselectable ordinals and unseated rows
    are BAD; one ordinal has one entry per row."""
    E = P // U
    for r, (sel_row, line) in enumerate(zip(selected, index_table)):
        ell = lease[r]
        if not (0 <= ell < num_leases):
            assert all(e == BAD for e in line), f"row {r}: unseated row with entries {line}"
            continue
        rng = RowRange(history[r], capacity[r], U, P, I, window, sinks)
        gpu_row = _gpu_row(gpu_pages, r)
        entry_of = {}
        for u, e in zip(sel_row, line):
            if u < 0 or not rng.selectable(u):
                assert e == BAD, f"row {r}: ordinal {u} is not selectable but has entry {e}"
                continue
            page = gpu_page_of(gpu_row, u, E, gpu_slots)
            if page != BAD:
                assert e == gpu_entry(num_leases, S, page, E, u), (
                    f"row {r}: unit {u} on GPU page {page} has entry {e}")
            else:
                assert e == BAD or ell * S <= e < ell * S + S, (
                    f"row {r}: unit {u} (not on the GPU) has entry {e} outside lease {ell}'s cells")
            assert entry_of.setdefault(u, e) == e, f"row {r}: unit {u} has two entries"


def write_indices_resident(resident, inflight_slots, history, capacity, lease, U, I, width, P,
                           gpu_pages, gpu_slots):
    """OP-WRITE with GPU-resident history: as ``write_indices``, except that token ``t = s0 + j``
    (``t < c``) of a unit on the GPU goes to ``(gpu_entry(num_leases, S, page, E, t // U))*U +
    t % U``, with ``num_leases = len(resident)``, whatever ``inflight_slots`` records for it.
    Returns ``(out, inflight_start)``."""
    S = len(resident[0]) if resident else 0
    return write_indices(resident, inflight_slots, history, capacity, lease, U, I, width,
                         _outside(len(resident), S, P // U, gpu_pages, gpu_slots))


def _copy_token_rows(src_page, src_row, dst_page, dst_row, count, bpc):
    """Copies ``count`` token rows, chunk by chunk, between two pages (lists of chunk
    bytearrays)."""
    for ch in range(len(src_page)):
        src, dst = src_page[ch], dst_page[ch]
        dst[dst_row * bpc:(dst_row + count) * bpc] = src[src_row * bpc:(src_row + count) * bpc]


def flush_resident(host_pages, spaces, resident, inflight_slots, page_table, new_history, history,
                   capacity, lease, unit_params, gpu_pages, gpu_slots):
    """OP-FLUSH with GPU-resident history. As ``flush``, with ``spaces[b]`` the buffer's whole
    index space (a CellList of ``num_leases*S/E`` cells then ``gpu_slots[b]`` GPU pages),
    ``gpu_pages[b]`` the GPU history page tables (per row) of the buffer's selection group and
    ``gpu_slots[b]`` their number of page slots.

    The tokens copied per row are the same: for unit u, ``[max(lo, uU), min(hi, (u+1)U))`` with
    ``lo = s0``, ``hi = min(new_history, c)``, to the host page ``page_table[r][u // E]`` (when it
    exists and is in range). A unit on the GPU is copied from its GPU page (page
    ``num_leases*S/E + gpu page``, token row ``t % P``); any other unit as ``flush`` does, from its
    confirmed cell. Returns the ``(b, r, u, host_slot, first_token, end_token)`` copies made."""
    outside = [_outside(len(resident[b]), unit_params[3 * b], space.tokens_per_page //
                        unit_params[3 * b + 1], gpu_pages[b], gpu_slots[b])
               for b, space in enumerate(spaces)]
    return flush(host_pages, spaces, resident, inflight_slots, page_table, new_history, history,
                 capacity, lease, unit_params, outside)


def demote(state: ResidencyState, spaces, gpu_pages, gpu_slots, row, history, capacity, lease,
           U, P, I, window=0, sinks=0):
    """RSD-2: demote row ``row`` from GPU-resident history to cells. Mutates ``state`` (the
    lease's resident and recency), the cells of every buffer in ``spaces`` (each the buffer's
    index space, as ``flush_resident`` takes it; may be empty for a state-only model) and
    ``gpu_pages[row]``; returns the seeds ``[(unit, slot), ...]`` in the order they were made.

    For a seated row (lease in range), with its published lengths:
    a. every slot holding a unit on the row's GPU pages is emptied (such a copy is stale);
    b. seeds, device to device from the GPU pages, at most S in all: first every in-flight unit on
       the GPU, ascending (mandatory when the step's tokens were written to the GPU page and not
       flushed yet); then the fully written history units (``(u+1)U <= h``), selectable and on
       the GPU, newest first;
    c. each seed takes a victim as a miss of ``resolve`` does: empty slots in recency order, then
       slots that hold no in-flight unit, least recent first; a slot seeded in this call is never
       a victim; seeding stops when no victim is left;
    d. the seed's whole unit (U token rows of every chunk) is copied from its GPU entry to
       the cell entry ``l*S + slot`` in every buffer; ``resident[slot] = unit``;
    e. recency: the slots not seeded keep their order, then the seeded slots by ascending unit,
       so the newest seeded unit is the most recently used.
    Then, seated or not, ``gpu_pages[row]`` becomes all BAD: the pages are freed (the caller
    returns them to its pool) and no byte goes to host, since every token below the flushed
    watermark is on host pages already."""
    E = P // U
    gpu_row = gpu_pages[row]
    ell = lease[row]
    seeds = []
    if 0 <= ell < state.num_leases:
        S = state.slots
        rng = RowRange(history[row], capacity[row], U, P, I, window, sinks)
        resident, recency = state.resident[ell], state.recency[ell]

        def on_gpu(u):
            return gpu_page_of(gpu_row, u, E, gpu_slots)

        for s in range(S):  # a.
            if resident[s] != BAD and on_gpu(resident[s]) != BAD:
                resident[s] = BAD
        wanted = [u for u in rng.inflight_units() if on_gpu(u) != BAD]  # b.
        u = rng.h // U - 1
        while u >= 0 and len(wanted) < S:
            if rng.selectable(u) and on_gpu(u) != BAD:
                wanted.append(u)
            u -= 1
        wanted = wanted[:S]
        victims = [s for s in recency if resident[s] == BAD]  # c.
        victims += [s for s in recency if resident[s] != BAD and not rng.in_flight(resident[s])]
        for u in wanted:
            if not victims:
                break
            s = victims.pop(0)
            src = gpu_entry(state.num_leases, S, on_gpu(u), E, u)
            dst = ell * S + s
            for space in spaces:  # d.
                _copy_unit(space, src, dst, U)
            resident[s] = u
            seeds.append((u, s))
        seeded = {s for _, s in seeds}  # e.
        state.recency[ell] = ([s for s in recency if s not in seeded]
                              + [s for _, s in sorted(seeds)])
    for p in range(len(gpu_row)):
        gpu_row[p] = BAD
    return seeds


def _copy_unit(space, src_entry: int, dst_entry: int, U: int) -> None:
    """Copies one unit (U token rows of every chunk) between two entries of an index space."""
    if not space or not space[0] or len(space[0][0]) == 0:
        return  # zero-size buffer (CFG-6)
    P = space.tokens_per_page
    E = P // U
    bpc = len(space[0][0]) // P
    (src_cell, src_piece), (dst_cell, dst_piece) = divmod(src_entry, E), divmod(dst_entry, E)
    if src_cell >= len(space) or dst_cell >= len(space):
        return
    _copy_token_rows(space[src_cell], src_piece * U, space[dst_cell], dst_piece * U, U, bpc)


def unit_bytes(space, entry: int, U: int, first_token: int = 0, end_token: int = None) -> list:
    """What an attention kernel reads at ``entry`` of an index space: per chunk, the bytes of the
    unit's token rows ``[first_token, end_token)`` (offsets inside the unit, default all U)."""
    P = space.tokens_per_page
    E = P // U
    end_token = U if end_token is None else end_token
    bpc = len(space[0][0]) // P
    cell, piece = divmod(entry, E)
    r0, r1 = piece * U + first_token, piece * U + end_token
    return [bytes(chunk[r0 * bpc:r1 * bpc]) for chunk in space[cell]]
