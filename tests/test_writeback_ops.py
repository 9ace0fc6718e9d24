"""OP-WRITE and OP-FLUSH at op level: ``locate_inflight``, ``write_indices`` and ``flush`` against
the plain-Python reference (tests/reference.py, "OP-WRITE / OP-FLUSH" section).

The inputs are built by hand, without resolve, Batch or manager: published lengths (decode,
long prefill, idle and bad data), leases (seated, holes, out of range), residency rows holding
the rows' in-flight units at random slots (some missing), ``inflight_slots`` records (some stale
or out of range), page tables (some BAD or out of range, some too narrow) and host pools with
``scale > 1`` whose buffer views are strided across slots. Every op output is compared exactly
with the reference; flush is compared on the whole host pool including guard slots around it,
and its read-only inputs are checked unchanged.
"""
from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

import torch_kvcm2  # noqa: F401  (registers the ops)
from torch_kvcm2 import ops

import reference as ref
from conftest import DEVICE_PARAMS

BAD = ref.BAD
I32 = torch.int32
U8 = torch.uint8
INT32_MAX = 2**31 - 1
INT32_MIN = -2**31


def t32(data, device="cpu"):
    return torch.tensor(data, dtype=I32, device=device)


# ----------------------------------------------------------------------------------------------
# random inputs (plain Python data)
# ----------------------------------------------------------------------------------------------


def random_lengths(rng, rows, I, U):
    """Published (history, capacity) per row: decode steps, long prefills (part host-direct),
    idle rows, fresh requests and bad device data (capacity below history, negative history,
    lengths near INT32_MAX)."""
    h, c = [], []
    for _ in range(rows):
        base = rng.randrange(0, 40)
        x = rng.random()
        if x < 0.32:
            hh, cc = base, base + rng.randint(1, I)  # decode / short prefill
        elif x < 0.52:
            hh, cc = base, base + rng.randint(I + 1, 4 * I + 2 * U)  # long prefill
        elif x < 0.60:
            hh, cc = base, base  # nothing in flight
        elif x < 0.70:
            hh, cc = 0, rng.randint(0, 3 * I)  # a fresh request
        elif x < 0.78:
            hh, cc = base, base - rng.randint(1, 6)  # bad: capacity below history
        elif x < 0.86:
            hh, cc = -rng.randint(1, 9), rng.randint(-4, I + U)  # bad: negative history
        elif x < 0.93:
            hh = INT32_MAX - rng.randint(0, 3 * I)  # bad: near INT32_MAX
            cc = min(INT32_MAX, hh + rng.randint(0, I + U))
        else:
            hh, cc = base, rng.choice([INT32_MIN, -1, base + U])
        h.append(hh)
        c.append(cc)
    return h, c


def random_leases(rng, rows, num_leases):
    """Mostly seated rows (two rows may share a lease), some holes (BAD) and bad leases."""
    out = []
    for _ in range(rows):
        x = rng.random()
        if x < 0.12:
            out.append(BAD)
        elif x < 0.20:
            out.append(rng.choice([-5, num_leases, num_leases + 7, INT32_MIN, INT32_MAX]))
        else:
            out.append(rng.randrange(num_leases))
    return out


def build_resident(rng, h, c, lease, U, I, S, num_leases, p_missing=0.1):
    """Per lease S distinct ordinals: the in-flight units of the rows seated there (each missing
    with probability ``p_missing``) at random slots, filled with history units, BAD and rare
    negative garbage. No ordinal appears twice (RES-1)."""
    wanted = {ell: [] for ell in range(num_leases)}
    for r, ell in enumerate(lease):
        if 0 <= ell < num_leases:
            for u in ref.RowRange(h[r], c[r], U, U, I, 0).inflight_units():
                if u not in wanted[ell]:
                    wanted[ell].append(u)
    resident = []
    for ell in range(num_leases):
        units = [u for u in wanted[ell] if rng.random() >= p_missing][:S]
        while len(units) < S:
            x = rng.random()
            if x < 0.4:
                units.append(BAD)
            elif x < 0.45:
                v = rng.choice([-7, INT32_MIN])
                if v not in units:
                    units.append(v)
            else:
                v = rng.randrange(0, 40)
                if v not in units:
                    units.append(v)
        rng.shuffle(units)
        resident.append(units)
    return resident


def corrupt_slots(rng, table, S, p):
    """Stale / mismatched / out-of-range records in an inflight_slots table."""
    out = []
    for line in table:
        new = []
        for v in line:
            if rng.random() < p:
                v = rng.choice([BAD, -7, S, S + 5, INT32_MAX, INT32_MIN,
                                rng.randrange(S), rng.randrange(S)])
            new.append(v)
        out.append(new)
    return out


def random_new_history(rng, h, c):
    out = []
    for hh, cc in zip(h, c):
        lo, hi = min(hh, cc), max(hh, cc)
        x = rng.random()
        if x < 0.30:
            v = cc  # flush everything
        elif x < 0.55:
            v = rng.randint(lo, hi)  # partial
        elif x < 0.63:
            v = hh  # nothing
        elif x < 0.73:
            v = cc + rng.randint(1, 9)  # above capacity
        elif x < 0.80:
            v = rng.choice([-1, -9, 0, INT32_MIN])
        elif x < 0.88:
            v = INT32_MAX
        else:
            v = hh - rng.randint(1, 5)  # below history
        out.append(max(INT32_MIN, min(INT32_MAX, v)))
    return out


# ----------------------------------------------------------------------------------------------
# locate_inflight / write_indices harness
# ----------------------------------------------------------------------------------------------


class RowsCase:
    """One selection group's published rows and residency, plus a (possibly corrupted)
    inflight_slots table, as Python data."""

    def __init__(self, rng, *, U, I, S, rows, num_leases, p_missing=0.1, p_corrupt=0.0):
        self.U, self.I, self.S = U, I, S
        self.h, self.c = random_lengths(rng, rows, I, U)
        self.lease = random_leases(rng, rows, num_leases)
        self.resident = build_resident(rng, self.h, self.c, self.lease, U, I, S, num_leases,
                                       p_missing)
        self.located = ref.locate_inflight(self.resident, self.h, self.c, self.lease, U, I)
        self.inflight = corrupt_slots(rng, self.located, S, p_corrupt)

    def lengths(self, device):
        return t32(self.h, device), t32(self.c, device), t32(self.lease, device)


def run_locate(case, device):
    out = torch.full((len(case.lease), ops.max_inflight_units(case.I, case.U)), 777, dtype=I32,
                     device=device)
    resident = t32(case.resident, device)
    before = resident.clone()
    ops.locate_inflight(out, resident, *case.lengths(device), case.U, case.I)
    assert torch.equal(resident, before), "locate_inflight changed resident"
    return out.cpu().tolist()


