"""resolve_gpu_history (RSD-1) at op level against the reference model of GPU-resident history
(tests/reference_resident.py: ``resolve_resident``, ``write_indices_resident``).

A batch mixes rows on cells with rows whose whole history is on GPU pages (the library's
residency is per request: all of a row's pages or none, docs/DESIGN.md). The library step for
one selection group is ``resolve`` with the GPU rows given as holes (their lease masked), then
``resolve_gpu_history`` over the same outputs; the reference is one ``resolve_resident`` with
every row's true lease. Index tables, miss lists, counters, the leases' residency and recency
and the write tables must agree in full, on CPU and CUDA alike.
"""
from __future__ import annotations

import random

import pytest
import torch

from torch_kvcm2 import ops

import reference as ref
import reference_resident as rsd
from conftest import DEVICE_PARAMS
from residency_harness import BAD, I32, Group, t32


class GpuRows(Group):
    """A selection group's op state (``Group``, resolve writing its write outputs) plus the
    rows' GPU history: ``gpu_rows`` (int32[R], nonzero: the row's history is on GPU pages) and
    ``gpu_pages`` (int32[R, pages], the GPU page slot of each page ordinal)."""

    def __init__(self, device, *, pages, gpu_slots, **kw):
        super().__init__(device, writes=True, **kw)
        self.pages, self.gpu_slots = pages, gpu_slots
        self.cell_entries = self.num_leases * self.S
        self.flags = [0] * self.rows
        self.tables = [[BAD] * pages for _ in range(self.rows)]
        self.free = list(range(gpu_slots))

    def make_resident(self, r, capacity, lease):
        """Row r's pages [0, ceil(c/P)) on GPU page slots (taken from the free list, in a
        shuffled order), its lease emptied (as the library does when a row's history moves to
        GPU pages: the lease holds nothing until a demotion seeds it)."""
        self.flags[r] = 1
        self.grow(r, capacity)
        self.reset_lease(lease)

    def grow(self, r, capacity):
        for p in range(ref.ceil_div(capacity, self.P)):
            if self.tables[r][p] == BAD:
                self.tables[r][p] = self.free.pop(random.randrange(len(self.free)))

    def library_step(self, selected, history, capacity, lease, fault=None):
        masked = [BAD if f else ell for f, ell in zip(self.flags, lease)]
        self.run_op(selected, history, capacity, masked)
        gpu_pages = t32(self.tables, self.device)
        if fault == "page":  # a planted fault: one GPU page id off by one
            r = self.flags.index(1)
            gpu_pages[r, 0] = (gpu_pages[r, 0] + 1) % self.gpu_slots
        ops.resolve_gpu_history(
            self.index_table, self.write_table, self.write_start, self.counters,
            t32(selected, self.device), t32(self.flags, self.device), gpu_pages,
            t32(history, self.device), t32(capacity, self.device), t32(lease, self.device),
            self.cell_entries, self.gpu_slots, self.U, self.P, self.I, self.window, self.sinks)

    def step(self, selected, history, capacity, lease, fault=None):
        """One step on both sides; asserts everything agrees. Returns the counter deltas."""
        old = self.counters.cpu().tolist()
        self.library_step(selected, history, capacity, lease, fault)
        tables = [t if f else None for f, t in zip(self.flags, self.tables)]
        want_index, want_misses, want_deltas = rsd.resolve_resident(
            self.ref, selected, history, capacity, lease, self.U, self.P, self.I, tables,
            self.gpu_slots, self.window, self.sinks)
        ctx = dict(selected=selected, history=history, capacity=capacity, lease=lease,
                   flags=self.flags)
        assert self.index_table.cpu().tolist() == want_index, ctx
        assert sorted(self.op_misses()) == sorted(want_misses), ctx
        deltas = [a - b for a, b in zip(self.counters.cpu().tolist(), old)]
        assert deltas == want_deltas, ctx
        assert self.resident.cpu().tolist() == self.ref.resident, ctx
        assert self.recency.cpu().tolist() == self.ref.recency, ctx
        slots = ref.locate_inflight(self.ref.resident, history, capacity, lease, self.U, self.I)
        want_write, want_start = rsd.write_indices_resident(
            self.ref.resident, slots, history, capacity, lease, self.U, self.I,
            self.write_table.shape[1], self.P, tables, self.gpu_slots)
        assert self.write_table.cpu().tolist() == want_write, ctx
        assert self.write_start.cpu().tolist() == want_start, ctx
        return deltas


