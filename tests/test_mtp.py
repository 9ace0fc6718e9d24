"""MTP-1..4: multi-token steps (docs/MTP.md).

Op level: resolve on ``selected int32[R, T', K]`` against the reference's rule about the union
(``reference.resolve_multi``) on hand-made scenarios and long random sequences with heavy
overlap between a row's query tokens (>= 90%), padding and invalid ordinals per token, T' from 1
to T; CPU and CUDA (bit-identical; CUDA runs where present). Batch level: MTP-1's validation,
the shapes ``Batch.resolve`` (with and without ``fetch=True``) accepts and returns, the fixed-address
output tables, opcheck and a compiled multi-token step. MTP-4: a randomised data-safety run with
speculative acceptance (1..T tokens accepted per row per step, rejected positions rewritten
with different bytes) that reads every token back bit-exactly.
"""
from __future__ import annotations

import random

import pytest
import torch

import reference as ref
import torch_kvcm2 as kv
from torch_kvcm2 import ops
from conftest import DEVICE_PARAMS
from residency_driver import RandomDriver
from safety_model import Model, token_bytes

BAD = ref.BAD
I32 = torch.int32


def t32(data, device):
    return torch.tensor(data, dtype=I32, device=device)


# ----------------------------------------------------------------------------------------------
# op level
# ----------------------------------------------------------------------------------------------


class MultiGroup:
    """Op-level state of one selection group sized for T query tokens (miss list of
    rows·(T·K + ceil(I/U) + 1) entries), next to a reference state."""

    def __init__(self, device, *, leases, rows, T, K, U, P, I, S, window=0):
        self.device, self.rows, self.T, self.K = device, rows, T, K
        self.U, self.P, self.I, self.S, self.window = U, P, I, S, window
        self.resident = torch.full((leases, S), BAD, dtype=I32, device=device)
        self.recency = torch.arange(S, dtype=I32, device=device).repeat(leases, 1)
        miss_rows = rows * (T * K + ops.max_inflight_units(I, U))
        self.miss_list = torch.full((miss_rows, ops.MISS_FIELDS), 999, dtype=I32, device=device)
        self.miss_count = torch.zeros(ops.MISS_COUNT_WORDS, dtype=I32, device=device)
        self.counters = torch.zeros(ops.NUM_COUNTERS, dtype=torch.int64, device=device)
        self.inflight_slots = torch.full((rows, ops.max_inflight_units(I, U)), 333, dtype=I32,
                                         device=device)
        self.ref = ref.ResidencyState.fresh(leases, S)

    def reset_lease(self, ell):
        self.resident[ell] = BAD
        self.recency[ell] = torch.arange(self.S, dtype=I32, device=self.device)
        self.ref.resident[ell] = [BAD] * self.S
        self.ref.recency[ell] = list(range(self.S))

    def run(self, selected, history, capacity, lease):
        sel = t32(selected, self.device)
        index = torch.full_like(sel, 777)
        ops.resolve(self.resident, self.recency, index, self.miss_list, self.miss_count,
                    self.counters, self.inflight_slots, sel, t32(history, self.device),
                    t32(capacity, self.device), t32(lease, self.device), self.U, self.P, self.I,
                    self.window)
        count = self.miss_count.tolist()
        assert count[2:] == [0, 0], f"reservation word not reset: {count}"
        misses = sorted(tuple(e) for e in self.miss_list[:count[0]].cpu().tolist())
        return index.cpu().tolist(), misses

    def step(self, selected, history, capacity, lease):
        """Runs the op on ``selected`` (R lists of T' lists of K) and the reference; asserts
        that outputs and state agree. Returns (index table, sorted misses, counter deltas)."""
        old = self.counters.cpu().tolist()
        index, misses = self.run(selected, history, capacity, lease)
        deltas = [a - b for a, b in zip(self.counters.cpu().tolist(), old)]
        want_index, want_misses, want_deltas = ref.resolve_multi(
            self.ref, selected, history, capacity, lease, self.U, self.P, self.I, self.window)
        ctx = dict(selected=selected, history=history, capacity=capacity, lease=lease)
        assert index == want_index, ctx
        assert misses == sorted(want_misses), ctx
        assert deltas == want_deltas, ctx
        assert self.resident.cpu().tolist() == self.ref.resident, ctx
        assert self.recency.cpu().tolist() == self.ref.recency, ctx
        ref.check_res1(ref.state_from_tensors(self.resident.cpu(), self.recency.cpu(),
                                              self.counters.cpu()))
        ref.check_res2(self.ref, history, capacity, lease, self.U, self.P, self.I, self.window)
        assert self.inflight_slots.cpu().tolist() == ref.locate_inflight(
            self.resident.cpu().tolist(), history, capacity, lease, self.U, self.I)
        return index, misses, deltas


# U=2, P=4 (E=2), K=4, I=4 (at most 3 in-flight units), T=2: S >= 2*4 + 3 = 11 -> 12.
SMALL = dict(U=2, P=4, I=4, K=4, T=2, S=12)


