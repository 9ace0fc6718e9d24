"""OP-RESOLVE at op level against the plain-Python reference (tests/reference.py), plus the ops'
opcheck, compile and random sequences (with fetch) against it.

The state tensors are built by hand (``residency_harness.Group``: ``resident = -1``, ``recency =
arange(S)`` per lease, a miss list of ``rows·(K + ceil(I/U) + 1)`` entries, ``miss_count
int32[4]``, ``counters int64[3]``); no Batch or manager is involved. Every resolve is checked
against the reference in full (resident, recency, index table, sorted miss list, counters) and
against RES-1/RES-2; the named scenarios also assert hand-computed values.
"""
from __future__ import annotations

import collections
import random

import pytest
import torch

from torch_kvcm2 import ops

import reference as ref
from conftest import DEVICE_PARAMS
from residency_driver import RandomDriver
from residency_harness import (BAD, I32, SMALL, Group, Layer, ref_fetch, run_fetch, small_group,
                               t32)

# ----------------------------------------------------------------------------------------------
# OP-RESOLVE scenarios
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_op_resolve_cold_start_all_miss(device):
    """OP-RESOLVE step 2/3/5: on a fresh lease every valid selection misses, takes the empty
    slots in recency order, and the miss list holds exactly those (lease, slot, row, unit)."""
    g = small_group(device, leases=3, rows=1)
    index, misses, deltas = g.step([[3, 0, 7, 5]], [32], [32], [2])
    S = g.S
    assert index == [[2 * S + 0, 2 * S + 1, 2 * S + 2, 2 * S + 3]]
    assert misses == sorted([(2, 0, 0, 3), (2, 1, 0, 0), (2, 2, 0, 7), (2, 3, 0, 5)])
    assert deltas == [0, 4, 0]
    assert g.resident[2].cpu().tolist() == [3, 0, 7, 5, BAD, BAD, BAD, BAD]
    # step 4: untouched (the empty slots, old order) first, then the misses
    assert g.recency[2].cpu().tolist() == [4, 5, 6, 7, 0, 1, 2, 3]


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_op_resolve_same_selection_again_all_hits(device):
    """OP-RESOLVE: selecting the same units again hits every one: no misses (miss_count 0),
    the same entries, hits counted."""
    g = small_group(device, rows=1)
    first, _, _ = g.step([[3, 0, 7, 5]], [32], [32], [1])
    index, misses, deltas = g.step([[3, 0, 7, 5]], [32], [32], [1])
    assert index == first
    assert misses == [] and int(g.miss_count[0]) == 0
    assert deltas == [4, 0, 0]
    assert g.counters.cpu().tolist() == [4, 4, 0]
    index, misses, deltas = g.step([[5, 7, 0, 3]], [32], [32], [1])  # order does not matter
    assert index == [[first[0][3], first[0][2], first[0][1], first[0][0]]]
    assert misses == [] and deltas == [4, 0, 0]


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_op_resolve_lru_victim_order(device):
    """OP-RESOLVE step 3: with no empty slot, misses evict the least recently used slots that
    are not hit this step, in recency order."""
    g = small_group(device, rows=1)
    g.step([[0, 1, 2, 3]], [64], [64], [0])  # slots 0..3
    g.step([[4, 5, 6, 7]], [64], [64], [0])  # slots 4..7; recency 0..7
    assert g.recency[0].cpu().tolist() == [0, 1, 2, 3, 4, 5, 6, 7]
    index, misses, deltas = g.step([[2, 8, 9, -1]], [64], [64], [0])
    # unit 2 (slot 2) hits; 8 and 9 evict the two least recent non-hit slots 0 and 1
    assert index == [[2, 0, 1, BAD]]
    assert misses == [(0, 0, 0, 8), (0, 1, 0, 9)]
    assert deltas == [1, 2, 0]
    assert g.resident[0].cpu().tolist() == [8, 9, 2, 3, 4, 5, 6, 7]
    assert g.recency[0].cpu().tolist() == [3, 4, 5, 6, 7, 0, 1, 2]
    index, misses, _ = g.step([[0, -1, -1, -1]], [64], [64], [0])
    assert index == [[3, BAD, BAD, BAD]]  # slot 3 was least recent: unit 3 evicted
    assert misses == [(0, 3, 0, 0)]
    assert g.slot_of(0, 3) is None


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_op_resolve_hits_promoted_above_misses(device):
    """OP-RESOLVE step 4: new recency = untouched, misses, pinned, hits — hits are most recent,
    so a unit picked again and again outlives one-off picks."""
    g = small_group(device, rows=1)
    g.step([[0, 1, 2, 3]], [64], [64], [0])
    g.step([[4, 5, 6, 7]], [64], [64], [0])
    # unit 0 is hit every step while fresh units stream through: it must never be evicted
    for u in range(8, 40, 3):
        index, _, _ = g.step([[u, 0, u + 1, u + 2]], [128], [128], [0])
        rec = g.recency[0].cpu().tolist()
        assert rec[-1] == g.slot_of(0, 0)  # the hit is the most recent slot
        misses_slots = {index[0][0], index[0][2], index[0][3]}
        assert set(rec[-4:-1]) == misses_slots  # misses just below it
    assert g.slot_of(0, 0) is not None


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_op_resolve_duplicates_share_one_slot(device):
    """OP-RESOLVE step 2: duplicates within a row share one slot, are fetched once and counted
    once."""
    g = small_group(device, rows=1)
    index, misses, deltas = g.step([[5, 5, 6, 5]], [32], [32], [0])
    assert index == [[0, 0, 1, 0]]
    assert misses == [(0, 0, 0, 5), (0, 1, 0, 6)]
    assert deltas == [0, 2, 0]
    index, misses, deltas = g.step([[6, 7, 7, 6]], [32], [32], [0])
    assert index == [[1, 2, 2, 1]]
    assert misses == [(0, 2, 0, 7)]
    assert deltas == [1, 1, 0]


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_op_resolve_padding_is_bad_and_uncounted(device):
    """OP-RESOLVE step 2: negative entries are padding: BAD, no slot, not counted."""
    g = small_group(device, rows=1)
    index, misses, deltas = g.step([[-1, -1, -5, -2**31]], [32], [32], [0])
    assert index == [[BAD] * 4] and misses == [] and deltas == [0, 0, 0]
    assert g.resident[0].cpu().tolist() == [BAD] * 8
    index, misses, deltas = g.step([[-1, 4, -1, -3]], [32], [32], [0])
    assert index == [[BAD, 0, BAD, BAD]] and deltas == [0, 1, 0]


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_op_resolve_out_of_range_ordinals_invalid(device):
    """OP-RESOLVE step 2 / SAFE-3: ordinals that are not selectable (partly or not yet history,
    beyond capacity, huge values near INT32_MAX) are BAD and counted invalid, once each."""
    g = small_group(device, rows=1)
    # h = c = 15: unit 7 covers [14, 16) and is not wholly history; no in-flight range
    huge = 2**31 - 1
    index, misses, deltas = g.step([[7, 100, huge, 6]], [15], [15], [0])
    assert index == [[BAD, BAD, BAD, 0]]
    assert misses == [(0, 0, 0, 6)]
    assert deltas == [0, 1, 3]
    index, misses, deltas = g.step([[huge, huge, 2**30, 2**30 - 1]], [15], [15], [0])
    assert index == [[BAD] * 4] and misses == [] and deltas == [0, 0, 3]


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_op_resolve_huge_history_no_overflow(device):
    """OP-RESOLVE / SAFE-3: with history near INT32_MAX (bad device data), unit arithmetic must
    not wrap: unit 2^30-1 ends at 2^31 > h and is not selectable, unit 2^30-2 is."""
    g = small_group(device, rows=1)
    h = 2**31 - 1
    index, misses, deltas = g.step([[2**30 - 1, 2**30 - 2, 2**30, -1]], [h], [h], [0])
    assert index == [[BAD, 0, BAD, BAD]]
    assert deltas == [0, 1, 2]


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_op_resolve_unseated_rows_untouched(device):
    """OP-RESOLVE / RES-4: rows whose lease is -1 (a hole, a suspended row) or out of range get
    an all-BAD index-table row and touch no residency, no miss list entry and no counter."""
    g = small_group(device, leases=3, rows=3)
    g.step([[0, 1, 2, 3], [-1] * 4, [-1] * 4], [32, 0, 0], [32, 0, 0], [1, -1, -1])
    before = (g.resident.cpu().clone(), g.recency.cpu().clone())
    # lease 1 is unseated now; row 2 has a bad lease (3 == num_leases), row 1 a negative one
    index, misses, deltas = g.step([[4, 5, 6, 7], [0, 1, 2, 3], [0, 1, 2, 3]],
                                   [32, 32, 32], [32, 36, 36], [0, -1, 3])
    assert index[1] == [BAD] * 4 and index[2] == [BAD] * 4
    assert all(m[0] == 0 and m[2] == 0 for m in misses)
    assert deltas == [0, 4, 0]  # only row 0 counted
    assert torch.equal(g.resident[1].cpu(), before[0][1])
    assert torch.equal(g.recency[1].cpu(), before[1][1])
    assert torch.equal(g.resident[2].cpu(), before[0][2])


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_op_resolve_rows_independent(device):
    """OP-RESOLVE: each row works on its own lease only; running rows together equals running
    each alone (same entries up to the lease offset, same per-lease state)."""
    sels = [[3, 1, 3, -1], [9, 2, 8, 7], [0, 1, 2, 3]]
    hs, cs = [40, 20, 31], [40, 22, 33]
    together = small_group(device, leases=4, rows=3)
    t_index, t_misses, _ = together.step(sels, hs, cs, [3, 0, 2])
    for r, ell in enumerate([3, 0, 2]):
        alone = small_group(device, leases=4, rows=1)
        a_index, a_misses, _ = alone.step([sels[r]], [hs[r]], [cs[r]], [ell])
        assert a_index[0] == t_index[r]
        assert [(m[0], m[1], r, m[3]) for m in a_misses] == [m for m in t_misses if m[2] == r]
        assert torch.equal(alone.resident[ell], together.resident[ell])
        assert torch.equal(alone.recency[ell], together.recency[ell])


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_op_resolve_inflight_admitted_and_pinned(device):
    """OP-RESOLVE step 1 / RES-2: in-flight units (overlapping [s0, c)) are admitted without a
    fetch when they start at or above h, never evicted while in flight, and a selected
    in-flight unit counts as a hit."""
    g = small_group(device, rows=1)
    # h = 8, c = 11, I = 4: s0 = max(8, floor(7/2)*2) = 8, in-flight units 4 and 5
    index, misses, deltas = g.step([[5, 0, -1, -1]], [8], [11], [0])
    s4, s5 = g.slot_of(0, 4), g.slot_of(0, 5)
    assert (s4, s5) == (0, 1)  # admissions take victims first, ascending unit order
    assert misses == [(0, 2, 0, 0)]  # only the selected history unit 0 is fetched
    assert deltas == [1, 1, 0]  # unit 5 is in flight: a hit, admitted in step 1
    assert index == [[s5, 2, BAD, BAD]]
    # recency: untouched, misses (slot 2), pinned (slot 0 holds unit 4), hits (slot 1: unit 5)
    assert g.recency[0].cpu().tolist() == [3, 4, 5, 6, 7, 2, 0, 1]
    # stream many fresh history selections: the in-flight units are never victims
    for base in (0, 4, 1, 3, 0):  # (units 0..3 only: h = 8 -> units 0..3 are history)
        sel = [(base + k) % 4 for k in range(4)]
        g.step([sel], [8], [11], [0])
        assert (g.slot_of(0, 4), g.slot_of(0, 5)) == (s4, s5)


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_op_resolve_pinned_never_victims_under_pressure(device):
    """OP-RESOLVE step 3 / SAFE-1: with every slot needed (K misses + full in-flight range), the
    pinned in-flight units keep their slots and each step's misses evict only old picks."""
    g = small_group(device, rows=1)
    # h = 9, c = 12: s0 = max(9, 8) = 9 -> units 4, 5 in flight (4 is a partly written head)
    g.step([[-1] * 4], [9], [12], [0])
    pinned = (g.slot_of(0, 4), g.slot_of(0, 5))
    for step in range(6):
        sel = [(4 * step + k) % 4 for k in range(4)]  # units 0..3 (the history units)
        g.step([sel], [9], [12], [0])
        assert (g.slot_of(0, 4), g.slot_of(0, 5)) == pinned


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_op_resolve_partly_written_head_unit_fetched(device):
    """OP-RESOLVE step 1: an in-flight unit that starts below h (a partly written head unit) is
    admitted AND put on the miss list, so its history part is fetched; not counted as a miss."""
    g = small_group(device, rows=1)
    # h = 9, c = 11: s0 = 9, in-flight units 4 ([8,10), starts below h) and 5
    index, misses, deltas = g.step([[-1] * 4], [9], [11], [0])
    s4 = g.slot_of(0, 4)
    assert misses == [(0, s4, 0, 4)]
    assert g.slot_of(0, 5) is not None
    assert deltas == [0, 0, 0]
    # once resident it is pinned, not fetched again
    index, misses, deltas = g.step([[4, -1, -1, -1]], [9], [11], [0])
    assert misses == [] and deltas == [1, 0, 0] and index[0][0] == s4


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_op_resolve_long_prefill_host_direct_not_selectable(device):
    """OP-RESOLVE: units in [h, s0) (a long prefill written straight to host) are neither
    admitted nor selectable; the in-flight range is only the last I tokens (rounded to U)."""
    g = small_group(device, rows=1)
    # h = 2, c = 15, I = 4: s0 = max(2, floor(11/2)*2) = 10 -> in-flight units 5, 6, 7
    index, misses, deltas = g.step([[0, 1, 3, 6]], [2], [15], [0])
    assert sorted(u for u in g.resident[0].cpu().tolist() if u != BAD) == [0, 5, 6, 7]
    assert index[0][1] == BAD and index[0][2] == BAD  # units 1 ([2,4)) and 3: host-direct
    assert deltas == [1, 1, 2]  # 6 in-flight hit; 0 miss; 1 and 3 invalid


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_op_resolve_drops_units_no_longer_selectable(device):
    """OP-RESOLVE step 0: resident units that stop being selectable are dropped — after a
    capacity shrink, when a range becomes host-direct, and when a window releases its page."""
    g = small_group(device, rows=1)
    g.step([[0, 1, -1, -1]], [8], [11], [0])  # units 0, 1 (history) and 4, 5 (in flight)
    assert {4, 5} <= set(g.resident[0].cpu().tolist())
    # capacity shrinks back to h: units 4, 5 are no longer in flight nor history
    g.step([[-1] * 4], [8], [8], [0])
    assert sorted(u for u in g.resident[0].cpu().tolist() if u != BAD) == [0, 1]
    # in flight again, then a long jump of capacity makes [8, 16) host-direct
    g.step([[-1] * 4], [8], [11], [0])
    assert {4, 5} <= set(g.resident[0].cpu().tolist())
    index, _, deltas = g.step([[4, -1, -1, -1]], [8], [20], [0])  # s0 = 16
    assert 4 not in g.resident[0].cpu().tolist() and 5 not in g.resident[0].cpu().tolist()
    assert index[0][0] == BAD and deltas[2] == 1


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_op_resolve_window_releases_units(device):
    """OP-RESOLVE (DESIGN windowed decision): units on pages p < floor((h - window)/P) are not
    selectable; resident ones are dropped and selecting them is invalid."""
    g = small_group(device, rows=1, window=8)
    g.step([[0, 1, 2, 5]], [12], [12], [0])  # h - window = 4: page 0 (units 0,1) is released
    assert sorted(u for u in g.resident[0].cpu().tolist() if u != BAD) == [2, 5]
    assert g.counters.cpu().tolist() == [0, 2, 2]
    index, _, _ = g.step([[2, 5, 6, -1]], [20], [20], [0])  # page < 3 released: units 0..5
    assert index[0][:2] == [BAD, BAD]
    assert sorted(u for u in g.resident[0].cpu().tolist() if u != BAD) == [6]


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_op_resolve_no_victim_left_is_bad_and_counted(device):
    """OP-RESOLVE (bad input, S below CFG-3's minimum): a miss that finds no victim gets BAD
    and counts as invalid instead of a miss; the state stays consistent (RES-1)."""
    g = Group(device, leases=1, rows=1, U=1, P=2, I=1, K=4, S=2)
    index, misses, deltas = g.step([[0, 1, 2, 3]], [8], [8], [0])
    assert index == [[0, 1, BAD, BAD]]
    assert len(misses) == 2 and deltas == [0, 2, 2]


