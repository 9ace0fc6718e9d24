"""OBS-1..3: manager.metrics() without a synchronisation, the Prometheus export, logging.

``scenario`` drives one deterministic CPU run whose every count is known by construction; the
tests compare metrics() and the scraped text format with those figures."""
import logging

import numpy as np
import pytest
import torch

import torch_kvcm2 as kv
from inspect_state import pool_group

P, ROWS, TOKEN_BYTES = 4, 4, 16
BAD = -1


def make_manager(device="cpu"):
    g0 = kv.SparseSpec(tokens_per_unit=1, width=4, slots=12, max_inflight_tokens=2,
                       selection_id="g0")
    latent = kv.BufferSpec("kv", TOKEN_BYTES, sparse=True)
    layers = [kv.LayerSpec("a0", [latent], sparse=g0), kv.LayerSpec("d0", [kv.BufferSpec("k", 8)])]
    config = kv.CacheConfig(tokens_per_page=P, layers=layers, max_rows=ROWS, max_tokens_per_row=64,
                            gpu_budget_bytes=1 << 20, host_budget_bytes=1 << 20, device=device)
    return kv.KVCacheManager(config)


def scenario(manager):
    """A run with known counts; returns the expected figures (see the comments)."""
    batch = kv.Batch(manager)
    cache = manager.create_cache()
    assert cache.resize(8)  # h 0, c 8: host-direct [0, 6), in flight [6, 8)
    batch.add(cache)
    batch.publish()
    cache.record_host_write(6)  # 6 tokens x 16 bytes declared host-direct
    batch.publish()
    batch.flush()  # the in-flight tokens 6, 7: 2 x 16 bytes flushed
    assert cache.resize(history=8)
    batch.publish()
    selected = torch.full((ROWS, 4), BAD, dtype=torch.int32)
    selected[0] = torch.tensor([0, 1, 2, 3])
    for _ in range(2):  # 4 misses, then 4 hits
        batch.resolve("g0", selected)
        batch.fetch("a0")
        batch.advance(torch.zeros(ROWS, dtype=torch.int32))  # queues the read-back
    batch.poll()
    cache.suspend()  # a preemption
    cache.resume()
    batch.publish()
    other = manager.create_cache()
    assert other.resize(4)
    batch.add(other)
    batch.publish()
    batch.remove(other, discard=True)  # an abort: 4 tokens in flight dropped
    other.close()
    batch.publish()
    assert not manager.can_fit(64, count=10 ** 6)  # a refused admission
    ids = list(range(100, 110))
    assert cache.commit(ids[:8]) == 8
    shared = manager.create_cache(ids)  # a prefix query of 10 tokens, 8 hit
    assert shared.reused_tokens == 8
    return batch, {"hits": 4, "misses": 4, "fetched_bytes": 4 * TOKEN_BYTES,
                   "flushed_bytes": 2 * TOKEN_BYTES, "host_direct_bytes": 6 * TOKEN_BYTES,
                   "preemptions": 1, "resumes": 1, "aborts": 1, "admissions_refused": 1,
                   "prefix": {"queries": 1, "queried_tokens": 10, "hit_tokens": 8}}


def check(m, expected, seated=1, suspended=0):
    g = m["selection_groups"]["g0"]
    assert (g["hits"], g["misses"], g["invalid"], g["fetched_bytes"]) == (
        expected["hits"], expected["misses"], 0, expected["fetched_bytes"])
    for key in ("flushed_bytes", "host_direct_bytes", "preemptions", "resumes", "aborts",
                "admissions_refused"):
        assert m[key] == expected[key], key
    assert m["allocations_failed"] == 0
    assert {k: m["prefix"][k] for k in expected["prefix"]} == expected["prefix"]
    assert m["advance"] == {"refused_rows": 0, "short_rows": 0}
    assert m["rows"] == {"seated": seated, "suspended": suspended}


