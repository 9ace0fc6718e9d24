"""The op-level residency harness shared by test_residency_ops.py and test_fetch_ops.py: one
selection group's state tensors built by hand next to the reference state (``Group``), and one
sparse buffer's host pool, page table and cells (``Layer``); no Batch or manager is involved."""
from __future__ import annotations

import torch

import torch_kvcm2  # noqa: F401  (registers the ops)
from torch_kvcm2 import ops

import reference as ref

BAD = ref.BAD
I32 = torch.int32


def t32(data, device):
    return torch.tensor(data, dtype=I32, device=device)




class Group:
    """Op-level residency state of one selection group, mirrored by a reference state."""

    def __init__(self, device, *, leases, rows, K, U, P, I, S, window=0, guard=False,
                 writes=False, sinks=0):
        self.device, self.rows, self.K = device, rows, K
        # writes=True: resolve also writes OP-WRITE's outputs (write_table, write_start), which
        # every step compares with the write_indices op run afterwards on the state it left.
        self.writes = writes
        self.fetch_layers = []  # set: run_op is resolve_step, which also fetches into these
        self.U, self.P, self.I, self.S, self.window = U, P, I, S, window
        self.sinks = sinks  # tokens a windowed group keeps at the start (TIER-3)
        self.num_leases = leases
        miss_rows = rows * (K + ops.max_inflight_units(I, U))
        assert ops.max_inflight_units(I, U) == ref.ceil_div(I, U) + 1
        g = 2 if guard else 0  # even: miss_count stays 8-byte aligned
        # With guard=True every mutated tensor is the inside of a larger buffer whose border
        # must never change (no out-of-bounds writes).
        self._resident = torch.full((leases + 2 * g, S), BAD, dtype=I32, device=device)
        self._recency = torch.arange(S, dtype=I32, device=device).repeat(leases + 2 * g, 1)
        self._index = torch.full((rows + 2 * g, K), 777, dtype=I32, device=device)
        self._miss = torch.full((miss_rows + 2 * g, ops.MISS_FIELDS), 999, dtype=I32, device=device)
        self._count = torch.full((ops.MISS_COUNT_WORDS + 2 * g,), 555, dtype=I32, device=device)
        self._count[g + 2:g + 4] = 0  # the reservation word starts zeroed
        self._counters = torch.zeros(ops.NUM_COUNTERS + 2 * g, dtype=torch.int64, device=device)
        self._inflight = torch.full((rows + 2 * g, ops.max_inflight_units(I, U)), 333, dtype=I32,
                                    device=device)
        sl = slice(g, -g if g else None)
        self.resident, self.recency = self._resident[sl], self._recency[sl]
        self.index_table, self.miss_list = self._index[sl], self._miss[sl]
        self.miss_count, self.counters = self._count[sl], self._counters[sl]
        self.inflight_slots = self._inflight[sl]
        width = I + U + 1  # wider than the I + U - 1 the op needs: every column is written
        self.write_table = torch.full((rows, width), 444, dtype=I32, device=device)
        self.write_start = torch.full((rows,), 444, dtype=I32, device=device)
        self.guard = g
        self._border = self._borders()
        self.ref = ref.ResidencyState.fresh(leases, S)

    def _borders(self):
        if not self.guard:
            return None
        return [(t[0].clone(), t[-1].clone()) for t in
                (self._resident, self._recency, self._index, self._miss, self._count,
                 self._counters, self._inflight)]

    def check_borders(self):
        if not self.guard:
            return
        for (a, b), t in zip(self._border, (self._resident, self._recency, self._index,
                                            self._miss, self._count, self._counters,
                                            self._inflight)):
            assert torch.equal(a, t[0]) and torch.equal(b, t[-1]), "out-of-bounds write"

    def reset_lease(self, ell):
        """What publish does for a newly granted lease: resident = -1, recency = 0..S-1."""
        self.resident[ell] = BAD
        self.recency[ell] = torch.arange(self.S, dtype=I32, device=self.device)
        self.ref.resident[ell] = [BAD] * self.S
        self.ref.recency[ell] = list(range(self.S))

    def run_op(self, selected, history, capacity, lease):
        if self.fetch_layers:  # OP-STEP: resolve, its write outputs and the fetch in one call
            layers = self.fetch_layers
            ops.resolve_step(
                self.resident, self.recency, self.index_table, self.miss_list, self.miss_count,
                self.counters, self.inflight_slots, self.write_table, self.write_start,
                [l.cells for l in layers], t32(selected, self.device), t32(history, self.device),
                t32(capacity, self.device), t32(lease, self.device), [l.pool for l in layers],
                [l.pos for l in layers], [l.page_table for l in layers], self.U, self.P, self.I,
                self.window, sinks=self.sinks)
            return
        writes = (self.write_table, self.write_start) if self.writes else (None, None)
        ops.resolve(self.resident, self.recency, self.index_table, self.miss_list,
                    self.miss_count, self.counters, self.inflight_slots, t32(selected, self.device),
                    t32(history, self.device), t32(capacity, self.device), t32(lease, self.device),
                    self.U, self.P, self.I, self.window, None, *writes, sinks=self.sinks)

    def check_writes(self, history, capacity, lease):
        """resolve's write outputs equal the write_indices op's on the state resolve left."""
        if not self.writes:
            return
        table, start = torch.full_like(self.write_table, 7), torch.full_like(self.write_start, 7)
        ops.write_indices(table, start, self.resident, self.inflight_slots,
                          t32(history, self.device), t32(capacity, self.device),
                          t32(lease, self.device), self.U, self.I)
        assert torch.equal(table, self.write_table), (history, capacity, lease)
        assert torch.equal(start, self.write_start), (history, capacity, lease)

    def op_misses(self):
        count = self.miss_count.tolist()
        assert count[2:] == [0, 0], f"reservation word not reset: {count}"
        n = count[0]
        assert 0 <= n <= self.miss_list.shape[0]
        return [tuple(e) for e in self.miss_list[:n].cpu().tolist()]

    def step(self, selected, history, capacity, lease, *, check_ref=True, allow_negative=False):
        """Runs the op and the reference; asserts every output and the full state agree and
        that RES-1/RES-2/RES-4 hold. Returns (index_table, sorted misses, counter deltas)."""
        before = (self.resident.cpu().clone(), self.recency.cpu().clone())
        old_counters = self.counters.cpu().tolist()
        self.run_op(selected, history, capacity, lease)
        self.check_borders()
        self.check_writes(history, capacity, lease)
        got_index = self.index_table.cpu().tolist()
        got_misses = sorted(self.op_misses())
        got_counters = self.counters.cpu().tolist()
        deltas = [a - b for a, b in zip(got_counters, old_counters)]
        if check_ref:
            want_index, want_misses, want_deltas = ref.resolve(
                self.ref, selected, history, capacity, lease, self.U, self.P, self.I, self.window,
                self.sinks)
            ctx = dict(selected=selected, history=history, capacity=capacity, lease=lease)
            assert got_index == want_index, ctx
            assert got_misses == sorted(want_misses), ctx
            assert deltas == want_deltas, ctx
            assert got_counters == self.ref.counters, ctx
            assert self.resident.cpu().tolist() == self.ref.resident, ctx
            assert self.recency.cpu().tolist() == self.ref.recency, ctx
            ref.check_res2(self.ref, history, capacity, lease, self.U, self.P, self.I,
                           self.window, self.sinks)
        state = ref.state_from_tensors(self.resident.cpu(), self.recency.cpu(), self.counters.cpu())
        ref.check_res1(state, allow_negative_units=allow_negative)
        # the in-flight slot records: the lowest slot holding each in-flight unit afterwards
        assert self.inflight_slots.cpu().tolist() == ref.locate_inflight(
            self.resident.cpu().tolist(), history, capacity, lease, self.U, self.I)
        # RES-4: leases of no seated row are never touched
        seated = {ell for ell in lease if 0 <= ell < self.num_leases}
        for ell in range(self.num_leases):
            if ell not in seated:
                assert torch.equal(before[0][ell], self.resident[ell].cpu()), f"lease {ell}"
                assert torch.equal(before[1][ell], self.recency[ell].cpu()), f"lease {ell}"
        return got_index, got_misses, deltas

    def slot_of(self, ell, unit):
        row = self.resident[ell].cpu().tolist()
        return row.index(unit) if unit in row else None


