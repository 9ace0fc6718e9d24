"""API-1: every request's host state lives in the manager's request table, by slot; a KVCache is
a handle. Slots are reused after close and the table grows past its first size without any
handle seeing another request's state."""
import numpy as np
import pytest

import torch_kvcm2 as kv
from torch_kvcm2 import BAD
from configs import dsa_config
from inspect_state import page_rows


def test_slots_grow_and_are_reused_without_a_handle_seeing_another_request():
    manager = kv.KVCacheManager(dsa_config())
    table = manager.requests
    first = len(table.seat)
    caches = [manager.create_cache() for _ in range(first + 5)]  # past the first size
    assert len(table.seat) > first and len({c.slot for c in caches}) == len(caches)
    for i, cache in enumerate(caches):
        assert cache.resize(capacity=4 + i % 3)
    expected = {c.request_id: (c.capacity, c.pages(0)) for c in caches}
    closed = caches[3]
    slot = closed.slot
    closed.close()
    assert closed.slot is None and closed.closed and closed.capacity == 0
    with pytest.raises(RuntimeError, match="closed"):
        closed.pages(0)
    newcomer = manager.create_cache()
    assert newcomer.slot == slot  # the lowest free slot is reused
    assert newcomer.capacity == 0 and (page_rows(newcomer) == BAD).all()
    assert newcomer.resize(capacity=9)
    assert closed.capacity == 0 and closed.state == "closed"  # still sees nothing of it
    for cache in caches:
        if cache is not closed:
            assert (cache.capacity, cache.pages(0)) == expected[cache.request_id]
    # every held page is referenced once: the table and the pools agree
    held = np.concatenate([np.asarray(c.pages(0)) for c in caches + [newcomer] if not c.closed])
    assert len(set(held[held >= 0].tolist())) == int((held >= 0).sum())


def test_a_seated_request_is_read_by_slot_and_its_seat_is_cleared_on_close():
    manager = kv.KVCacheManager(dsa_config())
    batch = kv.Batch(manager)
    cache = manager.create_cache()
    assert cache.resize(capacity=5)
    row = batch.add(cache)
    batch.publish()
    assert cache.seated_in == (batch, row)
    assert manager.requests.seat[cache.slot][1] == row
    assert int(batch.host_tables()["lengths"][1, row]) == 5  # capacity published from the slot
    slot = cache.slot
    cache.close()
    assert manager.requests.seat[slot] is None and slot in manager.requests.free
    assert batch.members() == {}
