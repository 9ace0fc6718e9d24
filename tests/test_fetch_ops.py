"""OP-FETCH at op level against the plain-Python reference (tests/reference.py): host units
copied into cells after a resolve, shared miss lists, chunked layouts, zero-size buffers, bad
device data skipped and bad host arguments refused (state built by ``residency_harness``).
"""
from __future__ import annotations

import random

import pytest
import torch

from torch_kvcm2 import ops

import reference as ref
from conftest import DEVICE_PARAMS
from residency_harness import BAD, I32, Group, Layer, ref_fetch, run_fetch, small_group, t32


# ----------------------------------------------------------------------------------------------
# OP-FETCH
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_op_fetch_after_resolve_copies_host_units(device):
    """OP-FETCH / RES-3: after a resolve, fetch copies each missed unit's bytes from its host page
    (page_table[row, unit // E], piece unit % E) into entry ℓ·S+slot's cell piece."""
    gen = torch.Generator().manual_seed(0)
    g = small_group(device, leases=2, rows=2)
    layer = Layer(device, gen=gen, num_leases=2, S=8, P=4, U=2, chunks=1, bpt=6, host_slots=12,
                  rows=2, max_pages=16)
    g.step([[3, 0, 7, 5], [1, 2, -1, 9]], [32, 32], [32, 32], [1, 0])
    run_fetch([layer], g.miss_list, g.miss_count, 8, 2)
    copies = ref_fetch([layer], g.op_misses(), 8, 2)
    assert copies == 7
    layer.check()
    # RES-3 directly: every resident unit's cell piece equals its host bytes
    E, U, bpc = 2, 2, layer.bpc
    for ell, r in ((1, 0), (0, 1)):
        for slot, u in enumerate(g.resident[ell].cpu().tolist()):
            if u == BAD:
                continue
            entry = ell * 8 + slot
            host = layer.page_table[r, u // E].item()
            want = layer.host[host, 0, (u % E) * U:(u % E + 1) * U].cpu()
            got = layer.cells[entry // E, 0, (entry % E) * U:(entry % E + 1) * U].cpu()
            assert torch.equal(want, got) and got.shape == (U, bpc)


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_op_fetch_two_layers_share_a_miss_list(device):
    """OP-FETCH / selection group: two layers of one group share one resolve and miss list, but
    each fetch fills its own cells from its own host pool (different bytes)."""
    gen = torch.Generator().manual_seed(1)
    g = small_group(device, leases=2, rows=2)
    kw = dict(num_leases=2, S=8, P=4, U=2, chunks=2, bpt=8, host_slots=10, rows=2, max_pages=16)
    a = Layer(device, gen=gen, **kw)
    b = Layer(device, gen=gen, **kw)
    b.page_table = a.page_table.clone()  # same pool group shape; different bytes
    g.step([[3, 0, 7, 5], [1, 2, 4, 9]], [32, 32], [32, 32], [0, 1])
    misses = g.op_misses()
    assert len(misses) == 8
    run_fetch([a], g.miss_list, g.miss_count, 8, 2)
    run_fetch([b], g.miss_list, g.miss_count, 8, 2)
    ref_fetch([a], misses, 8, 2)
    ref_fetch([b], misses, 8, 2)
    a.check()
    b.check()
    assert not torch.equal(a.cells, b.cells)
    for ell, slot, row, unit in misses:
        entry = ell * 8 + slot
        ca = a.cells[entry // 2, :, (entry % 2) * 2:(entry % 2) * 2 + 2]
        cb = b.cells[entry // 2, :, (entry % 2) * 2:(entry % 2) * 2 + 2]
        ha = a.host[a.page_table[row, unit // 2].item(), :, (unit % 2) * 2:(unit % 2) * 2 + 2]
        hb = b.host[b.page_table[row, unit // 2].item(), :, (unit % 2) * 2:(unit % 2) * 2 + 2]
        assert torch.equal(ca, ha) and torch.equal(cb, hb)


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("chunks,P,U,bpt,scale,pos", [
    (1, 4, 2, 6, 1, 0),
    (3, 4, 2, 15, 2, 1),  # head-major, buffer at pos 1 of a coalesced slot (strided host view)
    (4, 8, 2, 8, 3, 2),   # E = 4
    (2, 4, 4, 6, 1, 0),   # E = 1: one unit per cell
    (2, 16, 1, 4, 2, 0),  # U = 1, E = 16
    (1, 16, 8, 512, 1, 0),     # 4-KiB pieces
    (2, 8, 4, 4160, 2, 1),     # 8320-B pieces, head-major, strided host view
    (1, 16, 16, 2048, 1, 0),   # 32-KiB pieces: bulk copies on CUDA, 4 stages each
    (2, 8, 8, 8320, 2, 1),     # 33280-B pieces: 5 stages, the last 512 B; strided host view
])
def test_op_fetch_chunked_layouts(device, chunks, P, U, bpt, scale, pos):
    """OP-FETCH / CFG-2: a unit is `chunks` pieces of U·B/chunks bytes, P·B/chunks apart; fetch
    copies exactly those bytes for every layout, leaving the rest of every cell alone."""
    gen = torch.Generator().manual_seed(chunks * 100 + P)
    E = P // U
    K, I = 4, 3
    S = E * ref.ceil_div(K + ref.ceil_div(I, U) + 1, E)
    g = Group(device, leases=3, rows=3, K=K, U=U, P=P, I=I, S=S)
    layer = Layer(device, gen=gen, num_leases=3, S=S, P=P, U=U, chunks=chunks, bpt=bpt,
                  host_slots=9, rows=3, max_pages=8, scale=scale, pos=pos, bad_page_frac=0.1)
    rng = random.Random(chunks)
    units = 8 * E
    for _ in range(6):
        sel = [[rng.randrange(-1, units) for _ in range(K)] for _ in range(3)]
        hs = [rng.randrange(units * U // 2, units * U + 1) for _ in range(3)]
        cs = [min(units * U, h + rng.randrange(0, I + 2)) for h in hs]
        g.step(sel, hs, cs, [2, 0, 1])
        run_fetch([layer], g.miss_list, g.miss_count, S, U)
        ref_fetch([layer], g.op_misses(), S, U)
        layer.check()


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_op_fetch_zero_size_buffer_skipped(device):
    """OP-FETCH / CFG-6: a zero-size buffer (B = 0) next to a real one is skipped without error;
    the real one is still copied."""
    gen = torch.Generator().manual_seed(2)
    g = small_group(device, leases=1, rows=1)
    real = Layer(device, gen=gen, num_leases=1, S=8, P=4, U=2, chunks=2, bpt=4, host_slots=6,
                 rows=1, max_pages=16)
    zero = Layer(device, gen=gen, num_leases=1, S=8, P=4, U=2, chunks=2, bpt=0, host_slots=6,
                 rows=1, max_pages=16)
    assert zero.cells.numel() == 0 and zero.host.numel() == 0
    before = real.cells.clone()
    g.step([[0, 1, 2, 3]], [16], [16], [0])
    run_fetch([zero, real, zero], g.miss_list, g.miss_count, 8, 2)
    assert ref_fetch([real], g.op_misses(), 8, 2) == 4
    real.check()
    zero.check()
    assert not torch.equal(before, real.cells)
    run_fetch([zero], g.miss_list, g.miss_count, 8, 2)  # only zero-size buffers: a no-op
    run_fetch([], g.miss_list, g.miss_count, 8, 2)  # no buffers at all
    real.check()


@pytest.mark.parametrize("device", DEVICE_PARAMS)
# 6-B, 4-KiB and 32-KiB pieces (CUDA: 2-B vectors, 16-B vectors, bulk copies)
@pytest.mark.parametrize("bpt", [6, 4096, 32768])
def test_op_fetch_bad_device_data_skipped(device, bpt):
    """OP-FETCH / SAFE-3: miss entries with a BAD host page, a host slot past the pool, a row or
    unit past the page table, an entry past the cells, negative fields, or a miss_count beyond
    the list (or negative) never crash and never write out of bounds; good entries still copy."""
    gen = torch.Generator().manual_seed(3)
    S, P, U = 8, 4, 2
    layer = Layer(device, gen=gen, num_leases=2, S=S, P=P, U=U, chunks=2, bpt=bpt, host_slots=5,
                  rows=2, max_pages=4)
    layer.page_table[0, 1] = BAD
    layer.page_table[1, 0] = 5  # == host_slots: out of range
    layer.page_table[1, 1] = 2**31 - 1
    layer.page_table[1, 2] = -9
    layer.ref_cells = ref.pages_from_tensor(layer.cells)
    entries = [
        (0, 0, 0, 0),        # good
        (0, 1, 0, 2),        # BAD host page
        (1, 0, 1, 0),        # host slot == pool size
        (1, 1, 1, 2),        # host slot INT32_MAX
        (1, 2, 1, 4),        # host slot negative (-9)
        (0, 3, 2, 0),        # row past the table
        (0, 4, -1, 0),       # negative row
        (0, 5, 0, 8),        # unit past the page table (page 4 of 4)
        (0, 6, 0, -2),       # negative unit
        (0, 2, 0, -1),       # unit -1 (C division would give page 0, piece -1)
        (2, 0, 0, 1),        # lease past the cells
        (-1, 0, 0, 1),       # negative lease
        (0, -3, 0, 1),       # negative slot
        (2**31 - 1, 2**31 - 1, 0, 1),  # huge entry (overflows int32 arithmetic)
        (1, 7, 0, 7),        # good: last entry of the arena, last unit of the table
    ]
    miss_list = torch.full((len(entries) + 3, 4), 0, dtype=I32)
    miss_list[:len(entries)] = torch.tensor(entries, dtype=I32)
    miss_list = miss_list.to(device)
    for count in (len(entries), len(entries) + 50, -4, 2**31 - 1):
        miss_count = t32([count, 0, 0, 0], device)
        run_fetch([layer], miss_list, miss_count, S, U)
        n = max(0, min(count, miss_list.shape[0]))
        ref_fetch([layer], [tuple(e) for e in miss_list[:n].cpu().tolist()], S, U)
        layer.check()
    assert ref_fetch([layer], entries, S, U) == 2  # the two good ones (and the 3 zero rows)


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("bpt", [4, 2048, 16384])  # 8-B, 4-KiB and 32-KiB pieces
def test_op_fetch_slot_beyond_lease_never_out_of_bounds(device, bpt):
    """OP-FETCH / SAFE-3: an entry whose slot is >= S (bad data) must not write outside the
    cell tensor; whether it aliases another lease's entry is left open (only bounds checked)."""
    gen = torch.Generator().manual_seed(4)
    layer = Layer(device, gen=gen, num_leases=2, S=8, P=4, U=2, chunks=1, bpt=bpt, host_slots=4,
                  rows=1, max_pages=4)
    miss_list = t32([[0, 9, 0, 0], [1, 8, 0, 1], [0, 100, 0, 2]], device)
    run_fetch([layer], miss_list, t32([3, 0, 0, 0], device), 8, 2)
    n = layer.cells.shape[0]
    assert torch.equal(layer._cells[:1], layer._border[0])
    assert torch.equal(layer._cells[n + 1:], layer._border[1])


def test_op_fetch_bad_host_arguments_raise():
    """SAFE-3: fetch rejects mismatched lists, wrong dtypes, page layouts and integer
    arguments before copying anything."""
    gen = torch.Generator().manual_seed(5)
    layer = Layer("cpu", gen=gen, num_leases=1, S=8, P=4, U=2, chunks=1, bpt=4, host_slots=4,
                  rows=1, max_pages=4)
    ml = t32([[0, 0, 0, 0]], "cpu")
    mc = t32([1, 0, 0, 0], "cpu")
    before = layer.cells.clone()
    cells, pool, table = layer.cells, layer.pool, layer.page_table
    calls = [
        lambda: ops.fetch([cells], [], [0], [table], ml, mc, 8, 2),
        lambda: ops.fetch([cells], [pool], [], [table], ml, mc, 8, 2),
        lambda: ops.fetch([cells.view(torch.int8)], [pool], [0], [table], ml, mc, 8, 2),
        lambda: ops.fetch([cells], [pool[:, :, :2].contiguous()], [0], [table], ml, mc, 8, 2),
        lambda: ops.fetch([cells], [layer.host], [0], [table], ml, mc, 8, 2),  # a 4-D view
        lambda: ops.fetch([cells], [pool], [1], [table], ml, mc, 8, 2),  # position past scale
        lambda: ops.fetch([cells], [pool], [-1], [table], ml, mc, 8, 2),
        lambda: ops.fetch([cells], [pool], [0], [table.long()], ml, mc, 8, 2),
        lambda: ops.fetch([cells], [pool], [0], [table], ml[:, :3].contiguous(), mc, 8, 2),
        lambda: ops.fetch([cells], [pool], [0], [table], ml, mc.long(), 8, 2),
        lambda: ops.fetch([cells], [pool], [0], [table], ml, mc[:1], 8, 2),  # not int32[4]
        lambda: ops.fetch([cells], [pool], [0], [table], ml, mc, 0, 2),
        lambda: ops.fetch([cells], [pool], [0], [table], ml, mc, 8, 3),
        lambda: ops.fetch([cells], [pool], [0], [table], ml, mc, 7, 2),
    ]
    for i, call in enumerate(calls):
        with pytest.raises((RuntimeError, ValueError)):
            call()
        assert torch.equal(before, layer.cells), i