def small(device, leases=2, rows=2, **kw):
    cfg = dict(SMALL)
    cfg.update(kw)
    return MultiGroup(device, leases=leases, rows=rows, **cfg)


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_mtp_shared_units_are_one_hit_or_one_miss_in_one_slot(device):
    """MTP-3: units selected by both query tokens miss once, take one slot, and both tokens'
    entries for them are equal; the misses take victims in first-occurrence order over
    (query token, column); then the same units hit once each."""
    g = small(device, leases=1, rows=1)
    h = c = [40]  # units 0..19 are history, nothing in flight
    sel = [[[5, 7, 9, 11], [7, 5, 13, 9]]]
    index, misses, deltas = g.step(sel, h, c, [0])
    assert deltas == [0, 5, 0]  # 5, 7, 9, 11, 13: one miss each
    assert len(misses) == 5 and sorted(m[3] for m in misses) == [5, 7, 9, 11, 13]
    slot = {m[3]: m[1] for m in misses}
    assert [slot[u] for u in (5, 7, 9, 11, 13)] == [0, 1, 2, 3, 4]  # first occurrence order
    assert index[0][0] == [slot[5], slot[7], slot[9], slot[11]]
    assert index[0][1] == [slot[7], slot[5], slot[13], slot[9]]
    _, misses, deltas = g.step([[[13, 13, 5, -1], [5, 11, -1, 13]]], h, c, [0])
    assert deltas == [3, 0, 0] and misses == []  # 13, 5, 11: one hit each


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_mtp_recency_treats_the_union_as_the_selection(device):
    """MTP-3 + OP-RESOLVE step 4: a unit only the second query token selects is as recent as
    one the first token selects; units neither selects are evicted first."""
    g = small(device, leases=1, rows=1, K=2, S=8)
    h = c = [40]
    g.step([[[1, 2], [3, 4]]], h, c, [0])  # slots 0..3 hold 1, 2, 3, 4
    g.step([[[5, 6], [5, 6]]], h, c, [0])  # 5, 6 in slots 4, 5
    g.step([[[1, -1], [3, 1]]], h, c, [0])  # 1 and 3 hit (3 only through the second token)
    # recency now: the untouched slots (the two empty ones, then 2, 4, 5, 6), then the hits 1, 3
    rec = g.recency.cpu().tolist()[0]
    res = g.resident.cpu().tolist()[0]
    assert [res[s] for s in rec[-2:]] == [1, 3]
    # four misses evict the empty slots first, then 2 and 4 (least recent), never 1 or 3
    _, misses, deltas = g.step([[[7, 8], [9, 10]]], h, c, [0])
    assert deltas == [0, 4, 0]
    assert sorted(g.resident.cpu().tolist()[0]) == sorted([1, 3, 5, 6, 7, 8, 9, 10])


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_mtp_padding_and_invalid_ordinals_per_token(device):
    """Padding is BAD in every token that pads, uncounted; an invalid ordinal is BAD in every
    token that names it and counts once per row (the union holds it once); an in-flight unit
    selected by several tokens is one hit."""
    g = small(device, leases=1, rows=1)
    h, c = [10], [13]  # units 0..4 history, in flight: unit 5 (tokens 10, 11) and 6 (token 12)
    sel = [[[-1, 99, 2, 6], [6, 99, -5, -1]]]
    index, misses, deltas = g.step(sel, h, c, [0])
    assert deltas == [1, 1, 1]  # 6 hits (in flight), 2 misses, 99 invalid once
    assert index[0][0][0] == BAD and index[0][0][1] == BAD and index[0][1][1] == BAD
    assert index[0][1][2] == BAD and index[0][1][3] == BAD
    assert index[0][0][3] == index[0][1][0] != BAD


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_mtp_one_token_shapes_equal_the_plain_resolve(device):
    """[R, 1, K] resolves exactly like [R, K]: the same entries, misses and state."""
    a, b = small(device), small(device)
    steps = [([[3, 0, 7, 5], [1, 2, -1, 9]], [32, 9], [32, 11], [1, 0]),
             ([[3, 8, 8, -1], [4, 2, 6, 1]], [32, 9], [32, 12], [1, 0])]
    for sel, h, c, lease in steps:
        flat = a.run(sel, h, c, lease)
        multi = b.run([[row] for row in sel], h, c, lease)
        assert multi[0] == [[row] for row in flat[0]] and multi[1] == flat[1]
        assert torch.equal(a.resident, b.resident) and torch.equal(a.recency, b.recency)
        assert torch.equal(a.counters, b.counters)


def overlapping_selection(drv, resident_rows, tokens, overlap=0.9):
    """T' selections per row: token 0 as RandomDriver draws it (padding, out-of-range ordinals,
    duplicates, likely hits), each later token a copy of the previous one with about
    1 - ``overlap`` of its columns redrawn (and padding re-rolled)."""
    rng = drv.rng
    first = drv.selection(resident_rows)
    out = []
    for r, row in enumerate(first):
        toks = [row]
        for _ in range(tokens - 1):
            nxt = list(toks[-1])
            for j in range(len(nxt)):
                if rng.random() > overlap:
                    nxt[j] = rng.choice([-1, rng.randrange(0, max(1, ref.ceil_div(drv.c[r], drv.U) + 2))])
            toks.append(nxt)
        out.append(toks)
    return out


MULTI_CONFIGS = {
    # name: (U, P, K, I, T, window, leases, rows, max_tokens); S = T*K + ceil(I/U) + 1 rounded
    "u2_t2": (2, 8, 6, 6, 2, 0, 5, 6, 96),
    "u1_t4": (1, 2, 4, 5, 4, 0, 4, 4, 60),
    "u3_t3_window": (3, 6, 4, 5, 3, 18, 4, 4, 90),
}


