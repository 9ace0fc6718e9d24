"""The reference model of GPU-resident history (docs/REQUIREMENTS.md §15f, RSD-1/RSD-2), on plain data.

CPU only and pure Python: no op of the extension runs here. The functions under test are
``reference_resident.resolve_resident``, ``write_indices_resident``, ``flush_resident``, ``demote`` and
their checkers; today's ``resolve``, ``write_indices``, ``flush`` and ``fetch`` are the baseline
they must equal on rows without GPU pages.

``World`` is one selection group of a small config with two sparse buffers (one token-major, one
with two chunks) in one pool group: host pages, each buffer's index space (cells, then GPU pages;
both start as random garbage so a wrong read cannot pass by luck), rows with lengths, host and GPU
page tables, and the truth: what the model wrote for every token. A step runs the documented order
(resolve, fetch, write through write_indices and the host-direct path, read, flush, advance) and
checks every byte read through the index table and every history token on host and GPU pages.
"""
from __future__ import annotations

import copy
import hashlib
import random

import pytest

import reference as ref
import reference_resident as rsd

BAD = ref.BAD

# (chunks, bytes per token per chunk) of the group's sparse buffers
BUFFERS = ((1, 3), (2, 2))


def token_bytes(seed, r, t, version):
    """What the model writes for token t of row r at step ``version``: per buffer, per chunk, a
    deterministic byte string (two worlds with the same seed write the same KV)."""
    need = sum(ch * bpc for ch, bpc in BUFFERS)
    raw = hashlib.blake2b(f"{seed}/{r}/{t}/{version}".encode(), digest_size=need).digest()
    out, at = [], 0
    for ch, bpc in BUFFERS:
        out.append(tuple(raw[at + k * bpc:at + (k + 1) * bpc] for k in range(ch)))
        at += ch * bpc
    return tuple(out)