NASTY = [-2**31, -7, -1, 0, 1, 3, 15, 16, 2**30, 2**31 - 1]


def nasty_step(rng, history_values):
    sel = [[rng.choice(NASTY + list(range(12))) for _ in range(4)] for _ in range(4)]
    h = [rng.choice(history_values) for _ in range(4)]
    c = [rng.choice(NASTY) for _ in range(4)]
    lease = [rng.choice([-5, -1, 0, 1, 2, 3, 99]) for _ in range(4)]
    # two rows sharing a lease would be a data race on CUDA: keep leases distinct
    seen = set()
    lease = [ell if ell not in seen and not seen.add(ell) else -1 for ell in lease]
    return sel, h, c, lease


def check_index_rows(g, lease):
    index = g.index_table.cpu()
    for r, ell in enumerate(lease):
        row = index[r].tolist()
        if not (0 <= ell < g.num_leases):
            assert row == [BAD] * g.K
        else:
            assert all(v == BAD or ell * g.S <= v < (ell + 1) * g.S for v in row)
    n = int(g.miss_count[0])
    assert 0 <= n <= g.miss_list.shape[0]


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("writes", [False, True])
def test_op_resolve_bad_device_data_matches_reference(device, writes):
    """SAFE-3 / OP-RESOLVE: bad device data with a non-negative history (leases out of range,
    history above capacity, negative or huge capacities, huge ordinals) never crashes, never
    writes outside the state tensors, keeps RES-1/RES-4 and gives exactly the reference's
    results (no int32 wrap-around anywhere); with ``writes`` its write outputs are the
    write_indices op's."""
    g = Group(device, leases=3, rows=4, guard=True, writes=writes, **SMALL)
    rng = random.Random(5)
    for _ in range(300):
        sel, h, c, lease = nasty_step(rng, [x for x in NASTY if x >= 0])
        g.step(sel, h, c, lease)  # full reference comparison, borders, RES-1, RES-4
        check_index_rows(g, lease)


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("writes", [False, True])
def test_op_resolve_bad_device_data_no_crash(device, writes):
    """SAFE-3: fully bad device data (negative histories too) never crashes, never writes
    outside the state tensors, keeps no ordinal twice (RES-1) and leaves unseated leases alone
    (RES-4). Results are not compared with the reference: see test_op_resolve_negative_history_*
    for why; with ``writes`` the write outputs are compared with the write_indices op's."""
    g = Group(device, leases=3, rows=4, guard=True, writes=writes, **SMALL)
    rng = random.Random(6)
    for _ in range(300):
        sel, h, c, lease = nasty_step(rng, NASTY)
        g.step(sel, h, c, lease, check_ref=False, allow_negative=True)
        check_index_rows(g, lease)


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_op_resolve_unit_resident_twice_matches_reference(device):
    """SAFE-3 / INT-4 with RES-1 broken by bad device data: a unit held by two slots is served
    by its lowest slot (the CPU's slot_of.emplace), and when its other slot is reused as a
    victim the unit is forgotten (the CPU's erase), so its columns read BAD. Every device and
    the reference agree on every output."""
    g = small_group(device, leases=1, rows=1)
    h = c = 40  # U = 2: units 0..19 are history
    resident = [5, 5, 6, BAD, 5, 7, 8, 9]  # unit 5 in slots 0, 1 and 4
    g.resident[0] = t32(resident, device)
    g.ref.resident[0] = list(resident)
    # Unit 5 hits in slot 0; misses 10, 11, 12 take the empty slot 3, then the evictable slots
    # in recency order: 1 (unit 5 again: its erase hides slot 0 from the index table) and 2.
    # Then slot 4 (unit 5 a third time) is reused: the second erase finds nothing to forget.
    steps = [[5, 10, 11, 12], [13, 14, 15, 5], [5, 7, 8, 9]]
    for sel in steps:
        before = g.ref.clone()
        g.run_op([sel], [h], [c], [0])
        want_index, want_misses, _ = ref.resolve(g.ref, [sel], [h], [c], [0], g.U, g.P, g.I)
        ctx = dict(selected=sel, before=before.resident[0])
        assert g.index_table.cpu().tolist() == want_index, ctx
        assert sorted(g.op_misses()) == sorted(want_misses), ctx
        assert g.resident.cpu().tolist() == g.ref.resident, ctx
        assert g.recency.cpu().tolist() == g.ref.recency, ctx
        assert g.counters.cpu().tolist() == g.ref.counters, ctx
    # the first step's hidden unit: column 0 (unit 5) reads BAD although slot 0 still holds it
    first = ref.resolve(ref.ResidencyState([list(resident)], [list(range(8))], [0, 0, 0]),
                        [steps[0]], [h], [c], [0], g.U, g.P, g.I)[0]
    assert first[0][0] == BAD and first[0][1:] == [3, 1, 2], first


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_op_resolve_negative_history_stores_no_negative_units(device):
    """SAFE-3 (bad device data never corrupts): a negative history reads as 0 and a capacity below
    history as history, so resolve never stores negative ordinals or lists negative units."""
    g = small_group(device, leases=1, rows=1)
    g.run_op([[-1] * 4], [-7], [-2], [0])  # s0 = -6: units -3, -2 would be "in flight"
    assert all(u == BAD or u >= 0 for u in g.resident[0].cpu().tolist()), g.resident.tolist()
    g.run_op([[-1] * 4], [-1], [1], [0])  # s0 = -1: unit -1 would be "in flight", head unit
    assert all(m[3] >= 0 for m in g.op_misses()), g.op_misses()


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_op_resolve_matches_reference_on_sane_odd_lengths(device):
    """OP-RESOLVE vs reference when history exceeds capacity (no in-flight range) and for
    capacities/histories near INT32_MAX (pure arithmetic, no wrap-around)."""
    g = small_group(device, leases=2, rows=2)
    g.step([[0, 1, 2, 9], [0, 1, 5, 6]], [10, 13], [6, 13], [0, 1])
    big = 2**31 - 2
    g.step([[0, 1, 2**30 - 2, 2**30 - 1], [3, 4, 5, 6]], [big, big - 3], [big, big], [0, 1])