def run_multi_sequence(devices, config, seed, steps):
    U, P, K, I, T, window, leases, rows, max_tokens = MULTI_CONFIGS[config]
    E = P // U
    S = ref.ceil_div(T * K + ops.max_inflight_units(I, U), E) * E
    drv = RandomDriver(seed, U, P, K, I, S, window, leases, rows, max_tokens)
    groups = [MultiGroup(d, leases=leases, rows=rows, T=T, K=K, U=U, P=P, I=I, S=S,
                         window=window) for d in devices]
    shared = 0
    for step in range(steps):
        for ell in drv.evolve():
            for g in groups:
                g.reset_lease(ell)
        lease = drv.published_lease()
        resident_rows = {r: groups[0].ref.resident[ell] for r, ell in enumerate(lease)
                         if 0 <= ell < leases}
        tokens = 1 + step % T  # every T' from 1 to T
        sel = overlapping_selection(drv, resident_rows, tokens)
        outs = [g.step(sel, list(drv.h), list(drv.c), lease) for g in groups]
        for out in outs[1:]:
            assert out == outs[0], step  # INT-4: CPU = CUDA (miss lists compared sorted)
        for g in groups[1:]:
            assert torch.equal(g.resident.cpu(), groups[0].resident.cpu())
            assert torch.equal(g.recency.cpu(), groups[0].recency.cpu())
        for row in sel:  # units several tokens share
            if len(row) > 1:
                shared += len(set(row[0]) & set(row[1]) - {-1, -3})
    return groups[0].counters.cpu().tolist(), shared


@pytest.mark.parametrize("device", DEVICE_PARAMS)
@pytest.mark.parametrize("config", list(MULTI_CONFIGS))
def test_mtp_random_sequence_matches_reference(device, config):
    """MTP-2/MTP-3 against the reference over long random sequences: joins, leaves, moves,
    prefill and capacity changes, T' = 1..T query tokens with >= 90% overlap, padding,
    duplicates and invalid ordinals per token; every output and the full state after every
    step."""
    (hits, misses, invalid), shared = run_multi_sequence([device], config, seed=5, steps=600)
    assert hits > 300 and misses > 60 and invalid > 60 and shared > 600


@pytest.mark.cuda
@pytest.mark.parametrize("config", list(MULTI_CONFIGS))
def test_mtp_random_sequence_cpu_cuda_identical(config):
    """INT-4 for multi-token steps: CPU and CUDA side by side, bit-identical."""
    (hits, misses, _), _ = run_multi_sequence(["cpu", "cuda"], config, seed=17, steps=300)
    assert hits > 0 and misses > 0


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_mtp_op_bad_shapes_raise(device):
    """Bad multi-token shapes fail with a message naming the argument and the rule, before any
    state changes."""
    g = small(device, leases=1, rows=2)
    sel = t32([[[1, 2, 3, 4], [1, 2, 3, 5]]] * 2, device)
    h = c = t32([40, 40], device)
    lease = t32([0, BAD], device)
    before = g.resident.clone(), g.recency.clone()

    def call(selected, index, miss_list=g.miss_list):
        ops.resolve(g.resident, g.recency, index, miss_list, g.miss_count, g.counters,
                    g.inflight_slots, selected, h, c, lease, 2, 4, 4, 0)

    with pytest.raises(RuntimeError, match="must be 2-D .* or 3-D"):
        call(sel.view(2, 2, 2, 2), torch.empty(2, 2, 2, 2, dtype=I32, device=device))
    with pytest.raises(RuntimeError, match="index_table has shape"):
        call(sel, torch.empty(2, 8, dtype=I32, device=device))
    with pytest.raises(RuntimeError, match="selected must be int32"):
        call(sel.long(), torch.empty_like(sel))
    with pytest.raises(RuntimeError, match="at least one query token"):
        call(sel[:, :0], torch.empty(2, 0, 4, dtype=I32, device=device))
    with pytest.raises(RuntimeError, match="miss_list must have shape"):
        call(sel, torch.empty_like(sel), g.miss_list[:2 * (4 + 3)])  # sized for one token
    with pytest.raises(RuntimeError, match="contiguous"):
        call(sel.transpose(1, 2), torch.empty(2, 4, 2, dtype=I32, device=device))
    assert torch.equal(before[0], g.resident) and torch.equal(before[1], g.recency)


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_mtp_resolve_opcheck(device):
    """INT-1 for the multi-token shapes: opcheck on [R, T', K] from a non-trivial state."""
    g = small(device)
    g.step([[[3, 0, 7, 5], [3, 0, 7, 6]], [[1, 2, -1, 9], [1, 2, 4, 9]]], [32, 9], [32, 11], [1, 0])
    sel = t32([[[3, 8, 8, -1], [3, 8, 2, -1]], [[4, 2, 6, 1], [4, 2, 6, 0]]], device)
    torch.library.opcheck(
        torch.ops.torch_kvcm2.resolve.default,
        (g.resident, g.recency, torch.empty_like(sel), g.miss_list, g.miss_count, g.counters,
         g.inflight_slots, sel, t32([32, 9], device), t32([32, 11], device), t32([1, 0], device),
         2, 4, 4, 0))


# ----------------------------------------------------------------------------------------------
# config and batch level
# ----------------------------------------------------------------------------------------------