class World:
    """One selection group on plain data. ``modes[r]`` is "full" (every page of the row on the
    GPU while GPU pages last), "none" (cells only) or "mixed" (a random subset of its pages; a
    page is decided when it enters the row's capacity, so it never misses history)."""

    def __init__(self, seed, modes, *, U=2, P=8, I=5, S=12, K=4, gpu_slots=14, max_tokens=80,
                 h0=None, window=0, sinks=0, hole=False):
        self.seed, self.rnd = seed, random.Random(seed)
        self.U, self.P, self.I, self.S, self.K = U, P, I, S, K
        self.E = P // U
        assert S % self.E == 0 and S >= K + ref.ceil_div(I, U) + 1  # CFG-3
        self.window, self.sinks = window, sinks
        self.rows = len(modes)
        self.modes = list(modes)
        self.num_leases = self.rows + 1
        self.lease = list(range(self.rows))
        if hole:  # a hole in the batch: lease -1, never touched
            self.lease[-1] = BAD
        self.gpu_slots = gpu_slots
        self.max_tokens = max_tokens
        self.max_pages = ref.ceil_div(max_tokens, P)
        self.version = 0
        host_slots = list(range(self.rows * self.max_pages + 3))
        self.rnd.shuffle(host_slots)
        self.page_table = [host_slots[r * self.max_pages:(r + 1) * self.max_pages]
                           for r in range(self.rows)]
        self.host = [self._garbage_pages(len(host_slots), ch, bpc) for ch, bpc in BUFFERS]
        self.cell_pages = self.num_leases * S // self.E
        self.spaces = [self._garbage_pages(self.cell_pages + gpu_slots, ch, bpc)
                       for ch, bpc in BUFFERS]
        self.state = ref.ResidencyState.fresh(self.num_leases, S)
        self.gpu_pages = [[BAD] * self.max_pages for _ in range(self.rows)]
        self.gpu_free = list(range(gpu_slots))
        self.rnd.shuffle(self.gpu_free)
        self.decided = [0] * self.rows  # pages whose GPU residency was decided
        self.truth = [dict() for _ in range(self.rows)]
        self.demotions = []
        self.h = [0] * self.rows
        self.c = [0] * self.rows
        for r in range(self.rows):
            h = self.rnd.randrange(0, max_tokens // 2) if h0 is None else h0[r]
            self.h[r] = h
            self.c[r] = min(h + self.rnd.randint(1, I), max_tokens)
            for t in range(h):  # imported history: written straight to host (and GPU) pages
                self.truth[r][t] = token_bytes(seed, r, t, -1)
            self._decide_pages(r, import_history=True)

    # -- storage -------------------------------------------------------------------------------

    def _garbage_pages(self, n, chunks, bpc):
        return ref.CellList([[bytearray(self.rnd.randbytes(self.P * bpc)) for _ in range(chunks)]
                             for _ in range(n)], self.P)

    def _put(self, pages, page, row, value):
        for b, (ch, bpc) in enumerate(BUFFERS):
            for k in range(ch):
                pages[b][page][k][row * bpc:(row + 1) * bpc] = value[b][k]

    def _get(self, pages, page, row):
        return tuple(tuple(bytes(pages[b][page][k][row * bpc:(row + 1) * bpc]) for k in range(ch))
                     for b, (ch, bpc) in enumerate(BUFFERS))

    def write_host_direct(self, r, t):
        """A token written straight to its host page (prefill, import): and to the row's GPU page
        when that page is resident (RSD-RES-3: a resident page holds all of its history)."""
        value = self.truth[r][t]
        self._put(self.host, self.page_table[r][t // self.P], t % self.P, value)
        p = rsd.gpu_page_of(self.gpu_pages[r], t // self.U, self.E, self.gpu_slots)
        if p != BAD:
            self._put(self.spaces, self.cell_pages + p, t % self.P, value)

    def _decide_pages(self, r, import_history=False):
        """Pages that entered the row's capacity get their GPU residency now. A "full" row that
        finds no free GPU page is demoted (pressure); "mixed" takes a page with probability 1/2."""
        want = ref.ceil_div(self.c[r], self.P)
        while self.decided[r] < want:
            page = self.decided[r]
            self.decided[r] += 1
            mode = self.modes[r]
            take = mode == "full" or (mode == "mixed" and self.rnd.random() < 0.5)
            if take and not self.gpu_free:
                if mode == "full":
                    self.demote(r)
                take = False
            if take:
                self.gpu_pages[r][page] = self.gpu_free.pop()
        if import_history:
            for t in range(self.h[r]):
                self.write_host_direct(r, t)

    def demote(self, r):
        """RSD-2 through the reference; the row's pages go back to the free list."""
        freed = [p for p in self.gpu_pages[r] if p != BAD]
        seeds = rsd.demote(self.state, self.spaces, self.gpu_pages, self.gpu_slots, r, self.h,
                           self.c, self.lease, self.U, self.P, self.I, self.window, self.sinks)
        self.gpu_free.extend(freed)
        self.modes[r] = "none"
        self.demotions.append((r, seeds))
        return seeds

    # -- one step ------------------------------------------------------------------------------

    def rng(self, r):
        return ref.RowRange(self.h[r], self.c[r], self.U, self.P, self.I, self.window, self.sinks)

    def random_selection(self, r):
        """K ordinals: mostly selectable units, some padding, duplicates and invalid ordinals."""
        top = ref.ceil_div(self.c[r], self.U) + 2
        sel = []
        for _ in range(self.K):
            x = self.rnd.random()
            if x < 0.1:
                sel.append(-1)
            elif x < 0.2 and sel:
                sel.append(self.rnd.choice(sel))
            elif x < 0.5:  # recent units, as decoding picks them
                sel.append(max(0, top - 3 - self.rnd.randrange(6)))
            else:
                sel.append(self.rnd.randrange(top))
        return sel

    def resolve(self, selected):
        index, misses, deltas = rsd.resolve_resident(
            self.state, selected, self.h, self.c, self.lease, self.U, self.P, self.I,
            self.gpu_pages, self.gpu_slots, self.window, self.sinks)
        rsd.check_res_resident(self.state, self.h, self.c, self.lease, self.U, self.P, self.I,
                               self.gpu_pages, self.gpu_slots, self.window, self.sinks)
        rsd.check_index_space(index, selected, self.h, self.c, self.lease, self.U, self.P,
                              self.I, self.num_leases, self.S, self.gpu_pages, self.gpu_slots,
                              self.window, self.sinks)
        ref.fetch(self.spaces, self.host, [self.page_table] * len(BUFFERS), misses, self.S,
                  self.U)
        return index, misses, deltas

    def write(self):
        """The step's writes: [s0, c) through write_indices (cells or GPU pages), [h, s0) straight
        to host (and GPU) pages. Every in-flight token must have a place."""
        self.version += 1
        located = ref.locate_inflight(self.state.resident, self.h, self.c, self.lease, self.U,
                                      self.I)
        width = self.I + self.U - 1
        out, start = rsd.write_indices_resident(self.state.resident, located, self.h, self.c,
                                                self.lease, self.U, self.I, width, self.P,
                                                self.gpu_pages, self.gpu_slots)
        for r in range(self.rows):
            if self.lease[r] < 0:
                assert all(x == BAD for x in out[r])
                continue
            s0 = start[r]
            assert s0 == self.rng(r).s0
            for t in range(self.h[r], s0):
                self.truth[r][t] = token_bytes(self.seed, r, t, self.version)
                self.write_host_direct(r, t)
            for j in range(width):
                t = s0 + j
                if t >= self.c[r]:
                    assert out[r][j] == BAD
                    continue
                idx = out[r][j]
                assert idx != BAD, f"row {r}: in-flight token {t} has no place to be written"
                self.truth[r][t] = token_bytes(self.seed, r, t, self.version)
                self._put(self.spaces, idx // self.P, idx % self.P, self.truth[r][t])
        return out

    def read(self, selected, index):
        """Reads every selected unit through the index table, as attention does, and checks it
        against the truth: tokens [uU, min((u+1)U, c)) of every selectable unit. Returns the
        bytes read per row ((ordinal, bytes) in column order)."""
        reads = []
        for r in range(self.rows):
            row = []
            if self.lease[r] < 0:
                assert all(e == BAD for e in index[r])
                reads.append(row)
                continue
            rng = self.rng(r)
            for u, e in zip(selected[r], index[r]):
                if u < 0 or not rng.selectable(u):
                    assert e == BAD
                    continue
                assert e != BAD, f"row {r}: selectable unit {u} got BAD"
                end = min(self.U, self.c[r] - u * self.U)
                got = [rsd.unit_bytes(space, e, self.U, 0, end) for space in self.spaces]
                want = [[b"".join(self.truth[r][u * self.U + i][b][k] for i in range(end))
                         for k in range(BUFFERS[b][0])] for b in range(len(BUFFERS))]
                assert got == want, f"row {r}: unit {u} read wrong bytes through entry {e}"
                row.append((u, got))
            reads.append(row)
        return reads

    def flush(self, new_history):
        located = ref.locate_inflight(self.state.resident, self.h, self.c, self.lease, self.U,
                                      self.I)
        nb = len(BUFFERS)
        return rsd.flush_resident(self.host, self.spaces, [self.state.resident] * nb,
                                  [located] * nb, self.page_table, new_history, self.h, self.c,
                                  self.lease, [self.S, self.U, self.I] * nb,
                                  [self.gpu_pages] * nb, [self.gpu_slots] * nb)

    def check_pages(self, upto):
        """Every token below ``upto[r]`` is exact on its host page, and on its GPU page when
        that page is resident (RSD-RES-3)."""
        for r in range(self.rows):
            if self.lease[r] < 0:
                continue
            for t in range(upto[r]):
                assert self._get(self.host, self.page_table[r][t // self.P], t % self.P) == \
                    self.truth[r][t], f"row {r}: host page wrong at token {t}"
                p = rsd.gpu_page_of(self.gpu_pages[r], t // self.U, self.E, self.gpu_slots)
                if p != BAD:
                    assert self._get(self.spaces, self.cell_pages + p, t % self.P) == \
                        self.truth[r][t], f"row {r}: GPU page {p} wrong at token {t}"

    def advance(self, new_history):
        for r in range(self.rows):
            if self.lease[r] < 0:
                continue
            self.h[r] = new_history[r]
            step = self.rnd.choice([1, 1, 2, 3, self.I, self.I + self.U + 1])  # decode..prefill
            self.c[r] = min(self.h[r] + step, self.max_tokens)
            self._decide_pages(r)

    def step(self, selected=None, accepted=None, demote_mid=(), demote_after=()):
        """One decoding step; ``demote_mid`` rows are demoted after the writes and before the
        flush, ``demote_after`` rows after the advance. Returns (index table, reads, deltas)."""
        if selected is None:
            selected = [self.random_selection(r) for r in range(self.rows)]
        index, misses, deltas = self.resolve(selected)
        self.write()
        reads = self.read(selected, index)
        for r in demote_mid:
            self.demote(r)
            rsd.check_res_resident(self.state, self.h, self.c, self.lease, self.U, self.P,
                                   self.I, self.gpu_pages, self.gpu_slots, self.window,
                                   self.sinks)
        if accepted is None:
            accepted = [self.rnd.randint(0, self.c[r] - self.h[r]) for r in range(self.rows)]
        new_history = [self.h[r] + accepted[r] for r in range(self.rows)]
        self.flush(new_history)
        self.check_pages(new_history)
        self.advance(new_history)
        for r in demote_after:
            self.demote(r)
            ref.check_res1(self.state)
        return index, reads, deltas

    def runnable(self):
        return any(self.h[r] < self.max_tokens - 1 for r in range(self.rows))


def nasty_lengths(rnd, U, I):
    """History and capacity pairs including bad device data (negative history, capacity below
    history) and long prefills (c - h > I)."""
    h = rnd.choice([0, 1, 5, 13, 16, 31, 40, rnd.randrange(60), -3])
    c = rnd.choice([h, h + 1, h + U, h + I, h + I + U + 2, h + 3 * I, h - 2, 0])
    return h, c


# ----------------------------------------------------------------------------------------------
# The index space
# ----------------------------------------------------------------------------------------------


def test_gpu_page_is_a_page_of_the_buffer_tensor():
    """Decision 2: with S % E == 0, GPU page slot p's units num_leases*S + p*E + k are unit k
    of page num_leases*S/E + p of the tensor, so token t of unit u of that page (token index
    entry*U + t % U) sits in that page at row t % P, like any paged KV tensor."""
    for U, P, S, leases in ((1, 4, 8, 3), (2, 8, 12, 2), (4, 16, 8, 5)):
        E = P // U
        for p in range(6):
            for u in range(3 * E):
                e = rsd.gpu_entry(leases, S, p, E, u)
                assert divmod(e, E) == (leases * S // E + p, u % E)
                for t in range(u * U, (u + 1) * U):
                    assert divmod(e * U + t % U, P) == (leases * S // E + p, t % P)


def test_gpu_page_of_reads_bad_ids_as_not_resident():
    """A unit is on the GPU only when its page is in the table with an id in [0, gpu_slots):
    negative ids, ids past the pool and pages past the table are "not resident"."""
    row = [3, BAD, -7, 9, 10]
    E = 4
    assert [rsd.gpu_page_of(row, u, E, 10) for u in (0, 3, 4, 8, 12, 15, 16, 20, -1)] == \
        [3, 3, BAD, BAD, 9, 9, BAD, BAD, BAD]
    assert rsd.gpu_page_of(None, 0, E, 10) == BAD
    assert rsd.gpu_page_of([], 0, E, 10) == BAD


# ----------------------------------------------------------------------------------------------
# Rows without GPU pages are today's rows
# ----------------------------------------------------------------------------------------------


def _no_pages_variant(rnd, rows, gpu_slots):
    """A GPU page table that puts no unit on the GPU: missing, empty, all BAD, negative or ids
    at or past the pool (bad data reads as not resident)."""
    kind = rnd.randrange(5)
    if kind == 0:
        return None
    tables = []
    for _ in range(rows):
        n = rnd.randrange(0, 12)
        tables.append([rnd.choice([BAD, -5, gpu_slots, gpu_slots + 3]) for _ in range(n)]
                      if kind > 1 else [])
    return tables


@pytest.mark.parametrize("shape", [(1, 4, 3, 8, 4), (2, 8, 5, 12, 4), (4, 8, 7, 8, 2)])
def test_rows_without_gpu_pages_equal_todays_resolve(shape):
    """Decision 3: units not on the GPU follow today's rules exactly, so a batch with no unit on
    the GPU gives what ``resolve`` gives, output for output and state for state, over random
    sequences with windows, sinks, bad lengths, padding, invalid ordinals, duplicates and holes."""
    U, P, I, S, K = shape
    rnd = random.Random(hash(shape) & 0xffff)
    for case in range(40):
        rows, leases, gpu_slots = rnd.randint(1, 4), 5, 6
        window = rnd.choice([0, 0, P, 2 * P + 3])
        sinks = rnd.choice([0, 1, P]) if window else 0
        a = ref.ResidencyState.fresh(leases, S)
        b = ref.ResidencyState.fresh(leases, S)
        for _ in range(12):
            lengths = [nasty_lengths(rnd, U, I) for _ in range(rows)]
            h, c = [x for x, _ in lengths], [y for _, y in lengths]
            lease = [rnd.choice([0, 1, 2, 3, 4, BAD, 9]) for _ in range(rows)]
            top = max(ref.ceil_div(max(x, 0), U) for x in c) + 3
            selected = [[rnd.randrange(-2, top) for _ in range(K)] for _ in range(rows)]
            tables = _no_pages_variant(rnd, rows, gpu_slots)
            want = ref.resolve(a, selected, h, c, lease, U, P, I, window, sinks)
            got = rsd.resolve_resident(b, selected, h, c, lease, U, P, I, tables, gpu_slots,
                                       window, sinks)
            assert got == want
            assert b == a


def test_rows_without_gpu_pages_in_a_mixed_batch_equal_todays_resolve():
    """Residency is data: in a batch where some rows read from GPU pages, every row without a GPU
    page gets exactly today's index row, misses and lease state (today's resolve run with the
    resident rows as holes), and the counters add up: today's counts for those rows plus what
    the resident rows count when resolved alone (rows are independent)."""
    U, P, I, S, K = 2, 8, 5, 12, 5
    rnd = random.Random(7)
    for case in range(30):
        rows, leases, gpu_slots = 4, 4, 16
        a = ref.ResidencyState.fresh(leases, S)  # today, rows with pages as holes
        b = ref.ResidencyState.fresh(leases, S)  # the whole batch
        alone = ref.ResidencyState.fresh(leases, S)  # the rows with pages alone
        resident_rows = set(rnd.sample(range(rows), 2))
        tables = [[rnd.randrange(gpu_slots) if (r in resident_rows and rnd.random() < 0.8)
                   else BAD for _ in range(12)] for r in range(rows)]
        h = [rnd.randrange(0, 40) for _ in range(rows)]
        lease = list(range(rows))
        holes = [BAD if r in resident_rows else r for r in range(rows)]
        others = [r if r in resident_rows else BAD for r in range(rows)]
        for _ in range(8):
            c = [x + rnd.randint(0, I + 3) for x in h]
            selected = [[rnd.randrange(-1, ref.ceil_div(c[r], U) + 2) for _ in range(K)]
                        for r in range(rows)]
            got_index, got_misses, got = rsd.resolve_resident(b, selected, h, c, lease, U, P, I,
                                                              tables, gpu_slots)
            want_index, want_misses, want = ref.resolve(a, selected, h, c, holes, U, P, I)
            alone_index, alone_misses, part = rsd.resolve_resident(alone, selected, h, c, others,
                                                                   U, P, I, tables, gpu_slots)
            for r in range(rows):
                mine = (alone_index, alone) if r in resident_rows else (want_index, a)
                assert got_index[r] == mine[0][r]
                assert (b.resident[r], b.recency[r]) == (mine[1].resident[r], mine[1].recency[r])
            assert sorted(got_misses) == sorted(want_misses + alone_misses)
            assert got == [x + y for x, y in zip(want, part)]
            rsd.check_res_resident(b, h, c, lease, U, P, I, tables, gpu_slots)
            rsd.check_index_space(got_index, selected, h, c, lease, U, P, I, leases, S, tables,
                                  gpu_slots)
            h = [rnd.randint(x, y) for x, y in zip(h, c)]


@pytest.mark.parametrize("U,I,S", [(1, 4, 8), (2, 5, 12), (4, 9, 8)])
def test_write_indices_and_flush_without_gpu_pages_equal_today(U, I, S):
    """Decisions 4 and 5: with no unit on the GPU, ``write_indices_resident`` is ``write_indices``
    and ``flush_resident`` copies exactly what ``flush`` copies, byte for byte (random residency,
    recorded slots, lengths including bad ones, holes)."""
    P = 8
    rnd = random.Random(U * 100 + I)
    leases, rows, gpu_slots = 3, 4, 5
    width = I + U - 1
    for case in range(30):
        resident = [[rnd.choice([BAD] + list(range(20))) for _ in range(S)]
                    for _ in range(leases)]
        lengths = [nasty_lengths(rnd, U, I) for _ in range(rows)]
        h = [min(x, 40) for x, _ in lengths]
        c = [min(y, 48) for _, y in lengths]
        lease = [rnd.choice([0, 1, 2, BAD, 7]) for _ in range(rows)]
        located = ref.locate_inflight(resident, h, c, lease, U, I)
        if case % 3 == 0:  # stale or wrong records: confirmed against resident
            located = [[rnd.choice([BAD, 0, 1, S - 1, S + 2]) for _ in line] for line in located]
        tables = _no_pages_variant(rnd, rows, gpu_slots)
        assert rsd.write_indices_resident(resident, located, h, c, lease, U, I, width, P, tables,
                                          gpu_slots) == \
            ref.write_indices(resident, located, h, c, lease, U, I, width)
        cells_n = leases * S // (P // U)
        cells = ref.CellList([[bytearray(rnd.randbytes(P * 2))] for _ in range(cells_n)], P)
        space = ref.CellList([[bytearray(x) for x in page] for page in cells]
                             + [[bytearray(rnd.randbytes(P * 2))] for _ in range(gpu_slots)], P)
        page_table = [[rnd.randrange(-1, 30) for _ in range(8)] for _ in range(rows)]
        host = ref.CellList([[bytearray(P * 2)] for _ in range(28)], P)
        host2 = copy.deepcopy(host)
        new_history = [rnd.randint(max(x, 0) - 1, max(x, y, 0) + 1) for x, y in zip(h, c)]
        want = ref.flush([host], [cells], [resident], [located], page_table, new_history, h, c,
                         lease, [S, U, I])
        got = rsd.flush_resident([host2], [space], [resident], [located], page_table,
                                 new_history, h, c, lease, [S, U, I], [tables], [gpu_slots])
        assert got == want
        assert ref.pages_to_bytes(host2) == ref.pages_to_bytes(host)


# ----------------------------------------------------------------------------------------------
# Full and mixed rows
# ----------------------------------------------------------------------------------------------


def test_fully_resident_row_hand_computed():
    """A fully resident row: every selectable unit is a hit at num_leases*S + page*E + u % E;
    no miss, no admission (its in-flight units are on the GPU), its lease's slots and recency
    untouched; padding BAD, an unselectable ordinal BAD and invalid."""
    U, P, I, S = 2, 8, 3, 8  # E = 4
    state = ref.ResidencyState.fresh(3, S)
    before = state.clone()
    tables = [[7, 3, 5]]  # pages 0, 1, 2 of the row
    # h = 13, c = 15: units 0..5 history, 6 (partly written head) and 7 in flight
    index, misses, deltas = rsd.resolve_resident(state, [[5, 0, 7, 5, -1, 9]], [13], [15], [1],
                                                 U, P, I, tables, 10)
    base = 3 * S
    assert index == [[base + 3 * 4 + 1, base + 7 * 4 + 0, base + 3 * 4 + 3, base + 3 * 4 + 1,
                      BAD, BAD]]
    assert misses == [] and deltas == [3, 0, 1]
    assert state.resident == before.resident and state.recency == before.recency
    out, start = rsd.write_indices_resident(state.resident, [[BAD] * 3], [13], [15], [1], U, I,
                                            4, P, tables, 10)
    # tokens 13 (unit 6, row 1) and 14 (unit 7, row 0) on page 1 (id 3)
    assert start == [13] and out == [[(base + 3 * 4 + 2) * U + 1, (base + 3 * 4 + 3) * U + 0,
                                      BAD, BAD]]


@pytest.mark.parametrize("seed", range(4))
def test_fully_resident_rows_never_miss_and_read_exact_bytes(seed):
    """Full rows over many steps (decode and long prefills): zero misses, every selectable unit
    read through its GPU entry holds what the model wrote, every history token is exact on its
    host page and its GPU page after each flush; the cells stay empty."""
    w = World(seed, ["full", "full", "full"], gpu_slots=3 * 10 + 2, max_tokens=80)
    steps = 0
    while w.runnable() and steps < 40:
        _, _, deltas = w.step()
        assert deltas[1] == 0
        steps += 1
    assert not w.demotions
    assert all(u == BAD for lease in w.state.resident for u in lease)
    assert w.state.counters[1] == 0 and w.state.counters[0] > 0


@pytest.mark.parametrize("seed", range(6))
def test_mixed_rows_read_exact_bytes(seed):
    """Rows with some pages on the GPU, next to full and cells-only rows in one batch (and a
    hole): every selected unit reads the right bytes whether its entry is a cell or a GPU page,
    the one-place and RES-1/RES-2 invariants hold after every resolve, and history is exact on
    host pages after every flush."""
    modes = ["mixed", "mixed", "full", "none", "none"]
    w = World(100 + seed, modes, gpu_slots=22, max_tokens=72, hole=True)
    kinds = set()
    for _ in range(30):
        index, _, _ = w.step()
        base = w.num_leases * w.S
        for r in range(w.rows):
            kinds.update("gpu" if e >= base else "cell" for e in index[r] if e != BAD)
    assert kinds == {"gpu", "cell"}


def test_windowed_rows_with_gpu_pages_read_exact_bytes():
    """Windows and sinks (TIER-3) with GPU pages: units on released pages stay unselectable even
    while their GPU page is still allocated; sink pages and live pages read exact bytes."""
    for seed in range(3):
        w = World(200 + seed, ["full", "mixed", "none"], gpu_slots=30, max_tokens=88, window=20,
                  sinks=3)
        for _ in range(25):
            w.step()


def test_mtp_selection_reads_gpu_entries_per_query_token():
    """MTP-3 with GPU pages: each query token's column gets the entry of its ordinal in the
    union, GPU entries for units on the GPU, cell entries for the others."""
    U, P, I, S = 2, 8, 4, 8
    state = ref.ResidencyState.fresh(2, S)
    tables = [[4, BAD, 2]]
    selected = [[[0, 5, -1], [9, 0, 5]]]  # unit 0 on page 0 (GPU), 5 on page 1 (host), 9 page 2
    index, misses, deltas = rsd.resolve_resident_multi(state, selected, [20], [22], [0], U, P,
                                                       I, tables, 8)
    base = 2 * S
    slot5 = state.resident[0].index(5)
    assert index == [[[base + 16, slot5, BAD], [base + 8 + 1, base + 16, slot5]]]
    assert misses == [(0, slot5, 0, 5)] and deltas == [2, 1, 0]


# ----------------------------------------------------------------------------------------------
# write_indices + flush on resident rows
# ----------------------------------------------------------------------------------------------


def test_resident_row_write_and_flush_put_exact_bytes_on_host():
    """Decisions 4 and 5 by hand: a row whose pages are on the GPU writes its in-flight tokens
    into its GPU page (token index entry*U + t % U), and flush copies exactly [s0, min(new h, c))
    from there to the host page; nothing else of the host page changes."""
    U, P, I, S, leases, gpu_slots = 2, 8, 6, 12, 2, 4
    E = P // U
    rnd = random.Random(3)
    state = ref.ResidencyState.fresh(leases, S)
    space = ref.CellList([[bytearray(rnd.randbytes(P * 3))]
                          for _ in range(leases * S // E + gpu_slots)], P)
    host = ref.CellList([[bytearray(rnd.randbytes(P * 3))] for _ in range(6)], P)
    host_before = copy.deepcopy(host)
    gpu = [[BAD, 2, 0]]  # page 0 not on the GPU (cells), pages 1 and 2 on GPU slots 2 and 0
    page_table = [[5, 1, 3]]
    h, c, lease = [7], [13], [1]  # s0 = 7; in-flight units 3 (page 0), 4, 5 (page 1), 6 (1)
    rsd.resolve_resident(state, [[]], h, c, lease, U, P, I, gpu, gpu_slots)
    assert sorted(u for u in state.resident[1] if u != BAD) == [3]  # only unit 3 is admitted
    located = ref.locate_inflight(state.resident, h, c, lease, U, I)
    out, start = rsd.write_indices_resident(state.resident, located, h, c, lease, U, I, I + U - 1,
                                            P, gpu, gpu_slots)
    slot3 = state.resident[1].index(3)
    want = [(1 * S + slot3) * U + 1]  # token 7
    want += [(leases * S + 2 * E + (t // U) % E) * U + t % U for t in range(8, 13)]
    assert out == [want + [BAD]] and start == [7]
    written = {}
    for j, idx in enumerate(out[0]):
        if idx == BAD:
            continue
        written[7 + j] = rnd.randbytes(3)
        space[idx // P][0][idx % P * 3:(idx % P + 1) * 3] = written[7 + j]
    copies = rsd.flush_resident([host], [space], [state.resident], [located], page_table, [11],
                                h, c, lease, [S, U, I], [gpu], [gpu_slots])
    assert copies == [(0, 0, 3, 5, 7, 8), (0, 0, 4, 1, 8, 10), (0, 0, 5, 1, 10, 11)]
    for t in range(16):
        page = page_table[0][t // P]
        got = bytes(host[page][0][t % P * 3:(t % P + 1) * 3])
        if 7 <= t < 11:
            assert got == written[t]
        else:
            assert got == bytes(host_before[page][0][t % P * 3:(t % P + 1) * 3])


@pytest.mark.parametrize("seed", range(3))
def test_resident_rows_long_prefill_and_head_units_exact(seed):
    """Long prefills (c - h > I: [h, s0) written straight to host and GPU pages) and partly
    written head units (h not unit-aligned) on full rows: every flush leaves the exact bytes on
    host pages, the GPU pages hold every history token, reads are exact."""
    w = World(300 + seed, ["full", "full"], U=4, P=16, I=6, S=12, K=3, gpu_slots=14,
              max_tokens=100, h0=[3, 0])
    for _ in range(25):
        accepted = [w.rnd.randint(max(0, w.c[r] - w.h[r] - 2), w.c[r] - w.h[r])
                    for r in range(w.rows)]
        w.step(accepted=accepted)
    assert not w.demotions


# ----------------------------------------------------------------------------------------------
# Demotion
# ----------------------------------------------------------------------------------------------


def test_demote_hand_computed():
    """Decision 6 by hand: h = 13, c = 15 (U = 2, E = 4, S = 4): units 6 (partly written head)
    and 7 in flight are seeded first, then history newest first (5, 4) until S slots; each unit's
    bytes come from its GPU entry; recency ends with the newest seeded unit; the GPU table is
    all BAD."""
    U, P, I, S, leases, gpu_slots = 2, 8, 3, 4, 1, 6
    rnd = random.Random(5)
    space = ref.CellList([[bytearray(rnd.randbytes(P * 2)) for _ in range(2)]
                          for _ in range(leases * S // 4 + gpu_slots)], P)
    before = copy.deepcopy(space)
    state = ref.ResidencyState.fresh(leases, S)
    gpu = [[5, 2]]
    seeds = rsd.demote(state, [space], gpu, gpu_slots, 0, [13], [15], [0], U, P, I)
    assert seeds == [(6, 0), (7, 1), (5, 2), (4, 3)]
    assert state.resident[0] == [6, 7, 5, 4]
    assert state.recency[0] == [3, 2, 0, 1]  # units 4, 5, 6, 7
    assert gpu == [[BAD, BAD]]
    for u, s in seeds:
        src = rsd.gpu_entry(leases, S, 2, 4, u)  # all on page 1 (slot 2)
        assert rsd.unit_bytes(space, s, U) == rsd.unit_bytes(before, src, U)
    assert rsd.unit_bytes(space, src, U) == rsd.unit_bytes(before, src, U)  # pages untouched


def test_demote_keeps_cells_pinned_and_recent_in_a_mixed_row():
    """Demote of a mixed row: cells holding in-flight units of non-resident pages are never
    victims; seeds take empty slots first, then least recently used ones; units of the row's GPU
    pages found in cells are dropped first (stale). A row without GPU pages is left unchanged."""
    U, P, I, S = 1, 4, 3, 8  # E = 4
    state = ref.ResidencyState.fresh(1, S)
    # h = 10, c = 12: units 10, 11 in flight (page 2, not on the GPU); pages 0, 1 on the GPU
    state.resident[0] = [11, 2, BAD, 10, 5, 0, 9, BAD]
    state.recency[0] = [4, 0, 1, 5, 2, 3, 6, 7]
    gpu = [[0, 1, BAD]]
    seeds = rsd.demote(state, [], gpu, 2, 0, [10], [12], [0], U, P, I)
    # slots 1 (unit 2), 4 (5), 5 (0) are stale and emptied; victims: empty in recency order
    # 4, 1, 5, 2, 7, then occupied non-in-flight: 6 (unit 9); in flight: none on the GPU
    assert seeds == [(7, 4), (6, 1), (5, 5), (4, 2), (3, 7), (2, 6)]
    assert state.resident[0] == [11, 6, 4, 10, 7, 5, 2, 3]
    assert state.recency[0] == [0, 3, 6, 7, 2, 5, 1, 4]
    before = state.clone()
    assert rsd.demote(state, [], [[BAD, BAD]], 2, 0, [10], [12], [0], U, P, I) == []
    assert state == before


@pytest.mark.parametrize("seed", range(4))
def test_demoted_row_resolves_like_a_cells_only_row_that_held_the_units(seed):
    """After a demote between steps the row is a cells-only row: its twin, a row that never had
    GPU pages and holds the seeded units in the same slots (fetched from host pages), resolves
    to the same index table, misses and counters, and both read the host pages' bytes."""
    w = World(400 + seed, ["full", "full"], gpu_slots=20, max_tokens=72, h0=[30, 41])
    for _ in range(4):
        w.step()
    twin = copy.deepcopy(w)
    seeds = w.demote(0)
    assert seeds and len(seeds) <= w.S
    inflight = set(w.rng(0).inflight_units())
    assert [u for u, _ in seeds][:len(inflight)] == sorted(inflight)  # in flight first
    history = [u for u, _ in seeds[len(inflight):]]
    assert history == sorted(history, reverse=True) and history[0] == w.h[0] // w.U - 1
    # the twin never had pages: its lease holds the same units, fetched from the host pages
    twin.gpu_pages[0] = [BAD] * twin.max_pages
    twin.modes[0] = "none"
    twin.state.resident[0] = list(w.state.resident[0])
    twin.state.recency[0] = list(w.state.recency[0])
    ref.fetch(twin.spaces, twin.host, [twin.page_table] * len(BUFFERS),
              [(0, s, 0, u) for u, s in seeds], twin.S, twin.U)
    for u, s in seeds:  # the seeded bytes are the host page's bytes (below h)
        end = max(0, min(w.U, w.h[0] - u * w.U))
        assert [rsd.unit_bytes(sp, s, w.U, 0, end) for sp in w.spaces] == \
            [rsd.unit_bytes(sp, s, w.U, 0, end) for sp in twin.spaces]
    for _ in range(6):
        selected = [w.random_selection(r) for r in range(w.rows)]
        twin.rnd.setstate(w.rnd.getstate())
        a = w.step(selected=[list(x) for x in selected])
        b = twin.step(selected=[list(x) for x in selected])
        assert a[0][0] == b[0][0] and a[1][0] == b[1][0]  # row 0: entries and bytes read
        assert w.state.resident[0] == twin.state.resident[0]
        assert w.state.recency[0] == twin.state.recency[0]


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("where", ["mid", "after"])
def test_demote_then_decode_reads_the_same_bytes_as_a_never_resident_row(seed, where):
    """Demote (after the step's writes and before its flush, or between steps) and keep decoding:
    every step reads, unit for unit, the same bytes as the same request in a world where it never
    had GPU pages (same selections, same KV written), and the host pages agree at the end."""
    a = World(500 + seed, ["full", "none"], gpu_slots=16, max_tokens=90, h0=[25, 25])
    b = World(500 + seed, ["none", "none"], gpu_slots=16, max_tokens=90, h0=[25, 25])
    sel_rnd = random.Random(seed)
    for step in range(14):
        top = ref.ceil_div(a.c[0], a.U) + 1
        selected = [[sel_rnd.randrange(-1, top) for _ in range(a.K)] for _ in range(2)]
        accepted = [sel_rnd.randint(0, min(a.c[r] - a.h[r], b.c[r] - b.h[r])) for r in range(2)]
        mid = (0,) if (where == "mid" and step == 5) else ()
        after = (0,) if (where == "after" and step == 5) else ()
        # both worlds advance to the same lengths: copy b's draws from a
        b.rnd.setstate(a.rnd.getstate())
        ra = a.step(selected=selected, accepted=accepted, demote_mid=mid, demote_after=after)
        rb = b.step(selected=selected, accepted=accepted)
        assert (a.h, a.c) == (b.h, b.c)
        assert ra[1] == rb[1]
    assert a.demotions and a.modes[0] == "none"
    for r in range(2):
        for t in range(a.h[r]):
            page = a.page_table[r][t // a.P]
            assert a._get(a.host, page, t % a.P) == b._get(b.host, b.page_table[r][t // b.P],
                                                           t % b.P)


def test_demote_mid_step_seeds_unflushed_inflight_tokens():
    """Decision 6's mandatory part: after the step's writes went to the GPU page and before its
    flush, a demote must carry the in-flight units into cells, or the flush (which now reads
    cells) would put stale bytes on host pages."""
    for seed in range(6):
        w = World(600 + seed, ["full"], gpu_slots=12, max_tokens=64, h0=[21])
        w.step(accepted=[w.c[0] - w.h[0]])
        index, reads, _ = w.step(accepted=[w.c[0] - w.h[0]], demote_mid=(0,))
        inflight = w.demotions[0][1]
        assert inflight and w.modes[0] == "none"
        for _ in range(5):
            w.step()


@pytest.mark.parametrize("seed", range(5))
def test_random_days_interleave_resolve_demote_and_pressure(seed):
    """Random days: rows full, mixed or cells-only, a GPU pool too small for all of them (a full
    row that cannot get a page is demoted), random demotes before and after flushes, holes,
    prefills and decode. After every resolve and demote the invariants hold; every read and
    every flushed token is exact."""
    rnd = random.Random(seed)
    modes = [rnd.choice(["full", "full", "mixed", "none"]) for _ in range(4)]
    w = World(700 + seed, modes, gpu_slots=22, max_tokens=96, hole=(seed % 2 == 0))
    for _ in range(40):
        holders = [r for r in range(w.rows) if w.lease[r] >= 0
                   and any(p != BAD for p in w.gpu_pages[r])]
        mid = tuple(r for r in holders if rnd.random() < 0.04)
        after = tuple(r for r in holders if r not in mid and rnd.random() < 0.04)
        w.step(demote_mid=mid, demote_after=after)
    ref.check_res1(w.state)
    assert any(seeds for _, seeds in w.demotions)


# ----------------------------------------------------------------------------------------------
# The checkers catch what they claim to catch
# ----------------------------------------------------------------------------------------------


def test_checkers_catch_a_unit_in_two_places_and_a_wrong_entry():
    """check_res_resident refuses a cell holding a unit of a GPU page and an in-flight unit that
    is nowhere; check_index_space refuses a GPU unit given a cell entry and an entry off by one."""
    U, P, I, S = 2, 8, 3, 8
    state = ref.ResidencyState.fresh(1, S)
    gpu = [[1, BAD]]
    state.resident[0][0] = 2  # unit 2 is on GPU page 1
    with pytest.raises(AssertionError, match="one place"):
        rsd.check_res_resident(state, [4], [4], [0], U, P, I, gpu, 4)
    state.resident[0][0] = BAD
    with pytest.raises(AssertionError, match="RES-2"):
        rsd.check_res_resident(state, [9], [11], [0], U, P, I, gpu, 4)  # unit 4 (page 1)
    good = rsd.gpu_entry(1, S, 1, 4, 2)
    rsd.check_index_space([[good]], [[2]], [8], [8], [0], U, P, I, 1, S, gpu, 4)
    for bad in (0, good + 1):
        with pytest.raises(AssertionError):
            rsd.check_index_space([[bad]], [[2]], [8], [8], [0], U, P, I, 1, S, gpu, 4)