def test_op_resolve_bad_host_arguments_raise():
    """SAFE-3: wrong dtype, shape or integer arguments raise before any state changes."""
    g = small_group("cpu", rows=1)
    sel, h, c, lease = t32([[0, 1, 2, 3]], "cpu"), t32([8], "cpu"), t32([8], "cpu"), t32([0], "cpu")
    args = [g.resident, g.recency, g.index_table, g.miss_list, g.miss_count, g.counters,
            g.inflight_slots, sel, h, c, lease, 2, 4, 4, 0]
    snapshot = [a.clone() for a in args[:7]]
    bad = {
        0: g.resident.long(), 1: g.recency[:, :4].contiguous(), 2: g.index_table[:, :2].contiguous(),
        3: g.miss_list[:5].contiguous(), 4: torch.zeros(2, dtype=I32),
        5: torch.zeros(3, dtype=I32), 6: g.inflight_slots[:, :2].contiguous(), 7: sel.long(),
        8: t32([8, 8], "cpu"), 10: lease.long(),
        11: 3,  # U does not divide P
        12: 0, 13: 0, 14: -1,
    }
    for i, value in bad.items():
        call = list(args)
        call[i] = value
        with pytest.raises((RuntimeError, ValueError)):
            ops.resolve(*call)
    # S not a multiple of E = P/U
    with pytest.raises((RuntimeError, ValueError)):
        ops.resolve(g.resident[:, :7].contiguous(), g.recency[:, :7].contiguous(), *args[2:])
    # the write outputs: both or neither, write_indices' rules, one row per selected row
    table, start = torch.zeros(1, 5, dtype=I32), torch.zeros(1, dtype=I32)
    for writes, name in (((table, None), "write_start"), ((None, start), "write_start"),
                         ((table.long(), start), "write_table"),
                         ((table[:, :4], start), "write_table"),
                         ((torch.zeros(2, 5, dtype=I32), torch.zeros(2, dtype=I32)),
                          "write_table")):
        with pytest.raises((RuntimeError, ValueError), match=name):
            ops.resolve(*args, None, *writes)
    for a, b in zip(args[:7], snapshot):
        assert torch.equal(a, b)
    assert table.tolist() == [[0] * 5] and start.tolist() == [0]
    ops.resolve(*args)  # the good call works
    assert g.counters.tolist() == [0, 4, 0]


