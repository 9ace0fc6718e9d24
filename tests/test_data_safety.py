"""SAFE-1..4 and RES-1..4 over long random runs of the whole Batch API.

A model writes deterministic bytes per (layer, buffer, token). Thousands of steps of random
prefill, decode, speculative rejection, suspend, resume, join, leave and move run the documented
step order; every step every selected token is read back from its cell and compared, resolve is
compared with the independent reference model, and RES-1/RES-2 are checked; every few steps and
at the end every token of history is read back from its host page.

``KVCM2_SAFETY_STEPS`` sets the number of steps per seed (default 1000; the GPU script sets it).
"""
import os

import pytest
import torch

from safety_model import MAX_ROWS, P, Model
from inspect_state import flushed

STEPS = int(os.environ.get("KVCM2_SAFETY_STEPS", "1000"))


@pytest.mark.parametrize("seed,wide", [(0, False), (1, False), (2, True)])
def test_random_runs_lose_no_kv_and_keep_every_invariant(device, seed, wide):
    """SAFE-1..4, RES-1..4, OP-RESOLVE against the reference, OP-FETCH/OP-WRITE/OP-FLUSH bytes;
    `wide` gives layer b 4-KiB units."""
    model = Model(device, seed, wide=wide)
    for number in range(STEPS):
        model.step(number)
    for cache in model.caches:
        model.check_host(cache)
    assert model.checked_tokens > 1000
    hits, misses, invalid = model.batch.hit_miss(0).tolist()
    assert hits and misses and invalid


def test_history_cannot_advance_past_an_unflushed_in_flight_token():
    """SAFE-2 at batch level: without flush, history stops at the in-flight start."""
    model = Model("cpu", 3)
    cache = model.manager.create_cache()
    model.batch.add(cache)
    assert cache.resize(capacity=10)  # group a: s0 = 6 (I = 3, U = 2); group b: s0 = 8
    model.batch.publish()
    cache.record_host_write(8)  # the prefill wrote [0, s0) of each group to host pages
    with pytest.raises(ValueError, match="SAFE-2"):
        cache.resize(history=7)
    assert cache.resize(history=6)
    model.batch.publish()
    model.batch.flush()
    assert cache.resize(history=10)


def test_flush_writes_back_only_the_published_in_flight_range():
    """OP-FLUSH: units outside [max(h, s0), min(new_history, c)) are not written back; flush
    leaves resident and recency bit-identical; a resumed request flushes nothing."""
    model = Model("cpu", 4)
    batch, manager = model.batch, model.manager
    cache = model.manager.create_cache()
    batch.add(cache)
    assert cache.resize(capacity=9)  # group b (U=1, I=2): s0 = 7, in flight 7, 8
    batch.publish()
    cache.record_host_write(7)  # the prefill wrote [0, s0) of each group to host pages
    for group in model.config.selection_groups:
        batch.resolve(group.index, torch.full((MAX_ROWS, group.sparse.width), -1, dtype=torch.int32))
    cells = batch.cells("b", "kv")
    cells.fill_(0xAB)
    host = manager.slot_pages("b", "kv", device_side=False)
    host.fill_(0)
    state = batch.group("b")
    resident, recency = state.resident.clone(), state.recency.clone()
    new_history = [8, 0, 0, 0]  # token 8 stays in flight
    batch.flush(new_history)
    assert torch.equal(state.resident, resident) and torch.equal(state.recency, recency)
    slot = cache.pages(manager.buffer("b", "kv").pool_group)[1]  # tokens 4..7
    written = (host != 0).any(dim=-1).any(dim=1)  # [slot, token]
    assert written.nonzero().tolist() == [[slot, 3]]  # token 7 only
    assert bool((host[slot, :, 3] == 0xAB).all())
    with pytest.raises(ValueError, match=r"SAFE-2: history \(9\) cannot pass .* \(8\)"):
        cache.resize(history=9)
    assert cache.resize(history=8)


def resolve_all(model):
    for group in model.config.selection_groups:
        empty = torch.full((MAX_ROWS, group.sparse.width), -1, dtype=torch.int32)
        model.batch.resolve(group.index, empty.to(model.device))


def host_bytes(model):
    return [model.manager.slot_pages(layer, role, device_side=False).clone()
            for layer, role, *_ in model.buffers]


def test_prefilled_and_resumed_requests_flush_nothing_below_the_in_flight_range():
    """OP-FLUSH: tokens below s0 were written straight to host pages by the caller, so a
    prefilled request flushes only [s0, c) and a resumed one (nothing in flight) nothing."""
    model = Model("cpu", 5)
    batch = model.batch
    prefilled, resumed = model.manager.create_cache(), model.manager.create_cache()
    batch.add(prefilled)
    batch.add(resumed)
    assert resumed.resize(capacity=12)
    resumed.record_host_write(8)
    assert resumed.resize(history=8)  # s0 >= 8 in both groups
    resumed.resize(capacity=8)
    resumed.suspend()
    resumed.resume()
    assert prefilled.resize(capacity=20)  # group a: s0 = 16; group b: s0 = 18
    batch.publish()
    resolve_all(model)
    for layer, role, *_ in model.buffers:
        batch.cells(layer, role).fill_(0xAB)
    before = host_bytes(model)
    batch.flush()
    after = host_bytes(model)
    for (layer, role, _, group, _), old, new in zip(model.buffers, before, after):
        s0 = model.config.selection_groups[group].sparse.inflight_start(0, 20)
        changed = sorted({(s, t) for s, _, t in (old != new).any(dim=-1).nonzero().tolist()})
        pages = prefilled.pages(model.manager.buffer(layer, role).pool_group)
        assert changed == [(pages[t // P], t % P) for t in range(s0, 20)], (layer, role)


def test_an_over_wide_flush_is_refused_before_any_work():
    """OP-FLUSH: in-flight tokens over all rows beyond max_total_input_tokens (the flush work
    list) are refused by publish, before any step runs; nothing is published or flushed."""
    model = Model("cpu", 6, max_total_input_tokens=3)
    batch = model.batch
    caches = [model.manager.create_cache() for _ in range(2)]
    for cache in caches:
        batch.add(cache)
        assert cache.resize(capacity=2)  # 2 in-flight tokens each (group b), 4 in all
    tables = [t.clone() for t in (*batch.page_tables, batch.history, batch.capacity, batch.lease)]
    before = host_bytes(model)
    with pytest.raises(ValueError, match="4 in-flight tokens over all rows exceed"):
        batch.publish()
    assert not batch.published
    assert all(torch.equal(a, b) for a, b in zip(
        tables, (*batch.page_tables, batch.history, batch.capacity, batch.lease)))
    with pytest.raises(RuntimeError, match="unpublished"):
        batch.flush()
    assert all(torch.equal(a, b) for a, b in zip(before, host_bytes(model)))
    assert [flushed(c) for c in caches] == [0, 0]
    assert caches[1].resize(capacity=1)  # within the bound again
    batch.publish()
    resolve_all(model)
    batch.flush()
    assert caches[0].resize(history=2) and caches[1].resize(history=1)