def run_write(case, device, width):
    rows = len(case.lease)
    out = torch.full((rows, width), 777, dtype=I32, device=device)
    start = torch.full((rows,), 777, dtype=I32, device=device)
    resident, slots = t32(case.resident, device), t32(case.inflight, device)
    before = (resident.clone(), slots.clone())
    ops.write_indices(out, start, resident, slots, *case.lengths(device), case.U, case.I)
    assert torch.equal(resident, before[0]) and torch.equal(slots, before[1]), "inputs changed"
    return out.cpu().tolist(), start.cpu().tolist()


def hand_case(U, I, S, resident, h, c, lease, inflight=None):
    """A RowsCase-like object built by hand."""
    case = SimpleNamespace(U=U, I=I, S=S, resident=resident, h=h, c=c, lease=lease,
                           inflight=inflight)
    case.lengths = lambda d: (t32(case.h, d), t32(case.c, d), t32(case.lease, d))
    return case


def ref_write(case, width):
    return ref.write_indices(case.resident, case.inflight, case.h, case.c, case.lease, case.U,
                             case.I, width)


# (U, I, S): U in {1, 2, 4}; S = ceil(I/U) + 1 is the tightest a lease can be
ROW_CONFIGS = [(1, 3, 6), (2, 5, 8), (4, 6, 6), (2, 4, 3), (1, 1, 4)]


# ----------------------------------------------------------------------------------------------
# locate_inflight
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_locate_inflight_worked_example(device):
    """OP-WRITE / §2 in-flight range: column k holds the slot of unit floor(s0/U)+k while it is
    in flight (s0 = max(h, floor((c-I)/U)*U)), BAD for the rest and for unseated rows."""
    U, I, S = 2, 4, 8  # 3 columns
    resident = [[BAD] * S for _ in range(3)]
    resident[1][5], resident[1][2] = 4, 5  # row 0: h=9, c=12 -> s0=9, units 4, 5
    resident[0][0], resident[0][7], resident[0][3] = 5, 6, 7  # row 1: h=2, c=15 -> s0=10
    resident[0][1] = 1  # a history unit in the prefill's host-direct range: not in flight
    resident[2][4] = 3  # row 3: h=c=7: nothing in flight
    case = hand_case(U, I, S, resident, [9, 2, 5, 7], [12, 15, 9, 7], [1, 0, BAD, 2])
    got = run_locate(case, device)
    assert got == [[5, 2, BAD], [0, 7, 3], [BAD] * 3, [BAD] * 3]
    assert got == ref.locate_inflight(resident, case.h, case.c, case.lease, U, I)
    # a unit that is not resident (here unit 6 of row 1 after it was dropped) reads BAD
    resident[0][7] = BAD
    assert run_locate(case, device)[1] == [0, BAD, 3]


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("U,I,S", ROW_CONFIGS)
def test_locate_inflight_random_matches_reference(device, U, I, S):
    """OP-WRITE / OP-FLUSH (locate_inflight) / SAFE-3: on random lengths (decode, long prefill,
    bad data), leases (holes, out of range, shared) and residency rows with in-flight units at
    random slots (some missing), every column equals the reference; resident is untouched."""
    rng = random.Random(1000 * U + 10 * I + S)
    found = bad_seated = 0
    for _ in range(40):
        case = RowsCase(rng, U=U, I=I, S=S, rows=7, num_leases=5)
        got = run_locate(case, device)
        assert got == case.located, dict(h=case.h, c=case.c, lease=case.lease,
                                         resident=case.resident)
        found += sum(v != BAD for line in got for v in line)
        bad_seated += sum(line.count(BAD) for line, ell in zip(got, case.lease) if 0 <= ell < 5)
    assert found > 40 and bad_seated > 40  # both paths exercised