def test_op_resolve_step_bad_arguments_change_nothing():
    """OP-STEP, SAFE-3: resolve_step checks every argument (its resolve's, its write outputs',
    its fetch's) before any part runs: a bad fetch argument leaves residency, the miss list and
    the cells untouched."""
    g = small_group("cpu", rows=1, writes=True)
    layer = Layer("cpu", gen=torch.Generator().manual_seed(1), num_leases=2, S=8, P=4, U=2,
                  chunks=1, bpt=4, host_slots=4, rows=1, max_pages=4)
    sel, h, c, lease = t32([[0, 1, 2, 3]], "cpu"), t32([8], "cpu"), t32([8], "cpu"), t32([0], "cpu")
    good = [g.resident, g.recency, g.index_table, g.miss_list, g.miss_count, g.counters,
            g.inflight_slots, g.write_table, g.write_start, [layer.cells], sel, h, c, lease,
            [layer.pool], [layer.pos], [layer.page_table], 2, 4, 4, 0]
    watched = good[:9] + [layer.cells]
    before = [t.clone() for t in watched]
    bad = {"fetch positions": (15, [layer.pos, 0]), "fetch page table": (16, [layer.page_table.long()]),
           "fetch cells": (9, [layer.cells.view(torch.int32)]), "write start": (8, h.long()),
           "write table": (7, g.write_table[:, :2].contiguous()),
           "pools without cells": (9, [])}
    for label, (i, value) in bad.items():
        call = list(good)
        call[i] = value
        with pytest.raises((RuntimeError, ValueError)):
            ops.resolve_step(*call)
        for t, b in zip(watched, before):
            assert torch.equal(t, b), f"{label}: written before raising"
    ops.resolve_step(*good)  # the good call resolves, writes and fetches
    assert g.counters.tolist() == [0, 4, 0] and int(g.miss_count[0]) > 0
    assert not torch.equal(layer.cells, before[-1])