# The small configuration most scenarios use: U=2 tokens per unit, P=4 tokens per page (E=2),
# K=4, I=4 in-flight tokens (at most 3 in-flight units), S=8 >= K + ceil(I/U) + 1 = 7.
SMALL = dict(U=2, P=4, I=4, K=4, S=8)


def small_group(device, leases=2, rows=2, **kw):
    cfg = dict(SMALL)
    cfg.update(kw)
    return Group(device, leases=leases, rows=rows, **cfg)


class Layer:
    """One sparse buffer of a layer: a host pool, its page table and its cells (+ reference)."""

    def __init__(self, device, *, gen, num_leases, S, P, U, chunks, bpt, host_slots, rows,
                 max_pages, scale=1, pos=0, guard=True, bad_page_frac=0.0):
        E = P // U
        self.bpc = bpt // chunks if chunks else 0
        self.P, self.U, self.S = P, U, S
        # the host pool group: [slots, scale, chunks, P, bpc]; this buffer is pos `pos`
        pool = torch.randint(0, 256, (host_slots, scale, chunks, P, self.bpc), generator=gen,
                             dtype=torch.uint8)
        self.pos = pos
        self._set_pool(pool.to(device))
        num_cells = num_leases * S // E
        g = 1 if guard else 0
        self._cells = torch.randint(0, 256, (num_cells + 2 * g, chunks, P, self.bpc),
                                    generator=gen, dtype=torch.uint8).to(device)
        self.cells = self._cells[g:num_cells + g]
        self._border = (self._cells[:g].clone(), self._cells[num_cells + g:].clone())
        self.guard = g
        table = torch.randint(0, host_slots, (rows, max_pages), generator=gen, dtype=I32)
        if bad_page_frac:
            mask = torch.rand((rows, max_pages), generator=gen) < bad_page_frac
            table[mask] = BAD
        self.page_table = table.to(device)
        self.ref_cells = ref.pages_from_tensor(self.cells)
        self.ref_host = ref.pages_from_tensor(self.host)

    def _set_pool(self, pool5):
        """pool5: [slots, scale, chunks, P, bpc]. ``pool`` is what fetch takes (the pool group's
        [slots, scale, page_bytes]); ``host`` this buffer's pages (strided when scale > 1)."""
        slots, scale, chunks, P, bpc = pool5.shape
        self._pool5 = pool5
        self.pool = pool5.view(slots, scale, chunks * P * bpc)
        self.host = pool5[:, self.pos]

    def clone_to(self, device):
        """A copy of this buffer (host pool, page table, cells, reference) on `device`."""
        other = object.__new__(Layer)
        other.__dict__.update(self.__dict__)
        other._set_pool(self._pool5.to(device))
        other.page_table = self.page_table.to(device)
        other._cells = self._cells.clone().to(device)
        n, g = self.cells.shape[0], self.guard
        other.cells = other._cells[g:n + g]
        other._border = tuple(b.to(device) for b in self._border)
        other.ref_cells = ref.pages_from_tensor(self.cells)
        return other

    def check(self):
        g = self.guard
        n = self.cells.shape[0]
        assert torch.equal(self._cells[:g], self._border[0]), "write before the cells"
        assert torch.equal(self._cells[n + g:], self._border[1]), "write after the cells"
        assert ref.tensor_bytes(self.cells) == ref.pages_to_bytes(self.ref_cells)


def run_fetch(layers, miss_list, miss_count, S, U):
    ops.fetch([l.cells for l in layers], [l.pool for l in layers], [l.pos for l in layers],
              [l.page_table for l in layers], miss_list, miss_count, S, U)


def ref_fetch(layers, misses, S, U):
    return ref.fetch([l.ref_cells for l in layers], [l.ref_host for l in layers],
                     [l.page_table.cpu().tolist() for l in layers], misses, S, U)
