"""Reads never change state and never wait (API-2); the device comes back to the host through one
call, ``Batch.poll()``.

After a step whose lengths moved on the device (``finish_step``), every getter of a cache and a
batch, ``repr``, ``metrics()``, ``stats()`` and the buffer look-ups leave the whole state of the
manager, the batch and the caches exactly as it was (compared object by object, array by array,
tensor by tensor), and on CUDA run under ``torch.cuda.set_sync_debug_mode("error")``. Calls that
change rows from lengths refuse until ``poll()`` and name it; after it, the lengths are the
device's.
"""
import numpy as np
import pytest
import torch

import torch_kvcm2 as kv
from conftest import DEVICE_PARAMS
from stepping import ROWS, Driver, step


def _snapshot(value, seen, depth=0):
    """A comparable copy of ``value``: library objects by their attributes, numpy arrays and
    tensors by their bytes, containers element by element; other objects by identity."""
    if isinstance(value, torch.Tensor):
        return ("tensor", value.detach().cpu().clone())
    if isinstance(value, np.ndarray):
        return ("array", value.copy())
    if isinstance(value, (int, float, str, bool, type(None), np.generic)):
        return value
    if isinstance(value, (list, tuple)):
        return [_snapshot(v, seen, depth + 1) for v in value]
    if isinstance(value, dict):
        return {k: _snapshot(v, seen, depth + 1) for k, v in value.items()
                if not isinstance(k, torch.Tensor)}
    module = type(value).__module__ or ""
    if module.startswith("torch_kvcm2") and hasattr(value, "__dict__") and depth < 6:
        if id(value) in seen:
            return ("seen", id(value))
        seen.add(id(value))
        return {k: _snapshot(v, seen, depth + 1) for k, v in vars(value).items()}
    return ("object", id(value))


def _same(a, b, path="state"):
    if isinstance(a, tuple) and a and a[0] in ("tensor", "array"):
        assert isinstance(b, tuple) and b[0] == a[0], path
        if a[0] == "tensor":
            assert torch.equal(a[1], b[1]), path
        else:
            assert np.array_equal(a[1], b[1]), path
        return
    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), path
        for k in a:
            _same(a[k], b[k], f"{path}.{k}")
        return
    if isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{path}[{i}]")
        return
    assert a == b, (path, a, b)


def state_of(driver):
    return _snapshot({"manager": driver.manager, "batch": driver.batch,
                      "caches": list(driver.caches)}, set())


def read_everything(driver):
    manager, batch = driver.manager, driver.batch
    for cache in driver.caches:
        repr(cache)
        (cache.capacity, cache.history_length, cache.written, cache.host_direct_end,
         cache.closed, cache.suspended, cache.offloaded, cache.returning_bytes,
         cache.reserve_tokens, cache.seated_in, cache.offloaded_pages())
        batch.row_of(cache)
    batch.members(), batch.published, batch.pending_readback, batch.host_tables()
    batch.page_table("a0", "kv"), batch.cells("a0", "kv"), batch.hit_miss("g0")
    manager.metrics(), manager.stats(), manager.pool_groups
    manager.buffer("b0", "k"), manager.buffer_view("a0", "kv"), manager.slot_pages("b0", "kv")
    repr(manager)


def one_step(driver):
    selected, new_tokens = driver.inputs()
    step(driver.batch, selected, new_tokens)
    accepted = torch.ones(ROWS, dtype=torch.int32, device=driver.device)
    driver.batch.finish_step(accepted)


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_getters_repr_metrics_and_stats_change_nothing(device):
    driver = Driver(device, seed=11)
    for cache in driver.caches:
        cache.set_reserve(8)
        assert cache.resize()
    driver.batch.publish()
    one_step(driver)
    assert driver.batch.pending_readback
    before = state_of(driver)
    lengths = [(c.history_length, c.capacity) for c in driver.caches]
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
    try:
        read_everything(driver)
    finally:
        if device == "cuda":
            torch.cuda.set_sync_debug_mode("default")
    _same(before, state_of(driver))
    # the getters showed the host's lengths, not the device's: those come with the poll
    assert [(c.history_length, c.capacity) for c in driver.caches] == lengths
    driver.batch.poll()
    assert not driver.batch.pending_readback
    assert [(c.history_length, c.capacity) for c in driver.caches] == [
        (h + 1, c + 1) for h, c in lengths]


def test_the_state_comparison_sees_a_change():
    """The test of the test: a read that did change something is caught."""
    driver = Driver("cpu", seed=12)
    driver.batch.publish()
    one_step(driver)
    before = state_of(driver)
    driver.batch.poll()  # applies the read-back: the mirror, the queue and the counters move
    with pytest.raises(AssertionError):
        _same(before, state_of(driver))


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_calls_that_change_rows_refuse_until_poll_and_name_it(device):
    driver = Driver(device, seed=13)
    batch, cache = driver.batch, driver.caches[0]
    batch.publish()
    one_step(driver)
    with pytest.raises(RuntimeError, match=r"Batch\.poll\(\)"):
        batch.move(cache, ROWS - 1)
    newcomer = driver.manager.create_cache()
    assert newcomer.resize(capacity=4)
    batch.add(newcomer)  # seating needs no device lengths
    for call in (lambda: cache.resize(capacity=cache.capacity + 1),
                 lambda: batch.remove(cache, discard=True),
                 lambda: batch.resize_rows([batch.row_of(cache)], capacity=[40]),
                 lambda: batch.record_host_writes(),
                 lambda: cache.export(),
                 batch.publish):
        with pytest.raises(RuntimeError, match=r"Batch\.poll\(\)"):
            call()
    batch.poll()
    h = cache.history_length
    assert cache.resize(history=h, capacity=h + 2)
    batch.publish()
    newcomer.close()  # closing frees everything: it needs no poll
    batch.publish()
    one_step(driver)
    driver.caches[1].close()
    driver.caches.pop(1)
    batch.poll()
    batch.close(discard=True)


def test_poll_brings_counters_without_an_advance():
    """A loop that ends its steps with flush + resize (no advance) still sees its counters in
    metrics() after each poll: poll queues a read-back of its own."""
    driver = Driver("cpu", seed=14)
    driver.batch.publish()
    selected, new_tokens = driver.inputs()
    step(driver.batch, selected, new_tokens)
    assert not driver.batch.pending_readback  # flush to host-known targets: nothing owed
    assert driver.manager.metrics()["selection_groups"]["g0"]["hits"] + \
        driver.manager.metrics()["selection_groups"]["g0"]["misses"] == 0
    driver.batch.poll()
    seen = driver.manager.metrics()["selection_groups"]["g0"]
    hits, misses, _ = driver.batch.hit_miss("g0").tolist()
    assert (seen["hits"], seen["misses"]) == (hits, misses) and hits + misses > 0