# ----------------------------------------------------------------------------------------------
# INT-1
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_op_resolve_and_fetch_opcheck(device):
    """INT-1: resolve and fetch pass torch.library.opcheck (all default utilities) on small
    samples, from a non-trivial state (after a warm-up step)."""
    g = small_group(device, leases=2, rows=2)
    g.step([[3, 0, 7, 5], [1, 2, -1, 9]], [32, 9], [32, 11], [1, 0])
    sel, h, c, lease = (t32([[3, 8, 8, -1], [4, 2, 6, 1]], device), t32([32, 9], device),
                        t32([32, 11], device), t32([1, 0], device))
    torch.library.opcheck(
        torch.ops.torch_kvcm2.resolve.default,
        (g.resident, g.recency, g.index_table, g.miss_list, g.miss_count, g.counters,
         g.inflight_slots, sel, h, c, lease, 2, 4, 4, 0))
    torch.library.opcheck(  # a window of 8 with 4 sink tokens (TIER-3)
        torch.ops.torch_kvcm2.resolve.default,
        (g.resident, g.recency, g.index_table, g.miss_list, g.miss_count, g.counters,
         g.inflight_slots, sel, h, c, lease, 2, 4, 4, 8, None, None, None, 4))
    gen = torch.Generator().manual_seed(6)
    layers = [Layer(device, gen=gen, num_leases=2, S=8, P=4, U=2, chunks=c_, bpt=4 * c_,
                    host_slots=6, rows=2, max_pages=16, guard=False) for c_ in (1, 2)]
    torch.library.opcheck(
        torch.ops.torch_kvcm2.fetch.default,
        ([l.cells for l in layers], [l.pool for l in layers], [l.pos for l in layers],
         [l.page_table for l in layers], g.miss_list, g.miss_count, 8, 2))
    # opcheck works on copies; the state is unchanged and still agrees with the reference
    assert g.resident.cpu().tolist() == g.ref.resident
    g.step([[3, 8, 8, -1], [4, 2, 6, 1]], [32, 9], [32, 11], [1, 0])