def mtp_config(device, T=2, K=3, S=12, I=3, U=1, P=4, rows=4, width_b=2):
    a = kv.SparseSpec(tokens_per_unit=U, width=K, slots=S, max_inflight_tokens=I,
                      max_query_tokens=T)
    b = kv.SparseSpec(tokens_per_unit=1, width=width_b, slots=8, max_inflight_tokens=2,
                      selection_id="b", max_query_tokens=2)
    layers = [kv.LayerSpec("a", [kv.BufferSpec("kv", 8, sparse=True)], sparse=a),
              kv.LayerSpec("b0", [kv.BufferSpec("kv", 8, sparse=True)], sparse=b),
              kv.LayerSpec("b1", [kv.BufferSpec("kv", 8, sparse=True)], sparse=b)]
    return kv.CacheConfig(tokens_per_page=P, layers=layers, max_rows=rows, max_tokens_per_row=64,
                          gpu_budget_bytes=1 << 20, host_budget_bytes=1 << 20, device=device)


def test_mtp1_config_validation_names_layer_and_rule():
    """MTP-1: max_query_tokens is a positive int, I >= T and S >= T*K + ceil(I/U) + 1; errors
    name the rule and where: the sparse settings for their own fields (refused when they are
    made), the layer and the buffer for the slots the config needs; layers of one group agree
    on T (CFG-4)."""
    assert mtp_config("cpu").layer("a").sparse.max_selected_columns == 6
    assert kv.SparseSpec(1, 4, 8, 2).max_query_tokens == 1  # the default
    with pytest.raises(ValueError, match=r"^sparse settings.*: MTP-1: max_query_tokens must "
                                         r"be a positive int"):
        mtp_config("cpu", T=0)
    with pytest.raises(ValueError, match=r"^sparse settings.*: MTP-1: max_inflight_tokens "
                                         r"\(3\) must be >= max_query_tokens \(4\)"):
        mtp_config("cpu", T=4, S=20)
    with pytest.raises(ValueError, match=r"layer 'a', buffer 'kv': MTP-1: slots \(8\) must be >= "
                                         r"max_query_tokens \* width .* = 2 \* 3 \+ 4 = 10"):
        mtp_config("cpu", S=8)
    mtp_config("cpu", S=12)  # 12 >= 10, a multiple of E = 4
    a = kv.SparseSpec(1, 2, 8, 2, selection_id="x", max_query_tokens=2)
    b = kv.SparseSpec(1, 2, 8, 2, selection_id="x", max_query_tokens=1)
    with pytest.raises(ValueError, match=r"layer 'l1'.*CFG-4: max_query_tokens \(1\) differs"):
        kv.CacheConfig(tokens_per_page=4, max_rows=2, max_tokens_per_row=16,
                       gpu_budget_bytes=1 << 20, host_budget_bytes=1 << 20,
                       layers=[kv.LayerSpec("l0", [kv.BufferSpec("kv", 8, True)], sparse=a),
                               kv.LayerSpec("l1", [kv.BufferSpec("kv", 8, True)], sparse=b)])