# ----------------------------------------------------------------------------------------------
# write_indices
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_write_indices_worked_example(device):
    """OP-WRITE: column j of row r is token t = s0 + j's cell token index (l*S + slot)*U + t%U
    (cell index // P, row index % P); BAD past c, for stale records and for unseated rows;
    inflight_start = s0 (BAD when unseated)."""
    U, I, S, P = 2, 4, 8, 4
    resident = [[BAD] * S for _ in range(3)]
    resident[1][5], resident[1][2] = 4, 5
    resident[0][0], resident[0][7], resident[0][3] = 5, 6, 7
    case = hand_case(U, I, S, resident, [9, 2, 5, 7], [12, 15, 9, 7], [1, 0, BAD, 2])
    case.inflight = [[5, 2, BAD], [0, 7, 3], [BAD] * 3, [BAD] * 3]
    width = I + U - 1
    out, start = run_write(case, device, width)
    assert start == [9, 10, BAD, 7]
    assert out[0] == [(8 + 5) * 2 + 1, (8 + 2) * 2, (8 + 2) * 2 + 1, BAD, BAD]
    assert out[1] == [0, 1, 7 * 2, 7 * 2 + 1, 3 * 2]  # a prefill tail fills the whole width
    assert out[2] == [BAD] * width and out[3] == [BAD] * width
    # token 9 (unit 4 at entry 13) is row (13 % 2)*2 + 1 = 3 of cell 13 // 2 = 6
    assert (out[0][0] // P, out[0][0] % P) == (6, 3)
    assert (out, start) == ref_write(case, width)
    # a stale record (slot 2 no longer holds unit 5) and an out-of-range one give BAD only there
    case.inflight = [[5, 6, BAD], [0, 7, 8], [BAD] * 3, [BAD] * 3]
    out, start = run_write(case, device, width + 2)
    assert out[0] == [27, BAD, BAD, BAD, BAD, BAD, BAD]
    assert out[1] == [0, 1, 14, 15, BAD, BAD, BAD]
    assert (out, start) == ref_write(case, width + 2)


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("U,I,S", ROW_CONFIGS)
def test_write_indices_random_matches_reference(device, U, I, S):
    """OP-WRITE / SAFE-3: on random rows (as for locate_inflight) with exact and corrupted
    inflight_slots records (stale, mismatched, out of range), out (width I+U-1 and wider) and
    inflight_start equal the reference; inputs are untouched."""
    rng = random.Random(2000 * U + 10 * I + S)
    valid = stale = 0
    for trial in range(40):
        p_corrupt = 0.0 if trial % 3 == 0 else 0.15
        case = RowsCase(rng, U=U, I=I, S=S, rows=7, num_leases=5, p_corrupt=p_corrupt)
        width = I + U - 1 + rng.choice([0, 0, 3])
        got = run_write(case, device, width)
        want = ref_write(case, width)
        assert got == want, dict(h=case.h, c=case.c, lease=case.lease, resident=case.resident,
                                 inflight=case.inflight)
        clean = ref.write_indices(case.resident, case.located, case.h, case.c, case.lease, U, I,
                                  width)[0]
        valid += sum(v != BAD for line in got[0] for v in line)
        stale += sum(a == BAD and b != BAD for la, lb in zip(got[0], clean)
                     for a, b in zip(la, lb))
    assert valid > 60 and stale > 5  # both paths exercised


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_write_indices_after_locate_chain(device):
    """OP-WRITE: locate_inflight's own output fed to write_indices gives the reference's chain;
    with every in-flight unit resident (RES-2), every token of [s0, c) gets a distinct index
    inside its lease's entries."""
    rng = random.Random(77)
    U, I, S = 2, 5, 8
    for _ in range(20):
        case = RowsCase(rng, U=U, I=I, S=S, rows=6, num_leases=6, p_missing=0.0)
        # keep one row per lease so every lease can hold all its rows' in-flight units
        seen = set()
        case.lease = [ell if ell not in seen and not seen.add(ell) else BAD for ell in case.lease]
        case.resident = build_resident(rng, case.h, case.c, case.lease, U, I, S, 6, 0.0)
        h, c, lease = case.lengths(device)
        slots = torch.full((6, ops.max_inflight_units(I, U)), 777, dtype=I32, device=device)
        resident = t32(case.resident, device)
        ops.locate_inflight(slots, resident, h, c, lease, U, I)
        out = torch.full((6, I + U - 1), 777, dtype=I32, device=device)
        start = torch.full((6,), 777, dtype=I32, device=device)
        ops.write_indices(out, start, resident, slots, h, c, lease, U, I)
        located = ref.locate_inflight(case.resident, case.h, case.c, case.lease, U, I)
        want = ref.write_indices(case.resident, located, case.h, case.c, case.lease, U, I,
                                 I + U - 1)
        assert (out.cpu().tolist(), start.cpu().tolist()) == want
        for r, ell in enumerate(case.lease):
            if not (0 <= ell < 6):
                continue
            rr = ref.RowRange(case.h[r], case.c[r], U, U, I, 0)
            n = max(0, rr.c - rr.s0)
            line = out[r].cpu().tolist()
            assert all(v != BAD for v in line[:n]) and all(v == BAD for v in line[n:])
            assert len(set(line[:n])) == n
            assert all(ell * S * U <= v < (ell + 1) * S * U for v in line[:n])


# ----------------------------------------------------------------------------------------------
# flush harness
# ----------------------------------------------------------------------------------------------


class FlushCase:
    """Random inputs of one flush call: one sparse pool group (scale = buffers + 1, so one
    position is never written) with guard slots before and after, per-buffer cells, one page
    table, and per-selection-group residency and inflight_slots records.

    ``buffers``: (U, I, S, chunks, group) per buffer; buffers of one group share their resident
    and inflight_slots tensors (and must agree on U, I, S)."""

    def __init__(self, rng, gen, *, P, bpt, buffers, rows=6, num_leases=5, p_corrupt=0.12,
                 p_missing=0.08, lengths=None):
        self.P, self.bpt, self.buffers = P, bpt, buffers
        params = {}
        for U, I, S, chunks, g in buffers:
            assert params.setdefault(g, (U, I, S)) == (U, I, S)
        self.groups = sorted(params)
        self.params = params
        I_max = max(p[1] for p in params.values())
        U_max = max(p[0] for p in params.values())
        if lengths is None:
            self.h, self.c = random_lengths(rng, rows, I_max, U_max)
            self.lease = random_leases(rng, rows, num_leases)
            self.new_history = random_new_history(rng, self.h, self.c)
        else:  # (history, capacity, lease, new_history) given
            self.h, self.c, self.lease, self.new_history = (list(x) for x in lengths)
            rows = len(self.h)
        self.resident, self.inflight = {}, {}
        for g, (U, I, S) in params.items():
            res = build_resident(rng, self.h, self.c, self.lease, U, I, S, num_leases, p_missing)
            self.resident[g] = res
            located = ref.locate_inflight(res, self.h, self.c, self.lease, U, I)
            self.inflight[g] = corrupt_slots(rng, located, S, p_corrupt)
        # page table: distinct host slots (no two rows write one page), some BAD / out of range,
        # sometimes narrower than the furthest capacity
        needed = max([ref.ceil_div(max(x, 0), P) for x in self.c if x < 10**6] + [1])
        width = max(1, needed + rng.choice([-2, 0, 0, 1]))
        self.host_slots = rows * width + 2
        perm = rng.sample(range(self.host_slots), rows * width)
        table = []
        for r in range(rows):
            line = []
            for p in range(width):
                x = rng.random()
                if x < 0.08:
                    line.append(BAD)
                elif x < 0.12:
                    line.append(rng.choice([self.host_slots, self.host_slots + 3, INT32_MAX,
                                            -9]))
                else:
                    line.append(perm[r * width + p])
            table.append(line)
        self.page_table = table
        self.scale = len(buffers) + 1
        self.page_bytes = P * bpt
        # [guard, host_slots slots, guard] x scale positions x page bytes
        self.pool = torch.randint(0, 256, (self.host_slots + 2, self.scale, self.page_bytes),
                                  generator=gen, dtype=U8)
        self.cells = []
        for U, I, S, chunks, g in buffers:
            E = P // U
            self.cells.append(torch.randint(0, 256, (num_leases * S // E, chunks, P, bpt // chunks),
                                            generator=gen, dtype=U8))
        self.unit_params = [v for U, I, S, chunks, g in buffers for v in (S, U, I)]

    def pool_args(self, pool):
        """What flush takes for this pool: the inner slots (between the guards) and buffer b at
        position b."""
        return pool[1:-1], list(range(len(self.buffers)))

    def host_views(self, pool):
        """Buffer b's host pages: position b of every inner slot (strided across slots)."""
        inner = pool[1:-1]
        return [inner[:, b].view(self.host_slots, chunks, self.P, self.bpt // chunks)
                for b, (U, I, S, chunks, g) in enumerate(self.buffers)]

    def run(self, device, uva=False):
        """Runs the op; returns the whole pool (on CPU) afterwards. With ``uva`` the pool is a
        CPU tensor the CUDA op reaches through ops.uva_view (what Storage does)."""
        if uva:
            backing = self.pool.clone()
            pool = ops.uva_view(backing)
        else:
            pool = backing = self.pool.clone().to(device)
        cells = [c.to(device) for c in self.cells]
        resident = {g: t32(self.resident[g], device) for g in self.groups}
        inflight = {g: t32(self.inflight[g], device) for g in self.groups}
        table = t32(self.page_table, device)
        lengths = [t32(x, device) for x in (self.new_history, self.h, self.c, self.lease)]
        read_only = [x.clone() for x in cells + list(resident.values()) + list(inflight.values())
                     + [table] + lengths]
        ops.flush(*self.pool_args(pool), cells,
                  [resident[g] for *_, g in self.buffers], [inflight[g] for *_, g in self.buffers],
                  table, *lengths, self.unit_params)
        if device == "cuda":
            torch.cuda.synchronize()
        after = [x for x in cells + list(resident.values()) + list(inflight.values())
                 + [table] + lengths]
        for a, b in zip(read_only, after):
            assert torch.equal(a, b), "flush changed a read-only input"
        return backing.cpu().clone()

    def expected(self):
        """The reference's pool after the flush and its list of copies."""
        host = [ref.pages_from_tensor(v) for v in self.host_views(self.pool)]
        cells = [ref.pages_from_tensor(c) for c in self.cells]
        copies = ref.flush(host, cells, [self.resident[g] for *_, g in self.buffers],
                           [self.inflight[g] for *_, g in self.buffers], self.page_table,
                           self.new_history, self.h, self.c, self.lease, self.unit_params)
        pool = self.pool.clone()
        for b in range(len(self.buffers)):
            data = torch.frombuffer(bytearray(ref.pages_to_bytes(host[b])), dtype=U8)
            pool[1:-1, b] = data.view(self.host_slots, self.page_bytes)
        return pool, copies

    def context(self):
        return dict(h=self.h, c=self.c, lease=self.lease, new_history=self.new_history,
                    resident=self.resident, inflight=self.inflight, page_table=self.page_table)


FLUSH_CONFIGS = {
    # name: (P, bytes per token, [(U, I, S, chunks, group), ...])
    "u1c1": (4, 3, [(1, 3, 8, 1, 0)]),
    "u2c2": (4, 8, [(2, 5, 8, 2, 0)]),
    "u4c2_e1": (4, 6, [(4, 6, 6, 2, 0)]),
    # three selection groups in one pool group; buffers 0 and 1 share a group
    "mixed": (8, 8, [(2, 5, 8, 1, 0), (2, 5, 8, 2, 0), (4, 6, 6, 2, 1), (1, 3, 16, 1, 2)]),
}


# ----------------------------------------------------------------------------------------------
# flush
# ----------------------------------------------------------------------------------------------


def flush_one_buffer(device, host, cells, resident, inflight, table, new_h, h, c, lease, params):
    """Flushes one buffer (host pages ``host`` [slots, chunks, P, B], a pool of scale 1) on
    ``device`` and in the reference; asserts both wrote the same bytes. Returns (the pages after
    the op, the reference's list of copies)."""
    dev_host = host.to(device)
    ops.flush(dev_host.view(len(host), 1, -1), [0], [cells.to(device)], [t32(resident, device)],
              [t32(inflight, device)], t32(table, device), t32(new_h, device), t32(h, device),
              t32(c, device), t32(lease, device), params)
    got = dev_host.cpu()
    ref_host = ref.pages_from_tensor(host)
    copies = ref.flush([ref_host], [ref.pages_from_tensor(cells)], [resident], [inflight], table,
                       new_h, h, c, lease, params)
    assert ref.tensor_bytes(got) == ref.pages_to_bytes(ref_host)
    return got, copies


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_flush_worked_example(device):
    """OP-FLUSH: per seated row exactly the tokens of [s0, min(new_history, c)) are copied,
    chunk by chunk, from cell entry l*S+slot to their host page; the head unit's history token,
    tokens past new_history and a prefill's host-direct range [h, s0) are not written."""
    U, I, S, P, chunks = 2, 4, 8, 4, 2  # E = 2, one byte per token per chunk
    resident = [[BAD] * S for _ in range(2)]
    resident[1][5], resident[1][2] = 4, 5  # row 0: h=9, c=12 -> s0=9, units 4, 5
    resident[0][0], resident[0][7], resident[0][3] = 5, 6, 7  # row 1: h=2, c=15 -> s0=10
    inflight = [[5, 2, BAD], [0, 7, 3], [4, 1, 1]]
    h, c, lease, new_h = [9, 2, 3], [12, 15, 6], [1, 0, BAD], [11, 15, 6]
    cells = (torch.arange(8 * chunks * P, dtype=torch.int32) % 251 + 1).to(U8)
    cells = cells.view(8, chunks, P, 1)
    table = [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    host = torch.zeros(12, chunks, P, 1, dtype=U8)
    got, copies = flush_one_buffer(device, host, cells, resident, inflight, table, new_h, h, c,
                                   lease, [S, U, I])  # the reference agrees
    want = torch.zeros_like(host)
    # row 0: token 9 (unit 4, entry 13 = cell 6 piece 1 -> cell row 3) and token 10 (unit 5,
    # entry 10 = cell 5 piece 0 -> cell row 0) go to host page table[0][2] = 2, rows 1 and 2
    want[2, :, 1] = cells[6, :, 3]
    want[2, :, 2] = cells[5, :, 0]
    # row 1: tokens 10..14: units 5 (entry 0), 6 (entry 7), 7 (entry 3)
    want[6, :, 2] = cells[0, :, 0]
    want[6, :, 3] = cells[0, :, 1]
    want[7, :, 0] = cells[3, :, 2]
    want[7, :, 1] = cells[3, :, 3]
    want[7, :, 2] = cells[1, :, 2]
    assert torch.equal(got, want)
    assert [(r, u, t0, t1) for _, r, u, _, t0, t1 in copies] == [
        (0, 4, 9, 10), (0, 5, 10, 11), (1, 5, 10, 12), (1, 6, 12, 14), (1, 7, 14, 15)]


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_flush_stale_records_bad_pages_copy_nothing(device):
    """OP-FLUSH / SAFE-3: a stale record (its slot holds another unit), an out-of-range slot, a
    BAD page, a page beyond the table and a host slot beyond the pool copy nothing and crash
    nothing; the other units of the same rows are still copied."""
    U, I, S, P = 1, 3, 4, 4  # E = 4: one cell per lease; 4 record columns
    resident = [[7, 8, 9, 6], [2, 3, 4, 5], [12, BAD, BAD, BAD]]
    # row 0: s0 = 7, units 7, 8, 9 at slots 0, 1, 2; the record for unit 8 is stale (slot 3
    #        holds 6); unit 9's page 2 is BAD
    # row 1: s0 = 3, units 3, 4, 5 at slots 1, 2, 3; unit 4's record (7) is out of range;
    #        unit 5's page 1 is BAD
    # row 2: s0 = 12, unit 12 is on page 3, beyond the 3-page table (the next row's page 0
    #        would be host slot 5)
    # row 3 shares lease 1 with row 1: unit 3 is copied, units 4, 5 sit on host slot 99 > pool
    h, c, lease, new_h = [6, 2, 12, 2], [10, 6, 13, 6], [0, 1, 2, 1], [10, 6, 13, 6]
    inflight = [[0, 3, 2, BAD], [1, 7, 3, BAD], [0, BAD, BAD, BAD], [1, 2, 3, BAD]]
    table = [[0, 1, BAD], [3, BAD, 4], [2, 4, 6], [5, 99, 6]]
    host = torch.zeros(7, 1, P, 2, dtype=U8)
    cells = torch.randint(1, 256, (3, 1, P, 2), generator=torch.Generator().manual_seed(3),
                          dtype=U8)
    got, copies = flush_one_buffer(device, host, cells, resident, inflight, table, new_h, h, c,
                                   lease, [S, U, I])  # the reference agrees
    want = torch.zeros_like(host)
    want[1, 0, 3] = cells[0, 0, 0]  # row 0, token 7: entry 0 -> host slot 1, token row 3
    want[3, 0, 3] = cells[1, 0, 1]  # row 1, token 3: entry 5 -> host slot 3, token row 3
    want[5, 0, 3] = cells[1, 0, 1]  # row 3, token 3: entry 5 -> host slot 5, token row 3
    assert torch.equal(got, want)
    assert len(copies) == 3


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("config", list(FLUSH_CONFIGS))
def test_flush_random_matches_reference(device, config):
    """OP-FLUSH / SAFE-1 / SAFE-3: random rows (decode, long prefill, bad lengths, holes, bad
    leases), new_history below, inside and above the in-flight range, corrupted records, BAD and
    out-of-range pages, narrow page tables, strided host views of a pool with scale > 1: the
    whole host pool (guard slots and the unused position included) equals the reference's,
    and cells, residency, records, page table and lengths are unchanged."""
    P, bpt, buffers = FLUSH_CONFIGS[config]
    rng = random.Random(list(FLUSH_CONFIGS).index(config))
    gen = torch.Generator().manual_seed(len(config))
    copies = partial = 0
    for trial in range(25):
        case = FlushCase(rng, gen, P=P, bpt=bpt, buffers=buffers)
        got = case.run(device)
        want, made = case.expected()
        assert torch.equal(got, want), case.context()
        copies += len(made)
        partial += sum(1 for b, _, u, _, t0, t1 in made if t1 - t0 < buffers[b][0])
    assert copies > 50  # the copy path is exercised, partial units included when U > 1
    if any(U > 1 for U, *_ in buffers):
        assert partial > 5


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_flush_zero_size_buffer(device):
    """OP-FLUSH / CFG-6: a zero-size buffer (bytes_per_token = 0) next to a real one copies
    nothing and does not disturb the real buffer's write-back."""
    rng = random.Random(9)
    gen = torch.Generator().manual_seed(9)
    case = FlushCase(rng, gen, P=4, bpt=4, buffers=[(2, 5, 8, 1, 0)], p_corrupt=0.0)
    want, made = case.expected()
    assert made
    pool = case.pool.clone().to(device)
    resident = t32(case.resident[0], device)
    inflight = t32(case.inflight[0], device)
    zero_cells = torch.empty(5 * 8 // 2, 2, 4, 0, dtype=U8, device=device)
    # the zero-size buffer sits at the pool's unused position 1
    ops.flush(*case.pool_args(pool)[:1], [0, 1], [case.cells[0].to(device), zero_cells],
              [resident, resident], [inflight, inflight], t32(case.page_table, device),
              *[t32(x, device) for x in (case.new_history, case.h, case.c, case.lease)],
              case.unit_params * 2)
    assert torch.equal(pool.cpu(), want)


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_writeback_ops_lengths_near_int32_max(device):
    """SAFE-3 (no int32 wrap-around): with lengths at INT32_MAX the in-flight range is still
    [s0, c) — the last unit ends at 2^31 — locate_inflight and write_indices match the
    reference, and flush (new_history = INT32_MAX, pages far beyond the table) terminates and
    writes nothing."""
    U, I, S = 4, 6, 4  # 3 record columns
    h, c = INT32_MAX - 5, INT32_MAX  # s0 = h = 2^31 - 6: units 2^29 - 2 and 2^29 - 1
    u0, u1 = 2**29 - 2, 2**29 - 1
    resident = [[BAD, u1, BAD, u0]]
    case = hand_case(U, I, S, resident, [h, 0], [c, INT32_MAX], [0, BAD])
    located = run_locate(case, device)
    assert located == [[3, 1, BAD], [BAD] * 3]
    assert located == ref.locate_inflight(resident, case.h, case.c, case.lease, U, I)
    case.inflight = located
    out, start = run_write(case, device, I + U - 1)
    assert start == [h, BAD]
    # tokens 2^31-6, -5 (unit u0, entry 3) and 2^31-4 .. -2 (unit u1, entry 1); t = c is not
    assert out[0] == [3 * 4 + 2, 3 * 4 + 3, 4, 5, 6, BAD, BAD, BAD, BAD]
    assert (out, start) == ref_write(case, I + U - 1)
    host = torch.zeros(4, 1, 8, 1, dtype=U8, device=device)
    cells = torch.ones(2, 1, 8, 1, dtype=U8, device=device)  # E = 2: 2 cells hold 4 slots
    for new_h, cap in ((INT32_MAX, c), (INT32_MAX, INT32_MAX - 1), (h + 3, c)):
        ops.flush(host.view(4, 1, 8), [0], [cells], [t32(resident, device)],
                  [t32(located[:1], device)],
                  t32([[0, 1, 2, 3]], device), t32([new_h], device), t32([h], device),
                  t32([cap], device), t32([0], device), [S, U, I])
    assert host.cpu().sum().item() == 0


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_locate_inflight_duplicate_units_bad_data(device):
    """SAFE-3: residency breaking RES-1 (a unit in two slots, negative garbage) never crashes;
    each located slot really holds its unit, and a unit held somewhere is found."""
    rng = random.Random(12)
    U, I, S = 2, 5, 6
    for _ in range(30):
        case = RowsCase(rng, U=U, I=I, S=S, rows=6, num_leases=4)
        for line in case.resident:  # copy a few ordinals over other slots
            for _ in range(2):
                line[rng.randrange(S)] = line[rng.randrange(S)]
        got = run_locate(case, device)
        for r, ell in enumerate(case.lease):
            if not (0 <= ell < 4):
                assert got[r] == [BAD] * len(got[r])
                continue
            rr = ref.RowRange(case.h[r], case.c[r], U, U, I, 0)
            for k, slot in enumerate(got[r]):
                u = rr.s0 // U + k
                if not rr.in_flight(u) or u not in case.resident[ell]:
                    assert slot == BAD, (r, k)
                else:
                    assert 0 <= slot < S and case.resident[ell][slot] == u, (r, k)


# ----------------------------------------------------------------------------------------------
# INT-1: opcheck
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_writeback_ops_opcheck(device):
    """INT-1: locate_inflight, write_indices and flush pass torch.library.opcheck (all default
    utilities) on small samples, flush with two buffers at positions of a scale-3 pool."""
    rng = random.Random(5)
    U, I, S = 2, 5, 8
    case = RowsCase(rng, U=U, I=I, S=S, rows=4, num_leases=3)
    case.h, case.c, case.lease = [3, 0, 9, 4], [7, 13, 9, 6], [2, 0, BAD, 1]
    case.resident = build_resident(rng, case.h, case.c, case.lease, U, I, S, 3, 0.0)
    h, c, lease = case.lengths(device)
    resident = t32(case.resident, device)
    slots = torch.full((4, ops.max_inflight_units(I, U)), 777, dtype=I32, device=device)
    torch.library.opcheck(torch.ops.torch_kvcm2.locate_inflight.default,
                          (slots, resident, h, c, lease, U, I))
    ops.locate_inflight(slots, resident, h, c, lease, U, I)
    out = torch.full((4, I + U - 1), 777, dtype=I32, device=device)
    start = torch.full((4,), 777, dtype=I32, device=device)
    torch.library.opcheck(torch.ops.torch_kvcm2.write_indices.default,
                          (out, start, resident, slots, h, c, lease, U, I))

    gen = torch.Generator().manual_seed(5)
    fc = FlushCase(rng, gen, P=4, bpt=4, buffers=[(2, 5, 8, 1, 0), (1, 3, 4, 2, 1)],
                   num_leases=3, p_corrupt=0.0, p_missing=0.0,
                   lengths=([3, 1, 2], [9, 8, 2], [1, 0, 2], [8, 8, 2]))
    assert fc.expected()[1]  # the sample copies something
    pool = fc.pool.clone().to(device)
    args = (*fc.pool_args(pool), [x.to(device) for x in fc.cells],
            [t32(fc.resident[g], device) for *_, g in fc.buffers],
            [t32(fc.inflight[g], device) for *_, g in fc.buffers], t32(fc.page_table, device),
            *[t32(x, device) for x in (fc.new_history, fc.h, fc.c, fc.lease)], fc.unit_params)
    torch.library.opcheck(torch.ops.torch_kvcm2.flush.default, args)


# ----------------------------------------------------------------------------------------------
# SAFE-3: argument errors
# ----------------------------------------------------------------------------------------------


def _expect_raise(call, watched, label):
    before = [w.clone() for w in watched]
    with pytest.raises(RuntimeError):
        call()
    for w, b in zip(watched, before):
        assert torch.equal(w, b), f"{label}: written before raising"


def _expect_each_raises(op, good, bad, watched):
    """Calls ``op`` once per entry of ``bad`` (label -> (position, value), or a dict of them for
    several changed arguments) with ``good``'s other arguments; each call must raise
    RuntimeError before writing any tensor of ``watched(call)``."""
    for label, change in bad.items():
        call = list(good)
        for i, value in (change.items() if isinstance(change, dict) else [change]):
            call[i] = value
        tensors = [x for x in watched(call) if isinstance(x, torch.Tensor)]
        _expect_raise(lambda: op(*call), tensors, label)


def test_locate_inflight_bad_arguments_raise():
    """SAFE-3: locate_inflight rejects wrong dtypes, shapes, layouts and integer arguments with
    RuntimeError before writing inflight_slots."""
    U, I = 2, 4  # 3 columns
    slots = torch.full((3, 3), 777, dtype=I32)
    resident = torch.full((2, 8), BAD, dtype=I32)
    resident[0, 1] = 4
    h, c, lease = t32([9, 0, 0]), t32([12, 0, 0]), t32([0, BAD, BAD])
    good = [slots, resident, h, c, lease, U, I]
    bad = {
        "slots int64": (0, slots.long()),
        "slots too many columns": (0, torch.full((3, 4), 777, dtype=I32)),
        "slots too few columns": (0, torch.full((3, 2), 777, dtype=I32)),
        "slots 1-D": (0, torch.full((9,), 777, dtype=I32)),
        "slots non-contiguous": (0, torch.full((3, 6), 777, dtype=I32)[:, ::2]),
        "resident int64": (1, resident.long()),
        "resident 1-D": (1, resident.view(-1)),
        "history length": (2, t32([9, 0])),
        "capacity int64": (3, c.long()),
        "lease length": (4, t32([0, BAD, BAD, BAD])),
        "U = 0": (5, 0),
        "I = 0": (6, 0),
        "U changes column count": (5, 1),
    }
    _expect_each_raises(ops.locate_inflight, good, bad, lambda call: (call[0], slots))
    ops.locate_inflight(*good)
    assert slots.tolist() == [[1, BAD, BAD], [BAD] * 3, [BAD] * 3]


def test_write_indices_bad_arguments_raise():
    """SAFE-3 / OP-WRITE: write_indices rejects an out narrower than I+U-1 and wrong dtypes or
    shapes with RuntimeError before writing out or inflight_start."""
    U, I, S = 2, 4, 8
    out = torch.full((2, I + U - 1), 777, dtype=I32)
    start = torch.full((2,), 777, dtype=I32)
    resident = torch.full((2, S), BAD, dtype=I32)
    resident[1, 3] = 5
    slots = t32([[BAD, 3, BAD], [BAD] * 3])
    h, c, lease = t32([9, 0]), t32([12, 0]), t32([1, BAD])
    good = [out, start, resident, slots, h, c, lease, U, I]
    bad = {
        "out too narrow": (0, torch.full((2, I + U - 2), 777, dtype=I32)),
        "out int64": (0, out.long()),
        "out rows": (0, torch.full((3, I + U - 1), 777, dtype=I32)),
        "start length": (1, torch.full((3,), 777, dtype=I32)),
        "start int64": (1, start.long()),
        "resident int64": (2, resident.long()),
        "slots columns": (3, t32([[BAD] * 4, [BAD] * 4])),
        "slots rows": (3, t32([[BAD] * 3])),
        "slots int64": (3, slots.long()),
        "history length": (4, t32([9])),
        "capacity int64": (5, c.long()),
        "lease 2-D": (6, lease.view(2, 1)),
        "U = 0": (7, 0),
        "I = 0": (8, 0),
        "I too wide for out": (8, 5),
    }
    _expect_each_raises(ops.write_indices, good, bad, lambda call: (call[0], call[1], out, start))
    ops.write_indices(*good)
    assert start.tolist() == [9, BAD]
    assert out.tolist() == [[BAD, (8 + 3) * 2, (8 + 3) * 2 + 1, BAD, BAD], [BAD] * 5]


def test_flush_bad_arguments_raise():
    """SAFE-3 / OP-FLUSH: flush rejects list-length mismatches, wrong unit_params, dtypes,
    shapes and page layouts with RuntimeError before writing any host page."""
    rng = random.Random(3)
    gen = torch.Generator().manual_seed(3)
    fc = FlushCase(rng, gen, P=4, bpt=4, buffers=[(2, 5, 8, 1, 0), (2, 5, 8, 2, 0)],
                   num_leases=3, p_corrupt=0.0, p_missing=0.0,
                   lengths=([3, 1, 2], [9, 8, 2], [1, 0, 2], [9, 8, 2]))
    fc.page_table = [[3 * r + p for p in range(3)] for r in range(3)]
    assert fc.host_slots >= 9
    pool = fc.pool.clone()
    inner, positions = fc.pool_args(pool)
    resident, inflight = t32(fc.resident[0]), t32(fc.inflight[0])
    table = t32(fc.page_table)
    nh, h, c, lease = (t32(x) for x in (fc.new_history, fc.h, fc.c, fc.lease))
    good = [inner, positions, list(fc.cells), [resident, resident], [inflight, inflight], table,
            nh, h, c, lease, list(fc.unit_params)]
    cells0 = fc.cells[0]
    slots, scale, page = inner.shape
    bad = {
        "positions short": (1, positions[:1]),
        "position past scale": (1, [0, scale]),
        "position negative": (1, [-1, 1]),
        "host pool 4-D": (0, inner.view(slots, scale, 4, -1)),
        "host pool int8": (0, inner.view(torch.int8)),
        "host pages differ in size": (0, inner[:, :, :-1]),
        "host not contiguous in page": (0, pool.new_zeros(slots, page, scale).transpose(1, 2)),
        "cells list short": (2, fc.cells[:1]),
        "resident list long": (3, [resident] * 3),
        "inflight list short": (4, [inflight]),
        "unit_params short": (10, fc.unit_params[:5]),
        "unit_params long": (10, fc.unit_params + [8, 2, 5]),
        "slots != resident width": (10, [4, 2, 5, 8, 2, 5]),
        "U does not divide P": (10, [8, 3, 5, 8, 2, 5]),
        "S not a multiple of E": {3: [resident[:, :7].contiguous(), resident],
                                  10: [7, 2, 5, 8, 2, 5]},
        "U = 0": (10, [8, 0, 5, 8, 2, 5]),
        "I = 0": (10, [8, 2, 0, 8, 2, 5]),
        "I changes record width": (10, [8, 2, 7, 8, 2, 5]),
        "cells int8": (2, [cells0.view(torch.int8), fc.cells[1]]),
        "cells layout differs": (2, [fc.cells[1][:, :, :, :1].contiguous(), fc.cells[0]]),
        "cells too few": (2, [cells0[:-1].contiguous(), fc.cells[1]]),
        "cells 3-D": (2, [cells0.view(cells0.shape[0], 1, -1), fc.cells[1]]),
        "resident int64": (3, [resident.long(), resident]),
        "inflight int64": (4, [inflight.long(), inflight]),
        "inflight columns": (4, [t32([[BAD] * 5] * 3), inflight]),
        "inflight rows": (4, [inflight[:2].contiguous(), inflight]),
        "page_table int64": (5, table.long()),
        "page_table 1-D": (5, table.view(-1)),
        "new_history length": (6, t32([9, 8])),
        "new_history int64": (6, nh.long()),
        "history length": (7, t32([3, 1, 2, 0])),
        "capacity int64": (8, c.long()),
        "lease length": (9, t32([1, 0])),
    }
    _expect_each_raises(ops.flush, good, bad, lambda call: (pool,))
    ops.flush(*good)
    want, made = fc.expected()
    assert made and torch.equal(pool, want)


# ----------------------------------------------------------------------------------------------
# CUDA: mixed devices, INT-4
# ----------------------------------------------------------------------------------------------


@pytest.mark.cuda
def test_writeback_ops_mixed_devices_raise():
    """SAFE-3: locate_inflight, write_indices and flush refuse a CPU tensor among CUDA ones
    with RuntimeError before writing."""
    U, I, S = 2, 4, 8
    d = "cuda"
    slots = torch.full((2, 3), 777, dtype=I32, device=d)
    out = torch.full((2, 5), 777, dtype=I32, device=d)
    start = torch.full((2,), 777, dtype=I32, device=d)
    resident = torch.full((2, S), BAD, dtype=I32, device=d)
    h, c, lease = t32([9, 0], d), t32([12, 0], d), t32([1, BAD], d)
    args = [slots, resident, h, c, lease, U, I]
    for i in range(1, 5):
        call = list(args)
        call[i] = call[i].cpu()
        _expect_raise(lambda: ops.locate_inflight(*call), [slots], f"locate arg {i}")
    args = [out, start, resident, slots, h, c, lease, U, I]
    for i in range(1, 7):
        call = list(args)
        call[i] = call[i].cpu()
        _expect_raise(lambda: ops.write_indices(*call), [out, start], f"write arg {i}")
    host = torch.zeros(6, 1, 4 * 2, dtype=U8, device=d)
    cells = torch.ones(4 * 2, 1, 4, 2, dtype=U8, device=d)
    table = t32([[0, 1, 2], [3, 4, 5]], d)
    fargs = [host, [0], [cells], [resident], [slots], table, c, h, c, lease, [S, U, I]]
    for i in (0, 2, 3, 4, 5, 6, 7, 8, 9):
        call = list(fargs)
        call[i] = [call[i][0].cpu()] if isinstance(call[i], list) else call[i].cpu()
        _expect_raise(lambda: ops.flush(*call), [host], f"flush arg {i}")


@pytest.mark.cuda
@pytest.mark.parametrize("config", list(FLUSH_CONFIGS))
def test_writeback_ops_cpu_cuda_identical(config):
    """INT-4: identical random inputs give bit-identical locate_inflight, write_indices
    (out, inflight_start) and flush results on CPU and CUDA — flush both into CUDA memory and
    into a CPU pool reached through its UVA view, as Storage does."""
    P, bpt, buffers = FLUSH_CONFIGS[config]
    rng = random.Random(31 + len(config))
    gen = torch.Generator().manual_seed(31)
    for _ in range(10):
        case = FlushCase(rng, gen, P=P, bpt=bpt, buffers=buffers)
        cpu = case.run("cpu")
        assert torch.equal(cpu, case.run("cuda"))
        assert torch.equal(cpu, case.run("cuda", uva=True))
        U, I, S = case.params[case.groups[-1]]
        rows = RowsCase(rng, U=U, I=I, S=S, rows=8, num_leases=5, p_corrupt=0.15)
        assert run_locate(rows, "cpu") == run_locate(rows, "cuda")
        width = I + U - 1 + rng.choice([0, 2])
        assert run_write(rows, "cpu", width) == run_write(rows, "cuda", width)


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_flush_watermark_random_matches_reference(device):
    """OP-FLUSH / SAFE-2: the device watermark op equals the reference rule on random rows
    (holes, prefills with host-direct ranges declared or not, targets below, inside and past
    capacity, one to three in-flight shapes); only ``written`` changes."""
    rng = random.Random(11)
    moved = kept = 0  # seated rows whose watermark moved / stayed although the target was past it
    for trial in range(40):
        R = rng.randint(1, 70)
        shapes = [(rng.choice([1, 2, 4, 64]), rng.randint(0, 40)) for _ in range(rng.randint(1, 3))]
        h = [rng.randint(0, 500) for _ in range(R)]
        c = [x + rng.randint(0, 200) for x in h]
        written = [rng.randint(0, x) for x in c]
        declared = [rng.randint(0, x) for x in c]
        target = [rng.randint(0, x + 20) for x in c]
        lease = [rng.choice([-1, 0, 1, 2, 5]) for _ in range(R)]
        want = ref.flush_watermark(written, declared, target, h, c, lease, shapes)
        t = {name: torch.tensor(v, dtype=torch.int32, device=device)
             for name, v in (("written", written), ("declared", declared), ("target", target),
                             ("h", h), ("c", c), ("lease", lease))}
        before = {k: v.clone() for k, v in t.items()}
        ops.flush_watermark(t["written"], t["declared"], t["target"], t["h"], t["c"], t["lease"],
                            [n for shape in shapes for n in shape])
        assert t["written"].tolist() == want, (trial, shapes)
        assert all(torch.equal(t[k], before[k]) for k in t if k != "written")
        moved += sum(a != b for a, b in zip(want, written))
        kept += sum(a == b and l >= 0 and min(x, y) > b
                    for a, b, l, x, y in zip(want, written, lease, target, c))
    assert moved > 30 and kept > 30  # both outcomes of the rule, many times


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_flush_watermark_rejects_bad_arguments(device):
    """Metadata checks name the argument; nothing changes."""
    z = lambda n=4, dtype=torch.int32: torch.zeros(n, dtype=dtype, device=device)  # noqa: E731
    written = z()
    cases = [
        ((z(4, torch.int64), z(), z(), z(), z(), z(), [1, 0]), "written must be int32"),
        ((written, z(3), z(), z(), z(), z(), [1, 0]), "declared must have shape"),
        ((written, z(), z(), z(), z(), z(), [1]), "shapes must be"),
        ((written, z(), z(), z(), z(), z(), [0, 4]), "tokens_per_unit > 0"),
        ((written, z(), z(), z(), z(), z(), [1, 0] * 17), "shapes must be"),
    ]
    for args, message in cases:
        with pytest.raises(RuntimeError, match=message):
            ops.flush_watermark(*args)
    assert written.tolist() == [0] * 4


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_advance_random_matches_reference(device):
    """HOST-3: the advance op equals the reference rule on random rows (holes; accepted counts
    negative, within, at and past the width, past the flushed watermark; capacities cut at the
    allocated tokens), counters accumulate; lease, written, declared, allocated never change."""
    rng = random.Random(5)
    counts = [0, 0]
    moved = 0
    counters = torch.zeros(2, dtype=torch.int64, device=device)
    for trial in range(40):
        R = rng.randint(1, 700)  # several CTAs on CUDA
        h = [rng.randint(0, 1000) for _ in range(R)]
        c = [x + rng.randint(0, 9) for x in h]
        written = [x + rng.randint(0, 12) for x in h]
        declared = [rng.randint(0, x) for x in c]
        allocated = [x + rng.randint(0, 20) for x in c]
        lease = [rng.choice([-1, 0, 1, 3]) for _ in range(R)]
        accepted = [rng.randint(-2, 12) for _ in range(R)]
        L = [h, c, lease, written, declared, allocated]
        want_h, want_c, refused, short = ref.advance(L, accepted)
        lengths = torch.tensor(L, dtype=torch.int32, device=device)
        ops.advance(lengths, counters, torch.tensor(accepted, dtype=torch.int32, device=device))
        got = lengths.tolist()
        assert got[0] == want_h and got[1] == want_c, trial
        assert got[2:] == L[2:], trial
        counts[0] += refused
        counts[1] += short
        assert counters.tolist() == counts, trial
        moved += sum(a != b for a, b in zip(want_h, h))
    assert min(counts) > 100 and moved > 1000  # refusals, cuts and moves, many times


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_advance_rejects_bad_arguments(device):
    """Metadata checks name the argument; nothing changes."""
    lengths = torch.zeros((6, 4), dtype=torch.int32, device=device)
    counters = torch.zeros(2, dtype=torch.int64, device=device)
    a = torch.zeros(4, dtype=torch.int32, device=device)
    cases = [
        ((lengths[:5], counters, a), "lengths must be contiguous int32"),
        ((lengths.t().contiguous().t(), counters, a), "lengths must be contiguous int32"),
        ((lengths, counters, a.long()), "accepted must be int32"),
        ((lengths, counters, a[:3]), "accepted must have shape"),
        ((lengths, counters.int(), a), "counters must be contiguous int64"),
        ((lengths, counters[:1], a), "counters must be contiguous int64"),
    ]
    for args, message in cases:
        with pytest.raises(RuntimeError, match=message):
            ops.advance(*args)
    assert lengths.abs().sum().item() == 0 and counters.tolist() == [0, 0]


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_clear_leases_random(device):
    """BAT-3: the residency clear of leases that changed owner empties exactly those rows of every
    group (resident BAD, recency 0..S-1), skips leases outside a group's rows, and leaves every
    other row as it was."""
    rng = random.Random(3)
    for trial in range(20):
        shapes = [(rng.randint(1, 9), rng.choice([4, 64, 300])) for _ in range(rng.randint(1, 5))]
        resident = [torch.randint(-1, 50, s, dtype=torch.int32, device=device) for s in shapes]
        recency = [torch.randint(0, 50, s, dtype=torch.int32, device=device) for s in shapes]
        leases = [rng.randint(-1, 10) for _ in range(rng.randint(0, 6))]
        want_res = [t.tolist() for t in resident]
        want_rec = [t.tolist() for t in recency]
        for (rows, S), res, rec in zip(shapes, want_res, want_rec):
            for l in leases:
                if 0 <= l < rows:
                    res[l], rec[l] = [BAD] * S, list(range(S))
        ops.clear_leases(resident, recency, torch.tensor(leases, dtype=torch.int64, device=device))
        assert [t.tolist() for t in resident] == want_res, trial
        assert [t.tolist() for t in recency] == want_rec, trial


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_clear_leases_rejects_bad_arguments(device):
    """Metadata checks name the argument; nothing changes."""
    res = torch.zeros((2, 4), dtype=torch.int32, device=device)
    rec = torch.zeros((2, 4), dtype=torch.int32, device=device)
    one = torch.zeros(1, dtype=torch.int64, device=device)
    cases = [
        (([res], [], one), "one tensor per selection group"),
        (([res], [rec], one.int()), "leases must be contiguous int64"),
        (([res.long()], [rec], one), "resident\\[g\\] must be int32"),
        (([res], [rec[:1]], one), "differ in shape"),
    ]
    for args, message in cases:
        with pytest.raises(RuntimeError, match=message):
            ops.clear_leases(*args)
    assert res.abs().sum().item() == 0 and rec.abs().sum().item() == 0