@pytest.mark.cuda
def test_op_resolve_and_fetch_mixed_devices_raise():
    """SAFE-3: resolve and fetch refuse tensors on different devices before touching state."""
    g = small_group("cuda", rows=1)
    sel, h, c, lease = (t32([[0, 1, 2, 3]], "cuda"), t32([8], "cuda"), t32([8], "cuda"),
                        t32([0], "cuda"))
    args = [g.resident, g.recency, g.index_table, g.miss_list, g.miss_count, g.counters,
            g.inflight_slots, sel, h, c, lease, 2, 4, 4, 0]
    for i in range(11):
        call = list(args)
        call[i] = call[i].cpu()
        with pytest.raises(RuntimeError):
            ops.resolve(*call)
    assert g.resident.cpu().tolist() == [[BAD] * 8] * 2 and g.counters.cpu().tolist() == [0] * 3
    gen = torch.Generator().manual_seed(7)
    layer = Layer("cuda", gen=gen, num_leases=2, S=8, P=4, U=2, chunks=1, bpt=4, host_slots=4,
                  rows=1, max_pages=4)
    ops.resolve(*args)
    before = layer.cells.clone()
    for which in range(5):
        parts = [[layer.cells], [layer.pool], [layer.page_table], g.miss_list, g.miss_count]
        if which < 3:
            parts[which] = [parts[which][0].cpu()]
        else:
            parts[which] = parts[which].cpu()
        with pytest.raises(RuntimeError):
            ops.fetch(parts[0], parts[1], [0], *parts[2:], 8, 2)
    assert torch.equal(before, layer.cells)