def seat(manager, batch, n, history=20, new=2):
    caches = []
    for _ in range(n):
        cache = manager.create_cache()
        assert cache.resize(capacity=history + 32)  # past any in-flight range here: host-direct
        cache.record_host_write(history)
        assert cache.resize(history=history)
        assert cache.resize(capacity=history + new)
        batch.add(cache)
        caches.append(cache)
    batch.publish()
    return caches


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_mtp2_batch_resolve_shapes_and_fixed_tables(device):
    """MTP-2: Batch.resolve takes [max_rows, K] and [max_rows, T', K] (1 <= T' <= T) and returns
    the batch's table in the same shape, always at one address; equal to the reference."""
    config = mtp_config(device)
    manager = kv.KVCacheManager(config)
    batch = kv.Batch(manager)
    seat(manager, batch, 3)
    state = batch.group("a")
    sp = state.spec.sparse
    address = state.index_table.data_ptr()
    gen = torch.Generator().manual_seed(3)
    for shape in [(4, 3), (4, 1, 3), (4, 2, 3), (4, 2, 3), (4, 3)]:
        sel = torch.randint(-1, 24, shape, generator=gen, dtype=I32).to(device)
        before = ref.state_from_tensors(state.resident.cpu(), state.recency.cpu(),
                                        state.counters.cpu())
        out = batch.resolve("a", sel)
        assert tuple(out.shape) == shape and out.data_ptr() == address and out.is_contiguous()
        rows = sel.cpu().tolist() if len(shape) == 3 else [[r] for r in sel.cpu().tolist()]
        want, _, _ = ref.resolve_multi(before, rows, batch.history.tolist(),
                                       batch.capacity.tolist(), batch.lease.tolist(),
                                       sp.tokens_per_unit, 4, sp.max_inflight_tokens)
        got = out.cpu().tolist() if len(shape) == 3 else [[r] for r in out.cpu().tolist()]
        assert got == want
        assert state.resident.cpu().tolist() == before.resident
        batch.fetch("a")
    out = torch.empty(4, 2, 3, dtype=I32, device=device)
    assert batch.resolve("a", sel.view(4, 1, 3).expand(4, 2, 3).contiguous(), out) is out


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_mtp2_batch_rejects_bad_shapes(device):
    """T' > T, T' = 0, a wrong K or rank, a wrong dtype or a wrong ``out`` raise clearly."""
    config = mtp_config(device)
    manager = kv.KVCacheManager(config)
    batch = kv.Batch(manager)
    seat(manager, batch, 2)
    ok = torch.zeros(4, 2, 3, dtype=I32, device=device)
    with pytest.raises(ValueError, match=r"3 query tokens per row .* allows 1\.\.2"):
        batch.resolve("a", torch.zeros(4, 3, 3, dtype=I32, device=device))
    with pytest.raises(ValueError, match=r"0 query tokens"):
        batch.resolve("a", torch.zeros(4, 0, 3, dtype=I32, device=device))
    with pytest.raises(ValueError, match=r"selected must have shape \(4, 2, 3\)"):
        batch.resolve("a", torch.zeros(4, 2, 4, dtype=I32, device=device))
    with pytest.raises(ValueError, match=r"selected must be 2-D .* or 3-D .*got 4-D"):
        batch.resolve("a", torch.zeros(4, 1, 2, 3, dtype=I32, device=device))
    with pytest.raises(TypeError, match="selected must be int32"):
        batch.resolve("a", ok.long())
    with pytest.raises(ValueError, match=r"out must have shape \(4, 2, 3\)"):
        batch.resolve("a", ok, torch.zeros(4, 6, dtype=I32, device=device))
    with pytest.raises(ValueError, match="contiguous"):
        batch.resolve("a", torch.zeros(4, 3, 2, dtype=I32, device=device).transpose(1, 2))


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_mtp2_resolve_with_fetch_multi_token_reads_every_token(device):
    """resolve(fetch=True) with [max_rows, T', K]: every selected unit of every query token
    reads its host bytes back from the cells."""
    config = mtp_config(device)
    manager = kv.KVCacheManager(config)
    batch = kv.Batch(manager)
    caches = seat(manager, batch, 3)
    host = manager.slot_pages("a", "kv", device_side=False)  # every history token's bytes
    for cache in caches:
        pages = torch.tensor(cache.pages(manager.buffer("a", "kv").pool_group), dtype=torch.long)
        t = torch.arange(cache.history_length)
        host[pages[t // 4], :, t % 4] = token_bytes(1, t + 1000 * batch.row_of(cache),
                                                    8).view(len(t), 1, 8)
    gen = torch.Generator().manual_seed(9)
    for _ in range(4):
        sel = torch.randint(0, 20, (4, 2, 3), generator=gen, dtype=I32)
        sel[3] = -1  # the empty row pads
        table = batch.resolve("a", sel.to(device), fetch=True).cpu()
        cells = batch.cells("a", "kv").cpu()
        for row in range(3):
            for tok in range(2):
                for j in range(3):
                    e, u = int(table[row, tok, j]), int(sel[row, tok, j])
                    assert e >= 0
                    got = cells[e // 4, :, e % 4].reshape(8)
                    assert torch.equal(got, token_bytes(1, torch.tensor([u + 1000 * row]), 8)[0])
        assert (table[3] == BAD).all()


def test_mtp_compiled_step_equals_eager():
    """INT-2 with T = 2: a step resolving [max_rows, 2, K] then fetching compiles with
    fullgraph=True and equals eager execution."""
    torch._dynamo.reset()
    runs = []
    for compiled in (False, True):
        manager = kv.KVCacheManager(mtp_config("cpu"))
        batch = kv.Batch(manager)
        seat(manager, batch, 3)

        def step(selected):
            batch.resolve("b", selected)
            batch.fetch("b0", "b1")

        fn = torch.compile(step, fullgraph=True) if compiled else step
        gen = torch.Generator().manual_seed(4)
        state = batch.group("b")
        outs = []
        for _ in range(4):
            fn(torch.randint(-1, 20, (4, 2, 2), generator=gen, dtype=I32))
            # read outside the compiled region: a compiled ``index.clone()`` of the batch's
            # static index table was seen to return the table itself (torch 2.13, CPU)
            outs.append(state.index_views[1].clone())
        assert len({tuple(o.flatten().tolist()) for o in outs}) > 1
        runs.append((outs, state.resident.clone(), state.recency.clone(), state.counters.clone()))
    for a, b in zip(runs[0][0], runs[1][0]):
        assert torch.equal(a, b)
    for a, b in zip(runs[0][1:], runs[1][1:]):
        assert torch.equal(a, b)


# ----------------------------------------------------------------------------------------------
# MTP-4: speculative acceptance with the write-back path
# ----------------------------------------------------------------------------------------------


def spec_config(device):
    """Group "a" (two layers, 2-token units, T = 3) and layer b's group (1-token units, T = 2)."""
    a = kv.SparseSpec(tokens_per_unit=2, width=4, slots=16, max_inflight_tokens=3,
                      selection_id="a", max_query_tokens=3)
    b = kv.SparseSpec(tokens_per_unit=1, width=3, slots=12, max_inflight_tokens=2,
                      max_query_tokens=2)
    layers = [
        kv.LayerSpec("a0", [kv.BufferSpec("kv", 6, sparse=True, chunks=2)], sparse=a),
        kv.LayerSpec("a1", [kv.BufferSpec("kv", 6, sparse=True, chunks=2),
                            kv.BufferSpec("rope", 4, sparse=True)], sparse=a),
        kv.LayerSpec("b", [kv.BufferSpec("kv", 6, sparse=True)], sparse=b),
    ]
    return kv.CacheConfig(tokens_per_page=4, layers=layers, max_rows=4, max_tokens_per_row=96,
                          gpu_budget_bytes=1 << 20, host_budget_bytes=1 << 20, device=device)


class SpeculativeModel(Model):
    """test_data_safety's model with speculative steps: each row runs T query tokens (one
    accepted token plus drafts), verification accepts a random 1..T of them, and the rejected
    positions are rewritten next step with new bytes (each write of a position has its own
    version), so a stale cell or host page shows as a byte mismatch."""

    def __init__(self, device, seed):
        self.device = device
        self.rng = random.Random(seed)
        self.config = spec_config(device)
        self.manager = kv.KVCacheManager(self.config)
        self.batch = kv.Batch(self.manager)
        self.buffers = []
        for group in self.config.selection_groups:
            for layer in group.layers:
                for buf in self.config.layer(layer).sparse_buffers:
                    self.buffers.append((layer, buf.role, len(self.buffers), group.index,
                                         buf.bytes_per_token))
        self.caches = []
        self.checked_tokens = 0
        self.version = {}  # id(cache) -> {position: times rewritten}
        self.rejected = 0
        self.T = min(g.sparse.max_query_tokens for g in self.config.selection_groups)

    def bytes_of(self, cache, key, positions, nbytes):
        """The bytes of ``positions`` of ``cache`` as last written: [n, nbytes]."""
        ver = self.version.get(id(cache), {})
        out = token_bytes(key, positions, nbytes)
        for i, t in enumerate(positions.tolist()):
            v = ver.get(t, 0)
            if v:
                out[i] = token_bytes(key + 7919 * v, torch.tensor([t]), nbytes)[0]
        return out

    def grow(self):
        """This step's query tokens: T per row (sometimes a prefill chunk instead)."""
        for cache in self.batch.members().values():
            if cache.suspended:
                continue
            h = cache.history_length
            n = self.rng.randint(1, 24) if self.rng.random() < 0.1 else self.T
            n = min(n, self.config.max_tokens_per_row - h)
            if not cache.resize(capacity=h + n):
                assert cache.capacity == h

    def select(self, group, tokens):
        """[MAX_ROWS, tokens, K]: token 0 as the base model draws it, later tokens with about
        10% of their columns redrawn."""
        first = super().select(group).cpu()
        sel = first[:, None, :].repeat(1, tokens, 1)
        for row, cache in self.batch.members().items():
            top = -(-cache.capacity // group.sparse.tokens_per_unit)
            for tok in range(1, tokens):
                for j in range(group.sparse.width):
                    if self.rng.random() < 0.1:
                        sel[row, tok, j] = self.rng.choice([-1, self.rng.randrange(0, top + 2)])
        return sel.to(self.device)

    def resolve_and_check(self, group, selected):
        batch, state, sp = self.batch, self.batch.groups[group.index], group.sparse
        before = ref.state_from_tensors(state.resident, state.recency, state.counters)
        index = batch.resolve(group.index, selected)
        want, want_misses, _ = ref.resolve_multi(
            before, selected.tolist(), batch.history.tolist(), batch.capacity.tolist(),
            batch.lease.tolist(), sp.tokens_per_unit, 4, sp.max_inflight_tokens)
        assert index.tolist() == want
        n = int(state.miss_count[0])
        assert sorted(map(tuple, state.miss_list[:n].tolist())) == sorted(want_misses)
        assert state.resident.tolist() == before.resident
        assert state.recency.tolist() == before.recency
        return index

    def write(self, group_index):
        """[h, s0) to host pages, [s0, c) into cells (write_indices), at their current
        versions."""
        batch = self.batch
        table, start = (t.cpu() for t in batch.write_indices(group_index))
        members = {r: c for r, c in batch.members().items() if not c.suspended}
        for layer, role, key, group, nbytes in self.buffers:
            if group != group_index:
                continue
            view = self.manager.buffer_view(layer, role)
            cells = batch.cells(layer, role)
            for row, cache in members.items():
                h, s0 = cache.history_length, int(start[row])
                direct = torch.arange(h, s0, dtype=I32)
                if len(direct):
                    pos = torch.full((4, len(direct)), -1, dtype=I32)
                    pos[row] = direct
                    host = batch.host_token_indices(layer, role, pos.to(self.device)).cpu()[row]
                    data = self.bytes_of(cache, key, direct, nbytes).view(len(direct),
                                                                         *view.shape[1::2])
                    idx = host.long()
                    view[(idx // 4).to(self.device), :, (idx % 4).to(self.device)] = \
                        data.to(self.device)
                ok = table[row] >= 0
                tokens = (start[row] + torch.arange(table.shape[1]))[ok]
                idx = table[row][ok].long()
                data = self.bytes_of(cache, key, tokens, nbytes).view(len(idx), *cells.shape[1::2])
                cells[(idx // 4).to(self.device), :, (idx % 4).to(self.device)] = \
                    data.to(self.device)

    def check_cells(self, group, selected, index):
        """Every written token of every unit any query token selected reads back at its
        current version (RES-3 under speculation)."""
        U = group.sparse.tokens_per_unit
        selected, index = selected.cpu(), index.cpu()
        for row, cache in self.batch.members().items():
            ok = index[row] >= 0
            units, entries = selected[row][ok].long(), index[row][ok].long()
            for offset in range(U):
                tokens = units * U + offset
                written = tokens < cache.capacity
                t, idx = tokens[written], entries[written] * U + offset
                for layer, role, key, g, nbytes in self.buffers:
                    if g != group.index or not len(t):
                        continue
                    cells = self.batch.cells(layer, role).cpu()
                    got = cells[idx // 4, :, idx % 4].reshape(len(idx), nbytes)
                    assert torch.equal(got, self.bytes_of(cache, key, t, nbytes)), (layer, role)
                    self.checked_tokens += len(idx)

    def check_host(self, cache):
        """Every token of history reads back from its host page, once settled."""
        self.settle()
        manager = self.manager
        t = torch.arange(cache.history_length)
        for layer, role, key, _, nbytes in self.buffers:
            pages = torch.tensor(cache.pages(manager.buffer(layer, role).pool_group), dtype=torch.long)
            host = manager.slot_pages(layer, role, device_side=False)
            got = host[pages[t // 4], :, t % 4].reshape(len(t), nbytes)
            assert torch.equal(got, self.bytes_of(cache, key, t, nbytes)), (cache, layer, role)

    def step(self, number):
        self.membership()
        self.grow()
        self.batch.publish()
        for group in self.config.selection_groups:
            tokens = self.rng.randint(1, group.sparse.max_query_tokens)
            selected = self.select(group, tokens)
            index = self.resolve_and_check(group, selected)
            for layer in group.layers:
                self.batch.fetch(layer)
            self.write(group.index)
            self.check_cells(group, selected, index)
        self.batch.record_host_writes()
        # verification: each row accepts 1..n of its n new tokens (all of a prefill chunk)
        members = {r: c for r, c in self.batch.members().items() if not c.suspended}
        new_history = self.batch.capacity.tolist()
        for row, cache in members.items():
            h, c = cache.history_length, cache.capacity
            if 0 < c - h <= self.T:
                new_history[row] = h + self.rng.randint(1, c - h)
        self.batch.flush(new_history)
        for row, cache in members.items():
            target, c = int(new_history[row]), cache.capacity
            ver = self.version.setdefault(id(cache), {})
            for t in range(target, c):  # rejected: rewritten with new bytes next step
                ver[t] = ver.get(t, 0) + 1
                self.rejected += 1
            assert cache.resize(history=target)
            assert cache.resize(capacity=target)
        if number % 25 == 0:
            for cache in self.batch.members().values():
                self.check_host(cache)


@pytest.mark.parametrize("seed", [0, 1])
def test_mtp4_speculative_acceptance_reads_every_token_back(device, seed):
    """MTP-4 / SAFE-1: T in-flight tokens per row written through write_indices, a random 1..T
    accepted per row per step, flush(new_history) writing back only the accepted ones; the
    rejected positions are rewritten next step with different bytes, and every selected token
    (cells, every step) and every token of history (host pages) reads back bit-exactly."""
    model = SpeculativeModel(device, seed)
    for number in range(300):
        model.step(number)
    for cache in model.caches:
        model.check_host(cache)
    assert model.checked_tokens > 1000 and model.rejected > 100
    hits, misses, invalid = model.batch.hit_miss(0).tolist()
    assert hits and misses and invalid


# ----------------------------------------------------------------------------------------------
# CUDA: rows too wide for the shared layout (the table region in global scratch)
# ----------------------------------------------------------------------------------------------


def wide_state(device, rows, S, columns, I, U):
    st = dict(
        resident=torch.full((rows, S), BAD, dtype=I32, device=device),
        recency=torch.arange(S, dtype=I32, device=device).repeat(rows, 1),
        miss_list=torch.zeros((rows * (columns + ops.max_inflight_units(I, U)), ops.MISS_FIELDS),
                              dtype=I32, device=device),
        miss_count=torch.zeros(ops.MISS_COUNT_WORDS, dtype=I32, device=device),
        counters=torch.zeros(ops.NUM_COUNTERS, dtype=torch.int64, device=device),
        inflight_slots=torch.zeros((rows, ops.max_inflight_units(I, U)), dtype=I32, device=device),
    )
    return st


@pytest.mark.cuda
@pytest.mark.parametrize("T,K", [(3, 2048), (4, 2048)])
def test_mtp_wide_rows_cuda_equal_cpu(T, K):
    """T·K beyond the shared layout (docs/MTP.md): with a scratch the CUDA resolve keeps its
    table in global memory and equals the CPU kernel bit for bit, over rows that take the
    direct table (short histories) and the hash (long ones, or an invalid ordinal); without a
    scratch it raises naming the shape."""
    from torch_kvcm2.memory import resolve_scratch_bytes
    U, P, I = 1, 64, 16
    rows = 4
    S = -(-(T * K + ops.max_inflight_units(I, U)) // P) * P
    states = {d: wide_state(d, rows, S, T * K, I, U) for d in ("cpu", "cuda")}
    scratch = torch.empty(rows * resolve_scratch_bytes(T * K), dtype=torch.uint8, device="cuda")
    rng = random.Random(3)
    history = [20000, 90000, 30000, 0]
    lease = [0, 1, 2, BAD]
    prev = None
    for step in range(12):
        history = [h + rng.randint(0, 3) if h else 0 for h in history]
        capacity = [h + rng.randint(0, 4) if h else 0 for h in history]
        sel = torch.full((rows, T, K), -1, dtype=I32)
        for r in range(3):
            base = torch.randint(0, max(1, history[r]), (K,), generator=torch.Generator().manual_seed(step * 7 + r))
            if prev is not None and step % 3:
                base = torch.where(torch.rand(K) < 0.9, prev[r, 0].long(), base)
            sel[r, 0] = base.to(I32)
            for t in range(1, T):
                redo = torch.rand(K) < 0.1
                sel[r, t] = torch.where(redo, torch.randint(0, max(1, capacity[r] + 2), (K,)).to(I32),
                                        sel[r, t - 1])
            sel[r, :, ::97] = -1  # padding in every token
        if step % 4 == 3:
            sel[2, 1, 5] = 10 ** 7  # an invalid ordinal: that row takes the hash
        prev = sel
        outs = {}
        for d, st in states.items():
            index = torch.full((rows, T, K), 777, dtype=I32, device=d)
            ops.resolve(st["resident"], st["recency"], index, st["miss_list"], st["miss_count"],
                        st["counters"], st["inflight_slots"], sel.to(d), t32(history, d),
                        t32(capacity, d), t32(lease, d), U, P, I, 0,
                        scratch if d == "cuda" else None)
            n = int(st["miss_count"][0])
            outs[d] = (index.cpu(), sorted(map(tuple, st["miss_list"][:n].cpu().tolist())))
        assert torch.equal(outs["cpu"][0], outs["cuda"][0]), step
        assert outs["cpu"][1] == outs["cuda"][1], step
        for name in ("resident", "recency", "counters", "inflight_slots"):
            assert torch.equal(states["cpu"][name], states["cuda"][name].cpu()), (step, name)
    hits, misses, invalid = states["cpu"]["counters"].tolist()
    assert hits > 0 and misses > 0 and invalid > 0
    st = states["cuda"]
    with pytest.raises(RuntimeError, match=r"selected columns per row \(query tokens x K\)="):
        ops.resolve(st["resident"], st["recency"], torch.empty((rows, T, K), dtype=I32, device="cuda"),
                    st["miss_list"], st["miss_count"], st["counters"], st["inflight_slots"],
                    sel.cuda(), t32(history, "cuda"), t32(capacity, "cuda"), t32(lease, "cuda"),
                    U, P, I, 0)
    with pytest.raises(RuntimeError, match="scratch must be"):
        ops.resolve(st["resident"], st["recency"], torch.empty((rows, T, K), dtype=I32, device="cuda"),
                    st["miss_list"], st["miss_count"], st["counters"], st["inflight_slots"],
                    sel.cuda(), t32(history, "cuda"), t32(capacity, "cuda"), t32(lease, "cuda"),
                    U, P, I, 0, scratch[:100])


@pytest.mark.cuda
def test_mtp_wide_batch_on_cuda_allocates_its_scratch():
    """A CUDA batch with T = 4, K = 2048 allocates the resolve scratch and resolves
    [max_rows, 4, K] selections: every selected column gets an entry, equal for equal units."""
    a = kv.SparseSpec(tokens_per_unit=1, width=2048, slots=9216, max_inflight_tokens=16,
                      max_query_tokens=4)
    config = kv.CacheConfig(tokens_per_page=64, max_rows=2, max_tokens_per_row=20000,
                            gpu_budget_bytes=256 << 20, host_budget_bytes=64 << 20, device="cuda",
                            layers=[kv.LayerSpec("a", [kv.BufferSpec("kv", 64, sparse=True)],
                                                 sparse=a)])
    manager = kv.KVCacheManager(config)
    batch = kv.Batch(manager)
    seat(manager, batch, 2, history=16000, new=4)
    assert batch.group("a").resolve_scratch is not None
    sel = torch.randint(0, 16000, (2, 4, 2048), dtype=I32)
    sel[:, 1:] = torch.where(torch.rand(2, 3, 2048) < 0.9, sel[:, :1], sel[:, 1:])
    table = batch.resolve("a", sel.cuda()).cpu()
    assert bool((table >= 0).all())
    for r in range(2):
        entry = {}
        for u, e in zip(sel[r].flatten().tolist(), table[r].flatten().tolist()):
            assert entry.setdefault(u, e) == e


@pytest.mark.cuda
def test_mtp_captured_step_equals_eager():
    """A T = 2 step (resolve of [max_rows, 2, K], then fetch) captured in a CUDA graph and
    replayed leaves the same index table, residency, counters and cells as the same step run
    eagerly on an identical batch."""
    runs = []
    for captured in (False, True):
        manager = kv.KVCacheManager(mtp_config("cuda"))
        batch = kv.Batch(manager)
        seat(manager, batch, 3)
        gen = torch.Generator().manual_seed(12)
        sels = [torch.randint(-1, 20, (4, 2, 2), generator=gen, dtype=I32).cuda() for _ in range(3)]
        selected = torch.empty_like(sels[0])
        state = batch.group("b")

        def step():
            batch.resolve("b", selected)
            batch.fetch("b0", "b1")

        graph = None
        if captured:
            # the snapshot first: the side stream waits only for work queued before wait_stream,
            # so a clone queued after it could read what the warm-up already changed
            snapshot = [t.clone() for t in (state.resident, state.recency, state.counters)]
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):  # warm-up outside capture, then undone
                selected.copy_(sels[0])
                step()
            torch.cuda.current_stream().wait_stream(stream)
            for t, c in zip((state.resident, state.recency, state.counters), snapshot):
                t.copy_(c)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step()
        outs = []
        for sel in sels:
            selected.copy_(sel)
            graph.replay() if captured else step()
            torch.cuda.synchronize()
            outs.append(state.index_views[1].cpu().clone())
        runs.append((outs, state.resident.cpu(), state.recency.cpu(), state.counters.cpu(),
                     batch.cells("b0", "kv").cpu(), batch.cells("b1", "kv").cpu()))
    for a, b in zip(runs[0][0], runs[1][0]):
        assert torch.equal(a, b)
    for a, b in zip(runs[0][1:], runs[1][1:]):
        assert torch.equal(a, b)
