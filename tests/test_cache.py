"""Requests (REQ-1..4): resize, windows, suspend/resume/close, and failure atomicity."""
import pytest

import torch_kvcm2 as kv
from torch_kvcm2 import BAD
from configs import dsa_config, import_history
from inspect_state import flushed, page_rows, released_slots, set_flushed, take_slots


def free_slots(manager):
    return [g["free_slots"] for g in manager.stats()["pool_groups"]]


def snapshot(manager, cache):
    return (cache.capacity, cache.history_length, cache.state,
            [list(p) for p in page_rows(cache)], free_slots(manager),
            [released_slots(manager, g) for g in range(manager.pool_groups)])


@pytest.fixture
def manager():
    return kv.KVCacheManager(dsa_config())


def test_resize_allocates_one_page_per_ordinal_in_every_group(manager):
    """REQ-1."""
    cache = manager.create_cache()
    assert cache.resize(capacity=10)
    cache.record_host_write(3)  # the prefill wrote tokens 0..2 straight to host pages
    assert cache.resize(history=3)
    assert (cache.capacity, cache.history_length) == (10, 3)
    assert [cache.pages(g) for g in range(3)] == [[0, 1, 2]] * 3
    assert cache.resize(capacity=5)  # shrink: the third page goes back
    assert [cache.pages(g) for g in range(3)] == [[0, 1]] * 3
    other = manager.create_cache()
    assert other.resize(capacity=1) and other.pages(0) == [2]  # the lowest free slot again


def test_failed_resize_returns_false_and_changes_nothing(manager):
    """REQ-1: allocation forced to fail leaves every field as it was."""
    # the dense indexer group is now nearly full
    assert take_slots(manager, 1, free_slots(manager)[1] - 5) is not None
    cache = manager.create_cache()
    assert cache.resize(capacity=6)
    cache.record_host_write(4)
    assert cache.resize(history=2)
    before = snapshot(manager, cache)
    assert cache.resize(capacity=6 + 4 * 4, history=4) is False
    assert snapshot(manager, cache) == before


@pytest.mark.parametrize("kwargs, message", [
    (dict(history=1), "REQ-2: history cannot decrease"),
    (dict(history=9), "REQ-2: history (9) cannot exceed capacity (8)"),
    (dict(capacity=65), "REQ-2: capacity (65) exceeds max_tokens_per_row (64)"),
    (dict(capacity=2), "REQ-2: history (4) cannot exceed capacity (2)"),
])
def test_impossible_lengths_raise_and_change_nothing(manager, kwargs, message):
    cache = manager.create_cache()
    assert cache.resize(capacity=8)
    cache.record_host_write(4)
    assert cache.resize(history=4)
    before = snapshot(manager, cache)
    with pytest.raises(ValueError) as err:
        cache.resize(**kwargs)
    assert str(err.value).startswith(message)
    assert snapshot(manager, cache) == before


@pytest.mark.parametrize("value", [-1, 2.0, True, "3"])
def test_bad_argument_types_raise(manager, value):
    cache = manager.create_cache()
    with pytest.raises((TypeError, ValueError)):
        cache.resize(capacity=value)
    assert cache.capacity == 0 and cache.pages(0) == []


def test_windowed_life_cycle_releases_pages_behind_the_window(manager):
    """REQ-3: pages wholly before h - window are released and read back as BAD."""
    cache = manager.create_cache()
    set_flushed(cache, 18)  # as if tokens 0..17 were on host pages already (SAFE-2 lets h reach 18)
    assert cache.resize(capacity=20, history=12)  # h - w = 4: page 0 is wholly before it
    assert cache.pages(2) == [BAD, 0, 1, 2, 3]  # page 0 never allocated
    assert cache.pages(0) == [0, 1, 2, 3, 4]  # full-attention groups keep everything
    assert cache.resize(history=18)  # h - w = 10: page 1 released too; page 2 holds 8..11, live
    assert cache.pages(2) == [BAD, BAD, 1, 2, 3]
    other = manager.create_cache()  # window 8, 4 tokens per page: group 2 is the windowed one
    assert other.resize(capacity=1) and other.pages(2) == [0]  # slot 0 (page 1) went back


def test_history_cannot_pass_what_was_flushed_or_written_to_host(manager):
    """SAFE-2: history advances through the host-written prefix [h, s0) only; in-flight tokens
    need a flush first. A shrink forgets flushed tokens beyond the new capacity."""
    cache = manager.create_cache()
    assert cache.resize(capacity=10)  # I = 2, U = 1: s0 = 8
    cache.record_host_write(8)  # the prefill wrote [0, 8) straight to host pages
    before = snapshot(manager, cache)
    with pytest.raises(ValueError, match=r"SAFE-2: history \(9\) cannot pass .* \(8\)"):
        cache.resize(history=9)
    assert snapshot(manager, cache) == before
    assert cache.resize(history=8)
    set_flushed(cache, 10)  # what Batch.flush records once the in-flight tokens are written back
    assert cache.resize(history=10)
    assert cache.resize(capacity=12)
    assert flushed(cache) == 10
    assert cache.resize(capacity=10) and flushed(cache) == 10


def test_in_flight_range_beyond_the_budget_is_refused():
    """CFG-3/OP-FLUSH: one row's in-flight range may not exceed max_total_input_tokens."""
    import torch_kvcm2 as kv
    config = dsa_config(max_inflight_tokens=8, slots=16)
    config = kv.CacheConfig(**{**{f: getattr(config, f) for f in (
        "tokens_per_page", "layers", "max_rows", "max_tokens_per_row", "gpu_budget_bytes",
        "host_budget_bytes", "device")}, "max_total_input_tokens": 5})
    cache = kv.KVCacheManager(config).create_cache()
    with pytest.raises(ValueError, match="in-flight range of 8 tokens exceeds"):
        cache.resize(capacity=8)
    assert cache.capacity == 0
    assert cache.resize(capacity=5)


def test_suspend_is_refused_while_tokens_are_in_flight(manager):
    """REQ-4."""
    cache = manager.create_cache()
    assert cache.resize(capacity=6)
    cache.record_host_write(4)
    assert cache.resize(history=4)
    with pytest.raises(RuntimeError, match="tokens are in flight"):
        cache.suspend()
    assert cache.state == "active"
    assert cache.resize(capacity=4)  # drop the unwritten tokens
    cache.suspend()
    assert cache.suspended and cache.pages(0) == [0]  # pages stay
    with pytest.raises(RuntimeError, match="suspended"):
        cache.resize(capacity=8)
    cache.resume()
    assert cache.state == "active"
    with pytest.raises(RuntimeError, match="not suspended"):
        cache.resume()


def test_close_frees_everything_and_refuses_every_later_call(manager):
    """REQ-4: a closed cache refuses every call with RuntimeError, except close, which does
    nothing again."""
    cache = import_history(manager.create_cache(), 9)
    free_before = free_slots(manager)
    cache.close()
    assert free_slots(manager) == [f + 3 for f in free_before]
    cache.close()  # idempotent: nothing freed twice
    assert cache.closed and free_slots(manager) == [f + 3 for f in free_before]
    for call in (lambda: cache.resize(capacity=1), cache.suspend, cache.resume,
                 lambda: cache.pages(0)):
        with pytest.raises(RuntimeError, match="closed"):
            call()