def test_op_resolve_fetch_torch_compile_fullgraph_equals_eager():
    """INT-2 (op level): a function calling resolve then fetch compiles with fullgraph=True on
    CPU, and the mutated state, outputs and cells equal eager execution (and the reference)."""
    torch._dynamo.reset()

    def step(resident, recency, index_table, miss_list, miss_count, counters, inflight_slots,
             selected, history, capacity, lease, cells, pool, page_table):
        ops.resolve(resident, recency, index_table, miss_list, miss_count, counters,
                    inflight_slots, selected, history, capacity, lease, 2, 4, 4, 0)
        ops.fetch([cells], [pool], [0], [page_table], miss_list, miss_count, 8, 2)
        return index_table.clone()

    gen = torch.Generator().manual_seed(8)
    layer = Layer("cpu", gen=gen, num_leases=2, S=8, P=4, U=2, chunks=2, bpt=4, host_slots=6,
                  rows=2, max_pages=8, guard=False)
    compiled = torch.compile(step, fullgraph=True)
    eager_g, comp_g = small_group("cpu", rows=2), small_group("cpu", rows=2)
    eager_cells, comp_cells = layer.cells.clone(), layer.cells.clone()
    steps = [([[3, 0, 7, 5], [1, 2, -1, 9]], [32, 9], [32, 11], [1, 0]),
             ([[3, 8, 8, -1], [4, 2, 6, 1]], [32, 9], [32, 12], [1, 0]),
             ([[9, 10, 11, 12], [0, 1, 2, 3]], [30, 12], [31, 12], [0, 1])]
    for sel, h, c, lease in steps:
        outs = []
        for g, cells, fn in ((eager_g, eager_cells, step), (comp_g, comp_cells, compiled)):
            tensors = (t32(sel, "cpu"), t32(h, "cpu"), t32(c, "cpu"), t32(lease, "cpu"))
            outs.append(fn(g.resident, g.recency, g.index_table, g.miss_list, g.miss_count,
                           g.counters, g.inflight_slots, *tensors, cells, layer.pool,
                           layer.page_table))
        assert torch.equal(outs[0], outs[1])
        for name in ("resident", "recency", "index_table", "miss_count", "counters",
                     "inflight_slots"):
            assert torch.equal(getattr(eager_g, name), getattr(comp_g, name)), name
        assert eager_g.op_misses() == comp_g.op_misses()
        assert torch.equal(eager_cells, comp_cells)
        want_index, _, _ = ref.resolve(eager_g.ref, sel, h, c, lease, 2, 4, 4, 0)
        assert outs[0].tolist() == want_index
    assert eager_g.resident.tolist() == eager_g.ref.resident


# ----------------------------------------------------------------------------------------------
# random sequences (RES-1, RES-2, RES-4, INT-4)
# ----------------------------------------------------------------------------------------------


RANDOM_CONFIGS = {
    # name: (U, P, K, I, S, window, leases, rows, max_tokens)
    "u2e4": (2, 8, 6, 6, 12, 0, 5, 6, 96),
    "u4e1_window": (4, 4, 3, 5, 7, 32, 4, 5, 120),
    "u1e2": (1, 2, 4, 3, 8, 0, 4, 4, 40),
    # tokens per unit and page not powers of two: the row rules' general division path
    "u3e2_window": (3, 6, 4, 5, 8, 18, 4, 4, 90),
    # windows with sink tokens (TIER-3): units of the first ceil(sinks/P) pages stay selectable
    "u4e1_window_sinks": (4, 4, 3, 5, 7, 32, 4, 5, 120),
    "u3e2_window_sinks": (3, 6, 4, 5, 8, 18, 4, 4, 90),
}
# Rows longer than one CTA (512 threads on CUDA): cold starts whose victims run past the first
# 512 recency positions, bursts of more than 512 misses, and a window whose dropped units leave
# empty slots deep in recency (the victim search's later rounds).
LARGE_CONFIGS = {
    "u1_large": (1, 4, 1400, 64, 1300, 0, 3, 3, 6000),
    "u2_large_window": (2, 4, 2000, 64, 1102, 4000, 3, 3, 9000),
    "u2_large_window_sinks": (2, 4, 2000, 64, 1102, 4000, 3, 3, 9000),
}
# sink tokens per config (0 where not listed): 6 tokens are two pages of 4, 1 token one page of 6
SINKS = {"u4e1_window_sinks": 6, "u3e2_window_sinks": 1, "u2_large_window_sinks": 8}


def run_random_sequence(devices, config, seed, steps, with_fetch=True, selectable_only=False,
                        step_op=False):
    """Runs the sequence on each device (resolve writing its write outputs too, checked against
    the write_indices op); returns the first device's counters and the most miss-list entries
    one row produced in one step. ``selectable_only`` turns every selected
    ordinal its row cannot select into padding, so every row fits the CUDA resolve's direct unit
    table (bad or out-of-range ordinals send a row to the hash). ``step_op`` runs each step as
    one resolve_step (OP-STEP: resolve, write outputs and fetch in one call) under the same
    checks."""
    params = RANDOM_CONFIGS.get(config) or LARGE_CONFIGS[config]
    U, P, K, I, S, window, leases, rows, max_tokens = params
    sinks = SINKS.get(config, 0)
    drv = RandomDriver(seed, *params)
    groups = [Group(d, leases=leases, rows=rows, K=K, U=U, P=P, I=I, S=S, window=window,
                    writes=True, sinks=sinks) for d in devices]
    gen = torch.Generator().manual_seed(seed)
    max_pages = ref.ceil_div(max_tokens, P)
    most_placed = 0
    layers = []
    if with_fetch:
        base = Layer("cpu", gen=gen, num_leases=leases, S=S, P=P, U=U, chunks=2, bpt=4,
                     host_slots=rows * max_pages, rows=rows, max_pages=max_pages,
                     bad_page_frac=0.05)
        layers = [base.clone_to(d) for d in devices]
    if step_op:
        for layer, g in zip(layers, groups):
            g.fetch_layers = [layer]
    for step in range(steps):
        for ell in drv.evolve():
            for g in groups:
                g.reset_lease(ell)
        lease = drv.published_lease()
        resident_rows = {r: groups[0].ref.resident[ell] for r, ell in enumerate(lease)
                         if 0 <= ell < leases}
        sel = drv.selection(resident_rows)
        if selectable_only:
            ranges = [ref.RowRange(h, c, U, P, I, window, sinks) for h, c in zip(drv.h, drv.c)]
            sel = [[u if u < 0 or rng.selectable(u) else -1 for u in row]
                   for row, rng in zip(sel, ranges)]
        outs = []
        for g in groups:
            outs.append(g.step(sel, list(drv.h), list(drv.c), lease))
        per_row = collections.Counter(m[2] for m in outs[0][1])
        most_placed = max([most_placed, *per_row.values()])
        for layer, g in zip(layers, groups):
            if not step_op:
                run_fetch([layer], g.miss_list, g.miss_count, S, U)
            ref_fetch([layer], g.op_misses(), S, U)
            layer.check()
        # INT-4: every device gives bit-identical outputs and state (miss list compared sorted)
        for g, out in zip(groups[1:], outs[1:]):
            assert out == outs[0], step
            assert torch.equal(g.resident.cpu(), groups[0].resident.cpu())
            assert torch.equal(g.recency.cpu(), groups[0].recency.cpu())
            assert torch.equal(g.counters.cpu(), groups[0].counters.cpu())
            assert torch.equal(g.write_table.cpu(), groups[0].write_table.cpu())
            assert torch.equal(g.write_start.cpu(), groups[0].write_start.cpu())
        for layer in layers[1:]:
            assert torch.equal(layer.cells.cpu(), layers[0].cells.cpu())
    return groups[0].counters.cpu().tolist(), most_placed


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("config,steps", [("u2e4", 2000), ("u4e1_window", 1000), ("u1e2", 1000),
                                           ("u3e2_window", 1000), ("u4e1_window_sinks", 1000),
                                           ("u3e2_window_sinks", 1000)])
