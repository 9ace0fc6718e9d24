"""The API's edges are consistent: closes are idempotent, numpy integers are ints, every call
after a close is refused, and a budget the pools cannot address is reported, not hidden."""
import logging

import numpy as np
import pytest
import torch

import torch_kvcm2 as kv


def small_manager(host_budget=4 << 20):
    sparse = kv.SparseSpec(tokens_per_unit=1, width=8, slots=16, max_inflight_tokens=4)
    layer = kv.LayerSpec("l0", [kv.BufferSpec("kv", 64, sparse=True), kv.BufferSpec("k", 16)],
                         sparse=sparse)
    config = kv.CacheConfig(tokens_per_page=16, max_rows=2, max_tokens_per_row=256,
                            layers=[layer], gpu_budget_bytes=4 << 20,
                            host_budget_bytes=host_budget, device="cpu")
    return kv.KVCacheManager(config)


def test_closes_are_idempotent():
    manager = small_manager()
    batch, cache = kv.Batch(manager), manager.create_cache()
    batch.add(cache)
    cache.close()
    cache.close()  # nothing again
    assert cache.closed
    batch.close()
    batch.close()
    other = manager.create_cache()
    manager.close()
    manager.close()
    other.close()  # the manager released everything: nothing to do, and no error
    assert other.closed


def test_numpy_integers_are_ints():
    manager = small_manager()
    cache = manager.create_cache()
    assert cache.resize(capacity=np.int64(20))
    assert cache.resize(capacity=np.int32(24), history=np.uint16(0))
    assert cache.capacity == 24
    with pytest.raises(TypeError, match="capacity must be an int"):
        cache.resize(capacity=np.float64(3.0))
    assert manager.can_fit(np.int64(16))


def test_every_call_after_close_is_refused():
    manager = small_manager()
    batch = kv.Batch(manager)
    batch.close()
    for call in (lambda: batch.cells("l0", "kv"), lambda: batch.page_table("l0", "k"),
                 lambda: batch.hit_miss(0), lambda: batch.host_tables(), batch.publish,
                 batch.poll):
        with pytest.raises(RuntimeError, match="batch is closed"):
            call()
    live = kv.Batch(manager)
    manager.close()
    for call in (lambda: live.cells("l0", "kv"), lambda: live.hit_rate(0), manager.metrics,
                 manager.stats, lambda: manager.buffer("l0", "kv"), manager.create_cache):
        with pytest.raises(RuntimeError, match="KVCacheManager is closed"):
            call()


def test_a_budget_beyond_int32_indices_is_reported(caplog):
    with caplog.at_level(logging.WARNING, logger="torch_kvcm2"):
        manager = small_manager(host_budget=10 ** 12)
    host = manager.stats()["host"]
    assert host["budget_bytes"] == 10 ** 12
    assert host["capped_bytes"] > 0
    assert any("capped_bytes" in r.getMessage() for r in caplog.records)
    slots = manager.stats()["pool_groups"][0]["slots"]
    assert slots * 16 <= 2 ** 31 - 1  # every token index of the view fits int32
    manager.close()
    assert small_manager().stats()["host"]["capped_bytes"] == 0
