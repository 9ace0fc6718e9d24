"""A slow, plain-Python reference model of torch_kvcm2's per-step ops.

Written from docs/REQUIREMENTS.md (§2, §7, §8 OP-RESOLVE / OP-FETCH / OP-INDEX) and docs/DESIGN.md ("Residency:
the exact semantics of resolve", "Index conversion"), not from the C++ kernels. Everything here
works on Python ints, lists and bytearrays; tensors only appear in the small conversion helpers at
the bottom. Integers are unbounded, so every overflow rule ("results above INT32_MAX are BAD") is
checked explicitly. GPU-resident history's rules (RSD) build on it in tests/reference_resident.py.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field

BAD = -1
INT32_MAX = 2**31 - 1


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _as_int32_or_bad(value: int) -> int:
    """DESIGN 'Index conversion': results above INT32_MAX are BAD, never wrapped."""
    if value < 0 or value > INT32_MAX:
        return BAD
    return value


# --------------------------------------------------------------------------------------------
# OP-INDEX
# --------------------------------------------------------------------------------------------


def convert_page_indices(page_table, capacity, scale, pos, units_per_page, tokens_per_unit, width):
    """OP-INDEX, page form. ``page_table`` a list of rows of slot ids, ``capacity`` one int per row.

    ``out[r][j] = (slot*scale + pos)*E + j % E`` with ``slot = page_table[r][j // E]`` when the
    page exists in the table, ``j*U < capacity[r]`` and the slot is not BAD; else BAD. Returns
    ``len(page_table)`` rows of ``width`` ints.
    """
    E, U = units_per_page, tokens_per_unit
    out = []
    for r, row in enumerate(page_table):
        cap = capacity[r]
        line = []
        for j in range(width):
            page = j // E
            if page >= len(row) or j * U >= cap:
                line.append(BAD)
                continue
            slot = row[page]
            if slot < 0:  # BAD (any negative slot id is "no page")
                line.append(BAD)
                continue
            line.append(_as_int32_or_bad((slot * scale + pos) * E + j % E))
        out.append(line)
    return out


def convert_token_indices(selected, page_table, capacity, scale, pos, tokens_per_page):
    """OP-INDEX, token form: ``out[r][j] = (page_table[r][t // P]*scale + pos)*P + t % P`` for
    ``t = selected[r][j]``; BAD for ``t < 0``, ``t >= capacity[r]``, a page beyond the table or a
    BAD slot."""
    P = tokens_per_page
    out = []
    for r, sel_row in enumerate(selected):
        table_row = page_table[r]
        cap = capacity[r]
        line = []
        for t in sel_row:
            if t < 0 or t >= cap or t // P >= len(table_row):
                line.append(BAD)
                continue
            slot = table_row[t // P]
            if slot < 0:
                line.append(BAD)
                continue
            line.append(_as_int32_or_bad((slot * scale + pos) * P + t % P))
        out.append(line)
    return out


# --------------------------------------------------------------------------------------------
# OP-RESOLVE
# --------------------------------------------------------------------------------------------


@dataclass
class ResidencyState:
    """One selection group's residency: per lease the unit in each slot (-1 empty) and the
    slots from least to most recently used; and the cumulative counters [hits, misses, invalid]."""

    resident: list  # list[num_leases] of list[S]
    recency: list  # list[num_leases] of list[S]
    counters: list = field(default_factory=lambda: [0, 0, 0])

    @classmethod
    def fresh(cls, num_leases: int, slots: int) -> "ResidencyState":
        return cls(
            resident=[[BAD] * slots for _ in range(num_leases)],
            recency=[list(range(slots)) for _ in range(num_leases)],
            counters=[0, 0, 0],
        )

    @property
    def num_leases(self) -> int:
        return len(self.resident)

    @property
    def slots(self) -> int:
        return len(self.resident[0]) if self.resident else 0

    def clone(self) -> "ResidencyState":
        return copy.deepcopy(self)


@dataclass(frozen=True)
class RowRange:
    """What one row may select, from its published history h and capacity c (REQUIREMENTS §2, §8)."""

    h: int
    c: int
    U: int
    P: int
    I: int
    window: int
    sinks: int = 0  # tokens a windowed row keeps at the start (TIER-3)

    def __post_init__(self):
        # DESIGN: lengths are device data; a negative history or a capacity below it (bad data)
        # reads as h = max(h, 0), c = max(c, h): no negative unit is ever in flight.
        object.__setattr__(self, "h", max(self.h, 0))
        object.__setattr__(self, "c", max(self.c, self.h))

    @property
    def s0(self) -> int:
        # s0 = max(h, floor((c - I)/U)*U); Python's // is floor division.
        return max(self.h, ((self.c - self.I) // self.U) * self.U)

    def inflight_units(self) -> list:
        """Units overlapping [s0, c), ascending; none when s0 >= c."""
        s0, c, U = self.s0, self.c, self.U
        if s0 >= c:
            return []
        return list(range(s0 // U, ceil_div(c, U)))

    def in_flight(self, u: int) -> bool:
        s0, c, U = self.s0, self.c, self.U
        # unit u covers [u*U, (u+1)*U); it overlaps [s0, c) iff u*U < c and (u+1)*U > s0
        return s0 < c and u * self.U < c and (u + 1) * U > s0

    def on_live_page(self, u: int) -> bool:
        """DESIGN decision (windowed sparse layers): pages p < floor((h - window)/P) are gone,
        except the sink pages, p < ceil(sinks/P), which stay (TIER-3)."""
        if self.window <= 0:
            return True
        page = u // (self.P // self.U)
        if page * self.P < self.sinks:  # the page holds a sink token
            return True
        first_live_page = (self.h - self.window) // self.P
        return page >= first_live_page

    def selectable(self, u: int) -> bool:
        if u < 0 or not self.on_live_page(u):
            return False
        return (u + 1) * self.U <= self.h or self.in_flight(u)


def resolve(state: ResidencyState, selected, history, capacity, lease, U, P, I, window=0,
            sinks=0, outside=None):
    """OP-RESOLVE for one selection group over every row, following DESIGN.md step by step.

    Mutates ``state`` (resident, recency, counters). Returns ``(index_table, misses, deltas)``:
    ``index_table`` one list of K ints per row; ``misses`` the miss-list entries as tuples
    ``(lease, slot, row, unit)`` (in the order this model produces them; the op's order may
    differ, compare sorted); ``deltas`` ``[hits, misses, invalid]`` added this call.

    ``outside(r, u)``, when given, is the entry of row r's unit u in the index space when the
    unit lives outside the lease's cells (on a GPU history page, tests/reference_resident.py),
    else BAD. Such a unit is dropped from the cells (step 0), neither pinned nor admitted when
    in flight (step 1), a hit that marks no slot when selected (step 2), and gets that entry
    (step 5); steps 3 and 4 only see the units in cells.
    """
    if outside is None:
        def outside(r, u):
            return BAD
    num_leases = state.num_leases
    S = state.slots
    index_table = []
    misses = []
    deltas = [0, 0, 0]
    for r, sel_row in enumerate(selected):
        K = len(sel_row)
        ell = lease[r]
        if not (0 <= ell < num_leases):
            # a hole, a suspended row or bad data: only the index-table row is written (RES-4)
            index_table.append([BAD] * K)
            continue
        rng = RowRange(history[r], capacity[r], U, P, I, window, sinks)
        resident = state.resident[ell]
        recency = state.recency[ell]

        # step 0: drop resident units that are no longer selectable, or that live outside
        for s in range(S):
            u = resident[s]
            if u != BAD and (not rng.selectable(u) or outside(r, u) != BAD):
                resident[s] = BAD
        # unit -> slot; a unit resident twice (bad data, RES-1 broken) maps to its lowest slot
        slot_of = {}
        for s, u in enumerate(resident):
            if u != BAD:
                slot_of.setdefault(u, s)

        # step 1: in-flight units already resident are pinned, the others are admissions
        pinned_slots = set()
        admissions = []
        for u in rng.inflight_units():
            if outside(r, u) != BAD:
                continue  # written where it lives
            if u in slot_of:
                pinned_slots.add(slot_of[u])
            else:
                admissions.append(u)
        admission_set = set(admissions)

        # step 2: classify distinct selected ordinals in first-occurrence order
        hit_slots = set()
        selected_set = set()  # distinct selectable ordinals selected this step
        row_misses = []
        seen = set()
        for u in sel_row:
            if u in seen:
                continue
            seen.add(u)
            if u < 0:
                continue  # padding: BAD, uncounted
            if not rng.selectable(u):
                deltas[2] += 1
                continue
            if outside(r, u) != BAD:
                deltas[0] += 1  # read where it lives: no slot, no recency, no miss
                continue
            selected_set.add(u)
            if u in slot_of:
                deltas[0] += 1
                hit_slots.add(slot_of[u])
            elif u in admission_set:
                deltas[0] += 1  # admitted in step 1, never fetched for the selection
            else:
                row_misses.append(u)

        # step 3: victims — empty slots in recency order, then slots neither hit nor pinned
        victims = [s for s in recency if resident[s] == BAD]
        victims += [s for s in recency
                    if resident[s] != BAD and s not in hit_slots and s not in pinned_slots]
        victims.reverse()  # pop() from the end takes them in order
        miss_slots = set()
        admitted_slots = set()
        for u in admissions:
            if not victims:
                deltas[2] += 1
                continue
            s = victims.pop()
            old = resident[s]
            if old != BAD:
                # forgets the unit even when this was not the slot that served it (bad data)
                slot_of.pop(old, None)
            resident[s] = u
            slot_of[u] = s
            admitted_slots.add(s)
            if u * U < rng.h:  # a partly written head unit: its history part is fetched
                misses.append((ell, s, r, u))
        for u in row_misses:
            if not victims:
                deltas[2] += 1
                continue
            s = victims.pop()
            old = resident[s]
            if old != BAD:
                # forgets the unit even when this was not the slot that served it (bad data)
                slot_of.pop(old, None)
            resident[s] = u
            slot_of[u] = s
            miss_slots.add(s)
            deltas[1] += 1
            misses.append((ell, s, r, u))

        # step 4: new recency = stable partition of the old one: untouched, misses, pinned, hits
        # A hit is the slot that serves a selected unit (the one step 5 gives it). With sane
        # data that is every slot holding a selected unit; a unit resident twice (bad data) is
        # served by one slot, or by none once the reuse of its other slot forgot it.
        served = {slot_of[u] for u in selected_set if u in slot_of}

        def slot_class(s):
            if s in miss_slots:
                return 1
            if s in served:
                return 3  # hit: serves a unit selected this step and is not a miss
            if s in pinned_slots or s in admitted_slots:
                return 2  # pinned: holds an in-flight unit that was not selected
            return 0
        classes = {s: slot_class(s) for s in recency}
        state.recency[ell] = [s for k in range(4) for s in recency if classes[s] == k]

        # step 5: the index table
        line = []
        for u in sel_row:
            if u < 0 or not rng.selectable(u):
                line.append(BAD)
            elif outside(r, u) != BAD:
                line.append(outside(r, u))
            else:
                line.append(ell * S + slot_of[u] if u in slot_of else BAD)
        index_table.append(line)

    for k in range(3):
        state.counters[k] += deltas[k]
    return index_table, misses, deltas


def check_res1(state: ResidencyState, allow_negative_units: bool = False) -> None:
    """RES-1: no ordinal twice in one lease's resident; recency is a permutation of 0..S-1.

    Also (stricter than RES-1's wording) no slot holds a negative ordinal other than BAD, unless
    ``allow_negative_units`` (for bad device data such as a negative history)."""
    for ell, (resident, recency) in enumerate(zip(state.resident, state.recency)):
        units = [u for u in resident if u >= 0 or (u != BAD and not allow_negative_units)]
        assert len(units) == len(set(units)), f"RES-1: lease {ell} holds a unit twice: {resident}"
        assert allow_negative_units or all(u >= 0 for u in units), (
            f"RES-1: lease {ell} holds a negative unit: {resident}")
        assert sorted(recency) == list(range(len(resident))), (
            f"RES-1: lease {ell} recency is not a permutation: {recency}")


def check_res2(state: ResidencyState, history, capacity, lease, U, P, I, window=0,
               sinks=0) -> None:
    """RES-2: after a resolve, every in-flight unit of every seated row is resident."""
    for r, ell in enumerate(lease):
        if not (0 <= ell < state.num_leases):
            continue
        rng = RowRange(history[r], capacity[r], U, P, I, window, sinks)
        held = set(state.resident[ell])
        for u in rng.inflight_units():
            assert u in held, f"RES-2: row {r} (lease {ell}) in-flight unit {u} not resident"


# --------------------------------------------------------------------------------------------
# OP-FETCH
# --------------------------------------------------------------------------------------------


def fetch(cells, host_pages, page_tables, misses, slots, U):
    """OP-FETCH on plain data. Per buffer ``b``:

    * ``cells[b]``: a ``CellList`` of cells, each a list of ``chunks`` bytearrays of ``P*bpc``
      bytes (``bpc`` = bytes per token per chunk); mutated.
    * ``host_pages[b]``: a list of host pages indexed by host slot id, same layout (read only).
    * ``page_tables[b]``: list of rows of host slot ids.

    ``misses`` is the list of ``(lease, slot, row, unit)`` entries to copy. Entries with bad values
    (row, unit, host page or entry out of range, BAD page) are skipped. Returns the number of
    (entry, buffer) copies made.
    """
    copies = 0
    for b in range(len(cells)):
        cell_list, pages, table = cells[b], host_pages[b], page_tables[b]
        if not cell_list or not pages:
            continue
        chunks = len(cell_list[0])
        chunk_bytes = len(cell_list[0][0]) if chunks else 0
        if chunk_bytes == 0:
            continue  # zero-size buffer (CFG-6)
        P = cell_list.tokens_per_page  # not visible in the bytes alone: a CellList carries it
        bpc = chunk_bytes // P
        E = P // U
        piece = U * bpc
        for (ell, slot, row, unit) in misses:
            if ell < 0 or slot < 0 or slot >= slots or row < 0 or unit < 0:
                continue
            entry = ell * slots + slot
            cell_idx, cell_piece = divmod(entry, E)
            if cell_idx >= len(cell_list):
                continue
            if row >= len(table) or unit // E >= len(table[row]):
                continue
            host = table[row][unit // E]
            if host < 0 or host >= len(pages):
                continue
            src_piece = unit % E
            for k in range(chunks):
                src = pages[host][k][src_piece * piece:(src_piece + 1) * piece]
                cell_list[cell_idx][k][cell_piece * piece:(cell_piece + 1) * piece] = src
            copies += 1
    return copies


class CellList(list):
    """A list of pages (each a list of per-chunk bytearrays) that remembers tokens_per_page."""

    def __init__(self, pages, tokens_per_page):
        super().__init__(pages)
        self.tokens_per_page = tokens_per_page


# --------------------------------------------------------------------------------------------
# tensor <-> plain data helpers (used by the tests; kept dumb on purpose)
# --------------------------------------------------------------------------------------------


def pages_from_tensor(t) -> CellList:
    """``uint8[n, chunks, P, bpc]`` (any strides) -> CellList of n pages of chunk bytearrays."""
    n, chunks, P, bpc = t.shape
    data = t.detach().cpu()
    pages = []
    for i in range(n):
        pages.append([bytearray(data[i, k].contiguous().numpy().tobytes()) for k in range(chunks)])
    return CellList(pages, P)


def pages_to_bytes(pages) -> bytes:
    return b"".join(bytes(chunk) for page in pages for chunk in page)


def tensor_bytes(t) -> bytes:
    return t.detach().cpu().contiguous().numpy().tobytes()


def state_from_tensors(resident, recency, counters) -> ResidencyState:
    return ResidencyState(resident.tolist(), recency.tolist(), counters.tolist())


# --------------------------------------------------------------------------------------------
# OP-WRITE / OP-FLUSH: in-flight slots, write indices, write-back
# --------------------------------------------------------------------------------------------
#
# Written from docs/REQUIREMENTS.md §2 (in-flight range s0, BAD), §8 OP-WRITE / OP-FLUSH, §9 SAFE and
# docs/DESIGN.md "Writes, write-back and the prefill path". In-flight unit k of a row is unit
# floor(s0/U) + k; its slot is recorded by `locate_inflight` in column k of `inflight_slots`
# (int32[R, ceil(I/U) + 1]) and confirmed against `resident` by write_indices and flush.


def max_inflight_units(I: int, U: int) -> int:
    """Columns of ``inflight_slots``: the most units an in-flight range can overlap (CFG-3)."""
    return ceil_div(I, U) + 1


def _row_range(h: int, c: int, U: int, I: int) -> RowRange:
    # P only matters for windows (not used by the write-back ops): any multiple of U will do.
    return RowRange(h, c, U, U, I, 0)


def _confirmed_slot(resident_row, slot: int, unit: int) -> bool:
    """A recorded slot is used only when it is in range and really holds ``unit``."""
    return 0 <= slot < len(resident_row) and resident_row[slot] == unit


def locate_inflight(resident, history, capacity, lease, U, I):
    """``inflight_slots[r][k]`` = the slot of lease ``lease[r]`` holding in-flight unit
    ``floor(s0/U) + k`` of row r, BAD when that unit is not in flight or not resident; a whole
    BAD row for unseated rows (lease outside ``[0, len(resident))``).

    ``resident`` is a list of per-lease lists of S unit ordinals. When a unit is held by several
    slots (bad data breaking RES-1) this model answers the lowest one; tests compare only cases
    without duplicates."""
    width = max_inflight_units(I, U)
    out = []
    for r, ell in enumerate(lease):
        if not (0 <= ell < len(resident)):
            out.append([BAD] * width)
            continue
        rng = _row_range(history[r], capacity[r], U, I)
        held = resident[ell]
        first = rng.s0 // U
        line = []
        for k in range(width):
            u = first + k
            if rng.in_flight(u) and u in held:
                line.append(held.index(u))
            else:
                line.append(BAD)
        out.append(line)
    return out


def write_indices(resident, inflight_slots, history, capacity, lease, U, I, width, outside=None):
    """OP-WRITE. Returns ``(out, inflight_start)``: ``out`` R rows of ``width`` ints, column j
    the cell token index ``(l*S + slot)*U + t % U`` of token ``t = s0 + j`` when ``t < c`` and
    the recorded slot of its unit (column ``t//U - floor(s0/U)`` of ``inflight_slots``) is in
    range and holds that unit; BAD otherwise. ``inflight_start[r]`` = s0 (with the bad-length
    clamp), BAD for unseated rows (whose ``out`` rows are all BAD). ``outside`` as ``resolve``
    takes it: a unit that lives outside the cells has its tokens at ``entry*U + t % U``,
    whatever ``inflight_slots`` records for it."""
    out, start = [], []
    for r, ell in enumerate(lease):
        if not (0 <= ell < len(resident)):
            out.append([BAD] * width)
            start.append(BAD)
            continue
        rng = _row_range(history[r], capacity[r], U, I)
        S = len(resident[ell])
        s0, c = rng.s0, rng.c
        start.append(s0)
        first = s0 // U
        line = []
        for j in range(width):
            t = s0 + j
            if t >= c:
                line.append(BAD)
                continue
            entry = outside(r, t // U) if outside else BAD
            if entry != BAD:
                line.append(_as_int32_or_bad(entry * U + t % U))
                continue
            k = t // U - first
            slot = inflight_slots[r][k] if k < len(inflight_slots[r]) else BAD
            if not _confirmed_slot(resident[ell], slot, t // U):
                line.append(BAD)
                continue
            line.append(_as_int32_or_bad((ell * S + slot) * U + t % U))
        out.append(line)
    return out, start


def flush(host_pages, cells, resident, inflight_slots, page_table, new_history, history, capacity,
          lease, unit_params, outside=None):
    """OP-FLUSH for one sparse pool group, on plain data. Per buffer ``b``:

    * ``host_pages[b]``: a CellList of host pages indexed by host slot id (each a list of
      ``chunks`` bytearrays of ``P*bpc`` bytes); mutated;
    * ``cells[b]``: a CellList of cells, same layout (read only);
    * ``resident[b]`` per-lease lists of S ordinals, ``inflight_slots[b]`` per-row lists;
    * ``unit_params[3b:3b+3]`` = (S, U, I).

    ``page_table`` (rows of host slot ids), ``new_history``, ``history``, ``capacity`` and
    ``lease`` are shared. Per seated row (lease in ``[0, len(resident[b]))``) with
    ``lo = s0`` (the buffer's U, I) and ``hi = min(new_history, c)``, every unit u with
    ``floor(lo/U) <= u`` and ``u*U < hi`` whose recorded slot is confirmed against
    ``resident[b]`` and whose page ``page_table[r][u // E]`` exists, is not BAD and is below the
    number of host slots has exactly its tokens ``[max(lo, uU), min(hi, (u+1)U))`` copied, chunk
    by chunk, from cell entry ``l*S + slot`` to the host page (token row ``t % P``). Nothing else
    is written. Returns the list of ``(b, r, u, host_slot, first_token, end_token)`` copies made.
    ``outside[b]``, when given, is ``resolve``'s hook for buffer b: a unit that lives outside the
    cells is copied from that entry of ``cells[b]`` (the buffer's whole index space) instead.
    """
    copies = []
    for b in range(len(host_pages)):
        S, U, I = unit_params[3 * b:3 * b + 3]
        pages, cell_list = host_pages[b], cells[b]
        P = cell_list.tokens_per_page
        E = P // U
        chunks = len(cell_list[0]) if cell_list else 0
        chunk_bytes = len(cell_list[0][0]) if chunks else 0
        if chunk_bytes == 0:
            continue  # zero-size buffer (CFG-6): nothing to copy
        bpc = chunk_bytes // P
        for r, ell in enumerate(lease):
            if not (0 <= ell < len(resident[b])):
                continue
            rng = _row_range(history[r], capacity[r], U, I)
            lo, hi = rng.s0, min(new_history[r], rng.c)
            if lo >= hi:
                continue
            first = lo // U
            u = first
            while u * U < hi:
                entry = outside[b](r, u) if outside else BAD
                if entry == BAD:
                    k = u - first
                    slot = inflight_slots[b][r][k] if k < len(inflight_slots[b][r]) else BAD
                    if _confirmed_slot(resident[b][ell], slot, u):
                        entry = ell * S + slot
                page = u // E
                table_row = page_table[r]
                if entry != BAD and page < len(table_row) and 0 <= table_row[page] < len(pages):
                    host = table_row[page]
                    cell_idx, piece = divmod(entry, E)
                    if cell_idx < len(cell_list):
                        t0, t1 = max(lo, u * U), min(hi, (u + 1) * U)
                        for ch in range(chunks):
                            src = cell_list[cell_idx][ch]
                            dst = pages[host][ch]
                            for t in range(t0, t1):
                                row = piece * U + (t - u * U)
                                dst_row = t % P
                                dst[dst_row * bpc:(dst_row + 1) * bpc] = \
                                    src[row * bpc:(row + 1) * bpc]
                        copies.append((b, r, u, host, t0, t1))
                u += 1
    return copies


# --------------------------------------------------------------------------------------------
# MTP: multi-token steps (REQUIREMENTS §13, MTP-2 / MTP-3)
# --------------------------------------------------------------------------------------------

# Written from MTP-3 as a rule about the union, not from the kernels: a row's T' selections
# are merged into one union of distinct non-negative ordinals, ordered by first occurrence in
# (query token, column) order; that union is resolved once, exactly as a single-token selection
# (so each of its units is one hit, one miss or one invalid ordinal, in one slot); then every
# query token's column takes the union's entry for its ordinal, BAD for padding.


def selection_union(selection_rows) -> list:
    """The union of one row's query-token selections (a list of T' lists of ordinals): distinct
    ordinals >= 0 in first-occurrence order over (query token, column). Padding is left out."""
    union, seen = [], set()
    for token in selection_rows:
        for u in token:
            if u >= 0 and u not in seen:
                seen.add(u)
                union.append(u)
    return union


def resolve_multi(state: ResidencyState, selected, history, capacity, lease, U, P, I, window=0,
                  sinks=0, outside=None):
    """OP-RESOLVE for a multi-token step: ``selected`` is one list per row of T' lists of K
    ordinals (the same T' and K for every row). Mutates ``state`` like ``resolve``. Returns
    ``(index_table, misses, deltas)`` with ``index_table`` one list per row of T' lists of K
    entries; ``misses`` and ``deltas`` as ``resolve`` returns them for the unions."""
    unions = [selection_union(rows) for rows in selected]
    union_table, misses, deltas = resolve(state, unions, history, capacity, lease, U, P, I, window,
                                          sinks, outside)
    index_table = []
    for rows, union, line in zip(selected, unions, union_table):
        entry_of = dict(zip(union, line))  # empty for a hole, whose entries are all BAD
        index_table.append([[entry_of.get(u, BAD) if u >= 0 else BAD for u in token]
                            for token in rows])
    return index_table, misses, deltas


def flush_watermark(written, declared, new_history, history, capacity, lease, shapes):
    """OP-FLUSH's SAFE-2 watermark, per row, over Python ints: a seated row's tokens below
    min(new_history, capacity) are on host pages after the flush when every token below its
    in-flight range already was (flushed before, or declared written); ``shapes`` holds the
    (tokens_per_unit, max_inflight_tokens) pairs of the config's selection groups."""
    out = list(written)
    for r in range(len(written)):
        if lease[r] < 0:
            continue
        h, c = history[r], capacity[r]
        starts = [max(h, ((c - I) // U) * U) for U, I in shapes]
        if max(written[r], declared[r]) >= max([h] + starts):
            out[r] = max(written[r], min(new_history[r], c))
    return out


def advance(lengths, accepted):
    """HOST-3's length advance, over Python ints: ``lengths`` six lists (history, capacity, lease,
    written, declared, allocated), ``accepted`` one int per row. Per seated row (lease >= 0):
    refused (unchanged) when ``accepted`` is negative, exceeds the in-flight width c - h, or would
    move history past ``written``; else h += accepted and c = h + width cut at ``allocated``
    (short when cut). Returns (new history, new capacity, refused rows, short rows)."""
    h, c, lease, written, _, allocated = (list(row) for row in lengths)
    refused = short = 0
    for r, a in enumerate(accepted):
        if lease[r] < 0:
            continue
        width = c[r] - h[r]
        if a < 0 or a > width or h[r] + a > written[r]:
            refused += 1
            continue
        wanted = h[r] + a + width
        h[r], c[r] = h[r] + a, min(wanted, allocated[r])
        short += c[r] < wanted
    return h, c, refused, short