def test_op_resolve_random_sequence_matches_reference(device, config, steps):
    """RES-1, RES-2, RES-4, OP-RESOLVE, OP-FETCH: a long random sequence (joins, leaves, moves,
    decode and prefill, capacity shrinks, selections with duplicates, padding and out-of-range
    ordinals) agrees with the reference in every output and the full state after every step."""
    (hits, misses, invalid), _ = run_random_sequence([device], config, seed=11, steps=steps)
    # the sequence exercised every path
    assert hits > steps // 2 and misses > steps // 10 and invalid > steps // 10


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("config", list(RANDOM_CONFIGS))
def test_op_resolve_step_random_sequence_matches_reference(device, config):
    """OP-STEP: resolve_step (resolve, its write outputs, the fetch, in one call) over a random
    sequence: every output and the full state agree with the reference, the write outputs with
    the write_indices op, the cells with the reference's fetch, after every step."""
    (hits, misses, invalid), _ = run_random_sequence([device], config, seed=13, steps=300,
                                                     step_op=True)
    assert hits > 0 and misses > 0 and invalid > 0


@pytest.mark.cuda
@pytest.mark.parametrize("step_op", [False, True], ids=["ops", "resolve_step"])
@pytest.mark.parametrize("config", list(RANDOM_CONFIGS))
def test_op_resolve_random_sequence_cpu_cuda_identical(config, step_op):
    """INT-4: the same random sequence on CPU and CUDA side by side gives bit-identical state,
    index tables, write outputs, counters and cells, and the same miss lists up to order."""
    (hits, misses, _), _ = run_random_sequence(["cpu", "cuda"], config, seed=23, steps=400,
                                               step_op=step_op)
    assert hits > 0 and misses > 0


@pytest.mark.parametrize("devices", [pytest.param(["cpu"], id="cpu"),
                                     pytest.param(["cpu", "cuda"], id="cpu_cuda",
                                                  marks=pytest.mark.cuda)])
@pytest.mark.parametrize("selectable_only", [False, True], ids=["raw", "selectable_only"])
@pytest.mark.parametrize("config", list(LARGE_CONFIGS))
def test_op_resolve_random_sequence_large_rows(devices, config, selectable_only):
    """OP-RESOLVE, INT-4 on rows of more than 512 slots and columns: every step agrees with the
    reference (and CPU with CUDA, bit for bit), through cold starts, bursts of misses and a
    sliding window; the sequence placed more than 512 units in one row in one step. Raw
    selections (out-of-range ordinals) send CUDA rows to the hash; selectable-only ones keep them
    in the direct unit table."""
    (hits, misses, invalid), most_placed = run_random_sequence(
        devices, config, seed=5, steps=60, selectable_only=selectable_only)
    assert hits > 0 and misses > 0 and (invalid > 0 or selectable_only)
    assert most_placed > 512, most_placed


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_op_resolve_keeps_sink_units_behind_the_window(device):
    """TIER-3: a windowed row far past its window still selects the units of its sink pages (a
    miss, then a hit), and units between the sink pages and the window are invalid; without
    sinks the sink units are invalid too."""
    U, P, K, I, S, window = 2, 4, 4, 4, 12, 8
    sel = [[0, 1, 2, 15, 16, 19]]  # sink page 0: units 0, 1; released: 2..15; window: 16..
    h = c = 40  # first live page (40 - 8) // 4 = 8, i.e. unit 16
    for sinks, selectable in ((3, 4), (0, 2)):  # ceil(3 / 4) = 1 sink page
        g = Group(device, leases=1, rows=1, K=6, U=U, P=P, I=I, S=S, window=window, sinks=sinks)
        index, _, deltas = g.step(sel, [h], [c], [0])
        assert deltas == [0, selectable, 6 - selectable], sinks
        assert [e >= 0 for e in index[0]] == [sinks > 0] * 2 + [False, False, True, True]
        again, _, deltas = g.step(sel, [h], [c], [0])
        assert deltas == [selectable, 0, 6 - selectable] and again == index