def test_offloads_count_suspends_that_moved_dense_pages():
    """TIER-1: a suspend with the host tier moves the dense page (counted), one without does
    not; the Prometheus name follows."""
    base = make_manager()
    config = base.config
    base.close()
    manager = kv.KVCacheManager(config, host_tier_bytes=4096)
    caches = []
    for offload in (True, False):
        cache = manager.create_cache()
        assert cache.resize(capacity=4)
        cache.record_host_write(2)
        assert cache.resize(history=2) and cache.resize(capacity=2)
        assert cache.suspend(offload=offload)
        caches.append(cache)
    m = manager.metrics()
    assert (m["preemptions"], m["offloads"]) == (2, 1)
    assert [c.offloaded for c in caches] == [True, False]
    prometheus_client = pytest.importorskip("prometheus_client")
    from torch_kvcm2.metrics import register
    registry = prometheus_client.CollectorRegistry()
    register(manager, registry)
    assert "torch_kvcm2:num_offloads_total 1.0" in prometheus_client.generate_latest(registry).decode()


def test_metrics_counts_a_known_run():
    manager = make_manager()
    batch, expected = scenario(manager)
    m = manager.metrics()
    check(m, expected)
    assert batch.hit_rate("g0")["hits"] == 4  # the device agrees
    # gauges: two pages of one cache in every pool group (plus none cached: all referenced)
    stats = manager.stats()
    for pool, group in zip(m["pool_groups"], stats["pool_groups"]):
        assert pool["used_bytes"] == group["used_bytes"] and pool["used_bytes"] > 0
        assert pool["total_bytes"] == group["slots"] * (group["used_bytes"] // group["used_slots"])
        assert pool["cached_bytes"] == 0
    for medium in ("gpu", "host"):
        assert m["media"][medium]["used_bytes"] == stats[medium]["used_bytes"]
        assert m["media"][medium]["batch_bytes"] == stats[medium]["batch_bytes_in_use"]


def test_metrics_lag_and_survive_a_closed_batch():
    """Device counters come with the read-back (none before an advance); a closed batch's
    counts stay in the totals, and a new batch adds to them."""
    manager = make_manager()
    batch, expected = scenario(manager)
    batch.close(discard=True)
    m = manager.metrics()
    check(m, expected, seated=0)
    second = kv.Batch(manager)
    fresh = manager.create_cache()
    assert fresh.resize(4, history=0)
    second.add(fresh)
    second.publish()
    selected = torch.full((ROWS, 4), BAD, dtype=torch.int32)
    selected[0, 0] = 0
    second.resolve("g0", selected)
    live = second.hit_rate("g0")  # synchronises: the device's own counts
    assert live["hits"] + live["misses"] + live["invalid"] == 1
    before = manager.metrics()["selection_groups"]["g0"]
    assert (before["hits"], before["misses"], before["invalid"]) == (4, 4, 0)  # not read back
    second.advance(torch.zeros(ROWS, dtype=torch.int32))
    after = manager.metrics()["selection_groups"]["g0"]
    assert (after["hits"], after["misses"], after["invalid"]) == (
        4 + live["hits"], 4 + live["misses"], live["invalid"])


def test_allocation_failure_is_counted():
    manager = make_manager()
    caches = []
    while True:
        cache = manager.create_cache()
        if not cache.resize(64):
            break
        caches.append(cache)
    assert manager.metrics()["allocations_failed"] == 1


def test_logging_refused_admission(caplog):
    """OBS-3: a refused admission logs (debug) through the torch_kvcm2 logger."""
    caplog.set_level(logging.DEBUG, logger="torch_kvcm2")
    manager = make_manager()
    assert not manager.can_fit(64, count=10 ** 6)
    assert any(r.name == "torch_kvcm2.manager" and "refused" in r.getMessage()
               for r in caplog.records)


def test_metrics_module_without_prometheus(monkeypatch):
    """Without the extra, importing torch_kvcm2.metrics says how to install it."""
    import sys
    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    monkeypatch.setitem(sys.modules, "prometheus_client.core", None)
    monkeypatch.delitem(sys.modules, "torch_kvcm2.metrics", raising=False)
    with pytest.raises(ImportError, match=r"pip install -e \.\[metrics\]"):
        import torch_kvcm2.metrics  # noqa: F401


def test_logging_host_region_growth(caplog):
    """OBS-3: a pool group growing its committed host region logs (debug); the region's commit
    is stubbed, as pools sit in a host region only on CUDA or with a host group."""
    caplog.set_level(logging.DEBUG, logger="torch_kvcm2")
    from torch_kvcm2.storage import PoolGroup
    grown = []

    class Region:  # the region's commit, as PoolGroup.allocate calls it
        last_error = None

        def commit(self, ranges):
            grown.append(ranges)
            return True

    manager = make_manager()
    group = pool_group(manager, next(g["index"] for g in manager.stats()["pool_groups"]
                                     if g["sparse"]))
    group.region, saved = Region(), group.region
    try:
        old = group.committed_bytes
        group.committed_bytes = 0
        group.grow_range = lambda end: (0, 4096)
        group.allocate(1)
    finally:
        group.region = saved
        del group.grow_range
        group.committed_bytes = old
    assert grown
    assert any(r.name == "torch_kvcm2.storage" and "grew" in r.getMessage()
               for r in caplog.records)
    assert isinstance(group, PoolGroup)


def test_no_print_in_library():
    """OBS-3: no module of the library calls print (it logs)."""
    import ast
    import pathlib
    root = pathlib.Path(kv.__file__).parent
    calls = [f"{path.name}:{node.lineno}" for path in sorted(root.glob("*.py"))
             for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
             and node.func.id == "print"]
    assert not calls, calls


EXPECTED_TEXT = """\
torch_kvcm2:sparse_hits_total{selection_group="g0"} 4.0
torch_kvcm2:sparse_misses_total{selection_group="g0"} 4.0
torch_kvcm2:sparse_invalid_total{selection_group="g0"} 0.0
torch_kvcm2:kv_fetched_bytes_total{selection_group="g0"} 64.0
torch_kvcm2:kv_flushed_bytes_total 32.0
torch_kvcm2:kv_host_direct_bytes_total 96.0
torch_kvcm2:admissions_refused_total 1.0
torch_kvcm2:num_preemptions_total 1.0
torch_kvcm2:num_offloads_total 0.0
torch_kvcm2:num_resumes_total 1.0
torch_kvcm2:num_aborts_total 1.0
torch_kvcm2:allocations_failed_total 0.0
torch_kvcm2:prefix_cache_queries_total 10.0
torch_kvcm2:prefix_cache_hits_total 8.0
torch_kvcm2:prefix_cache_requests_total 1.0
torch_kvcm2:prefix_cache_evictions_total 0.0
torch_kvcm2:advance_refused_rows_total 0.0
torch_kvcm2:advance_short_rows_total 0.0
torch_kvcm2:gpu_history_promotions_total 0.0
torch_kvcm2:gpu_history_demotions_total 0.0
torch_kvcm2:gpu_history_promoted_bytes_total 0.0
torch_kvcm2:num_rows_seated 1.0
torch_kvcm2:num_rows_suspended 0.0
torch_kvcm2:num_rows_gpu_history 0.0
torch_kvcm2:gpu_history_bytes 0.0
torch_kvcm2:prefix_cache_cached_bytes 0.0
"""


def test_prometheus_scrape():
    prometheus_client = pytest.importorskip(
        "prometheus_client", reason="the [metrics] extra (prometheus_client) is not installed")
    from prometheus_client.utils import floatToGoString as number  # the text format's
    from torch_kvcm2.metrics import register

    manager = make_manager()
    _, expected = scenario(manager)
    registry = prometheus_client.CollectorRegistry()
    register(manager, registry)
    text = prometheus_client.generate_latest(registry).decode()
    samples = {line for line in text.splitlines() if line and not line.startswith("#")}
    for line in EXPECTED_TEXT.splitlines():
        assert line in samples, line
    m = manager.metrics()
    for pool in m["pool_groups"]:
        labels = f'{{medium="{pool["medium"]}",pool_group="{pool["index"]}"}}'
        for key in ("used", "cached", "total", "committed"):
            value = number(pool[f"{key}_bytes"])
            assert f"torch_kvcm2:kv_pool_{key}_bytes{labels} {value}" in samples
        usage = number(pool["used_bytes"] / pool["total_bytes"])
        assert f"torch_kvcm2:kv_cache_usage_perc{labels} {usage}" in samples
    for medium, values in m["media"].items():
        for key in ("used", "total", "batch"):
            assert (f'torch_kvcm2:kv_{key}_bytes{{medium="{medium}"}} '
                    f"{number(values[f'{key}_bytes'])}") in samples
    # the prefix is settable, and every sample is one of the above
    assert len(samples) == len(EXPECTED_TEXT.splitlines()) + 5 * len(m["pool_groups"]) + 6
    other = prometheus_client.CollectorRegistry()
    register(manager, other, prefix="engine")
    assert "engine:num_preemptions_total 1.0" in prometheus_client.generate_latest(other).decode()


def seat_decoding_rows(manager, batch, device):
    """ROWS requests seated in ``batch`` (6 tokens written to host, 2 in flight) and published;
    returns a decode step's inputs: every row selecting units 0-3, one token accepted."""
    for _ in range(ROWS):
        cache = manager.create_cache()
        cache.set_reserve(16)
        assert cache.resize(8)
        cache.record_host_write(6)
        batch.add(cache)
    batch.publish()
    selected = torch.zeros((ROWS, 4), dtype=torch.int32, device=device)
    selected[:, 1:] = torch.arange(1, 4, dtype=torch.int32, device=device)
    return selected, torch.ones(ROWS, dtype=torch.int32, device=device)


def decode_step(batch, selected, accepted):
    batch.resolve("g0", selected)
    batch.fetch("a0")
    batch.flush(batch.history + accepted)
    batch.advance(accepted)


class _Copy:
    """A read-back's copy as a lagging device leaves it: ``query`` is what the test says."""

    def __init__(self):
        self.arrived = False

    def query(self):
        return self.arrived

    def synchronize(self):
        assert self.arrived, "waited for a copy the test never finished"


def test_metrics_never_go_backwards_while_the_device_lags():
    """OBS-1: a device more than the ring behind the host (every queued read-back unfinished)
    does not send metrics() back to the last applied counters: a finished read-back whose
    buffer the ring takes back keeps its counters. On the CPU the copies are made at once, so
    each queued copy's event is a stand-in the test finishes by hand."""
    manager = make_manager()
    batch = kv.Batch(manager)
    readback = batch._readback
    copies = []
    queue = readback.queue_readback

    def lagging(moved=False):
        k = readback.next
        queue(moved)
        readback.events[k] = _Copy()
        copies.append(readback.events[k])

    readback.queue_readback = lagging
    selected, accepted = seat_decoding_rows(manager, batch, "cpu")
    misses = []
    for step in range(10):
        decode_step(batch, selected, accepted)
        if step == 1:  # the first two steps' read-backs arrive (the first has no miss:
            copies[0].arrived = copies[1].arrived = True  # h was 0), none after them
        misses.append(manager.metrics()["selection_groups"]["g0"]["misses"])
    assert misses[1] > 0 and len(readback.queue) == len(readback.buffers)
    assert misses[1:] == [misses[1]] * (len(misses) - 1)  # the newest that arrived, each step
    for copy in copies:
        copy.arrived = True
    del readback.queue_readback  # the device catches up: copies finish as they are queued
    assert manager.metrics()["selection_groups"]["g0"]["misses"] == int(batch.hit_miss("g0")[1])
    batch.close(discard=True)


@pytest.mark.cuda
def test_metrics_every_step_never_synchronises():
    """OBS-1/3 on CUDA: eager decode steps with sync debug mode "error" while metrics() is read
    every step (any host synchronisation raises)."""
    manager = make_manager("cuda")
    batch = kv.Batch(manager)
    selected, accepted = seat_decoding_rows(manager, batch, "cuda")
    torch.cuda.synchronize()
    misses = []
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(12):
            decode_step(batch, selected, accepted)
            misses.append(manager.metrics()["selection_groups"]["g0"]["misses"])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    batch.poll()
    assert misses == sorted(misses)  # counters only grow, lagging at most the ring
    assert manager.metrics()["selection_groups"]["g0"]["misses"] == int(batch.hit_miss("g0")[1])