def small(device, **kw):
    cfg = dict(leases=3, rows=3, K=6, U=2, P=8, I=3, S=8, pages=12, gpu_slots=40)
    cfg.update(kw)
    return GpuRows(device, **cfg)


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_gpu_row_hand_computed(device):
    """A GPU-resident row: every selectable unit a hit at cells + page*E + u % E, no miss, its
    lease untouched; padding BAD, an unselectable ordinal BAD and invalid, a duplicate counted
    once; its in-flight tokens written to its GPU page."""
    g = small(device, leases=3, rows=1)
    g.flags, g.tables[0][:3] = [1], [7, 3, 5]
    g.reset_lease(1)
    # E = 4; h = 13, c = 15: units 0..5 history, 6 (partly written head) and 7 in flight
    deltas = g.step([[5, 0, 7, 5, -1, 9]], [13], [15], [1])
    base = 3 * g.S
    assert g.index_table.cpu().tolist() == [[base + 3 * 4 + 1, base + 7 * 4 + 0,
                                             base + 3 * 4 + 3, base + 3 * 4 + 1, BAD, BAD]]
    assert deltas == [3, 0, 1] and g.op_misses() == []
    assert g.write_start.cpu().tolist() == [13]
    # tokens 13 (unit 6, token 1 of it) and 14 (unit 7, token 0) on page 1 (GPU slot 3)
    assert g.write_table.cpu().tolist()[0][:3] == [(base + 3 * 4 + 2) * 2 + 1,
                                                  (base + 3 * 4 + 3) * 2 + 0, BAD]


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("shape", [
    dict(),                                            # U=2, P=8
    dict(U=1, P=4, I=2, S=8, K=5),                     # token units
    dict(U=4, P=8, I=6, S=8, K=4),                     # units wider than the in-flight range
    dict(window=16, sinks=8),                          # a windowed group keeping sink pages
])
@pytest.mark.parametrize("seed", range(3))
def test_mixed_batches_equal_the_reference(device, shape, seed):
    """Random steps of a batch of rows on cells and rows on GPU pages (decode and prefills,
    selections with padding, duplicates, in-flight and unselectable ordinals): everything the
    library writes equals the reference's, step after step."""
    random.seed(seed)
    g = small(device, **shape)
    rows, U, P, I = g.rows, g.U, g.P, g.I
    max_tokens = g.pages * P
    lease = [0, 1, 2]
    h = [random.randrange(0, 20) for _ in range(rows)]
    c = [x + random.randrange(0, I + 1) for x in h]
    for r in random.sample(range(rows), 2):
        g.make_resident(r, c[r], lease[r])
    hits = 0
    for _ in range(12):
        selected = []
        for r in range(rows):
            top = max(c[r] // U + 2, 1)
            row = [random.randrange(-1, top) for _ in range(g.K)]
            if random.random() < 0.3:
                row[-1] = row[0]  # a duplicate
            selected.append(row)
        g.step(selected, h, c, lease)
        hits += sum(e >= g.cell_entries for row in g.index_table.cpu().tolist() for e in row)
        # next step: the in-flight tokens become history, some new ones arrive
        h = list(c)
        c = [min(x + random.randrange(0, I + 1), max_tokens) for x in h]
        for r in range(rows):
            if g.flags[r]:
                g.grow(r, c[r])
    assert hits > 0  # GPU entries were read


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_bad_gpu_page_ids_read_as_no_page(device):
    """Bad device data: a page id past gpu_slots or negative, and a unit past the table, give
    BAD entries counted invalid, never an out-of-range entry; the write table goes BAD there."""
    g = small(device, rows=1, pages=2)
    g.flags = [1]
    g.tables[0] = [g.gpu_slots, -5]  # page 0 past the slots, page 1 negative
    g.reset_lease(0)
    g.library_step([[0, 1, 4, 5, 8, -1]], [16], [18], [0])
    assert g.index_table.cpu().tolist() == [[BAD] * 6]
    assert g.counters.cpu().tolist() == [0, 0, 5]
    assert g.write_table.cpu().tolist() == [[BAD] * g.write_table.shape[1]]


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_a_planted_fault_is_caught(device):
    """The comparison is exact: one GPU page id off by one in the library's input (the
    reference keeps the true one) fails it."""
    g = small(device, rows=1)
    g.make_resident(0, 16, 0)
    with pytest.raises(AssertionError):
        g.step([[0, 1, 2, 3, 4, 5]], [16], [16], [0], fault="page")


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_wide_rows_count_distinct_ordinals(device):
    """Thousands of columns per row (the CUDA kernel's shared-memory set at full load),
    half of them duplicates: the counters count each distinct ordinal once, as on CPU."""
    K, rows = 3000, 2
    g = small(device, rows=rows, K=K, leases=rows, pages=400, gpu_slots=800)
    h, c = [3000, 2500], [3001, 2502]
    for r in range(rows):
        g.make_resident(r, c[r], r)
    gen = torch.Generator().manual_seed(5)
    selected = torch.randint(-1, 1600, (rows, K), generator=gen, dtype=I32).tolist()
    deltas = g.step(selected, h, c, list(range(rows)))
    distinct = sum(len({u for u in row if u >= 0}) for row in selected)
    assert deltas[0] + deltas[2] == distinct and deltas[1] == 0


def test_opcheck():
    """INT-1: resolve_gpu_history passes torch.library.opcheck (all default utilities)."""
    g = small("cpu", rows=2)
    g.make_resident(1, 20, 1)
    args = (g.index_table, g.write_table, g.write_start, g.counters,
            t32([[0, 3, 9, -1, 2, 2], [1, 2, 3, 4, 5, 40]], "cpu"), t32([0, 1], "cpu"),
            t32(g.tables, "cpu"), t32([10, 18], "cpu"), t32([12, 20], "cpu"), t32([0, 1], "cpu"),
            g.cell_entries, g.gpu_slots, g.U, g.P, g.I, 0, 0)
    torch.library.opcheck(torch.ops.torch_kvcm2.resolve_gpu_history.default, args)


def flush_step(device, seed, fault=None):
    """One step of a mixed batch (rows 0 and 2 on GPU pages, row 1 on cells) through resolve,
    then ``flush`` (with the rows' true leases: it skips the GPU rows, whose in-flight slots
    resolve never recorded) and ``flush_gpu_history`` into one pool group of two buffers;
    returns (library host bytes, reference host bytes) per buffer."""
    rnd = random.Random(seed)
    random.seed(seed)
    gen = torch.Generator().manual_seed(seed)
    U, P, I, S, leases, rows, chunks, bpc, host_slots = 2, 8, 3, 8, 3, 3, 2, 4, 40
    E, gpu_slots, pages = P // U, 12, 6
    cell_pages = leases * S // E
    g = GpuRows(device, leases=leases, rows=rows, K=4, U=U, P=P, I=I, S=S, pages=pages,
                gpu_slots=gpu_slots)
    h = [rnd.randrange(0, 30) for _ in range(rows)]
    c = [x + rnd.randrange(1, I + 1) for x in h]
    lease = [0, 1, 2]
    for r in (0, 2):
        g.make_resident(r, c[r], lease[r])
    selected = [[rnd.randrange(0, max(c[r] // U, 1)) for _ in range(4)] for r in range(rows)]
    g.step(selected, h, c, lease)
    pool5 = torch.randint(0, 256, (host_slots, 2, chunks, P, bpc), generator=gen,
                          dtype=torch.uint8)
    spaces = [torch.randint(0, 256, (cell_pages + gpu_slots, chunks, P, bpc), generator=gen,
                            dtype=torch.uint8) for _ in range(2)]
    table = [rnd.sample(range(host_slots), pages) for _ in range(rows)]
    new_history = [rnd.randrange(x, y + 1) for x, y in zip(h, c)]
    # the reference, on plain data
    host_ref = [ref.pages_from_tensor(pool5[:, b]) for b in range(2)]
    slots = ref.locate_inflight(g.ref.resident, h, c, lease, U, I)
    gpu_tables = [t if f else None for f, t in zip(g.flags, g.tables)]
    rsd.flush_resident(host_ref, [ref.pages_from_tensor(s) for s in spaces],
                       [g.ref.resident] * 2, [slots] * 2, table, new_history, h, c, lease,
                       [S, U, I] * 2, [gpu_tables] * 2, [gpu_slots] * 2)
    # the library
    pool = pool5.to(device).view(host_slots, 2, chunks * P * bpc)
    spaces = [s.to(device) for s in spaces]
    lengths = [t32(x, device) for x in (new_history, h, c, lease)]
    ops.flush(pool, [0, 1], spaces, [g.resident] * 2, [g.inflight_slots] * 2, t32(table, device),
              *lengths, [S, U, I] * 2)
    shift = 1 if fault == "cell_pages" else 0  # a planted fault: the GPU pages one page off
    ops.flush_gpu_history(pool, [0, 1], spaces, t32(g.flags, device), t32(g.tables, device),
                          t32(table, device), *lengths, [cell_pages + shift, U, I] * 2)
    got = [ref.tensor_bytes(pool.view(host_slots, 2, chunks, P, bpc)[:, b]) for b in range(2)]
    return got, [ref.pages_to_bytes(p) for p in host_ref]


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("seed", range(6))
def test_flush_of_a_mixed_batch_equals_the_reference(device, seed):
    """flush + flush_gpu_history put on host pages exactly what the reference's flush_resident
    does: the cells row's in-flight tokens from its cells, the GPU rows' from their GPU pages,
    [s0, min(new_history, c)) of each, and nothing else."""
    got, want = flush_step(device, seed)
    assert got == want


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_flush_comparison_catches_a_planted_fault(device):
    """The GPU rows read one page past their GPU pages: the host bytes differ."""
    got, want = flush_step(device, 1, fault="cell_pages")
    assert got != want


def test_flush_opcheck():
    """INT-1: flush_gpu_history passes torch.library.opcheck (all default utilities)."""
    gen = torch.Generator().manual_seed(0)
    pool = torch.randint(0, 256, (10, 2, 2 * 8 * 4), generator=gen, dtype=torch.uint8)
    spaces = [torch.randint(0, 256, (9, 2, 8, 4), generator=gen, dtype=torch.uint8)
              for _ in range(2)]
    args = (pool, [0, 1], spaces, t32([1, 0], "cpu"), t32([[0, 1, 2], [BAD] * 3], "cpu"),
            t32([[3, 4, 5], [6, 7, 8]], "cpu"), t32([14, 12], "cpu"), t32([10, 9], "cpu"),
            t32([14, 12], "cpu"), t32([0, 1], "cpu"), [6, 2, 3] * 2)
    torch.library.opcheck(torch.ops.torch_kvcm2.flush_gpu_history.default, args)
