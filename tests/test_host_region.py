"""Host memory at scale (STO-6..9): reserve at start, commit in chunks, roll back, close, admit.

Registrations are counted through an injected ``HostMemoryOps`` (a CPU build has no driver to
register with); mappings are read from /proc/self/maps.
"""
import gc
import time

import pytest
import torch

import torch_kvcm2 as kv
from torch_kvcm2 import host_region
from torch_kvcm2.host_region import PAGE_SIZE, HostMemoryOps, HostRegion
from configs import dsa_config, import_history
from inspect_state import host_region as region_of, pool_group, take_slots, give_back_slots

GiB = 1 << 30


def mappings_overlapping(address, nbytes):
    """(start, end, permissions) of every mapping of this process that overlaps the range."""
    found = []
    with open("/proc/self/maps") as f:
        for line in f:
            span, perms = line.split()[:2]
            start, end = (int(x, 16) for x in span.split("-"))
            if start < address + nbytes and address < end:
                found.append((start, end, perms))
    return found


class CountingOps(HostMemoryOps):
    """Real populate/discard; registration simulated and counted (``live``); faults injected by
    making the ``fail_populate``-th populate or the ``fail_register``-th register raise."""

    def __init__(self, fail_populate=None, fail_register=None, available=None):
        self.fail_populate, self.fail_register, self.available = fail_populate, fail_register, available
        self.populates = self.registers = 0
        self.live = {}  # address -> bytes of simulated registrations

    def available_bytes(self):
        return super().available_bytes() if self.available is None else self.available

    def populate(self, address, nbytes):
        self.populates += 1
        if self.populates == self.fail_populate:
            raise MemoryError("injected: out of memory while populating")
        super().populate(address, nbytes)

    def register(self, address, nbytes, device):
        self.registers += 1
        if self.registers == self.fail_register:
            raise host_region.HostCommitError("injected: cudaHostRegister refused")
        assert address not in self.live
        self.live[address] = nbytes

    def unregister(self, address, nbytes, device):
        assert self.live.pop(address) == nbytes


def big_page_config(host_budget_bytes, gpu_budget_bytes=1 << 24, device="cpu", latent=656):
    """One sparse 656-B-per-token latent layer and one dense layer, 64-token pages: large enough
    slots that a 64 GiB budget is 64 GiB of pool (not capped by int32 page indices)."""
    sp = kv.SparseSpec(tokens_per_unit=64, width=4, slots=12, max_inflight_tokens=64)
    layers = [kv.LayerSpec("mla", [kv.BufferSpec("kv", latent, sparse=True)], sparse=sp),
              kv.LayerSpec("dense", [kv.BufferSpec("k", 64)])]
    return kv.CacheConfig(tokens_per_page=64, layers=layers, max_rows=4, max_tokens_per_row=1 << 20,
                          gpu_budget_bytes=gpu_budget_bytes, host_budget_bytes=host_budget_bytes,
                          device=device)


# ---- STO-6: reserve at start, commit as slots are first handed out ----

def test_a_host_budget_beyond_physical_memory_starts_at_once_and_commits_nothing():
    """64 GiB of host pool and 64 GiB of (CPU-device) dense pool on a machine with less RAM."""
    start = time.perf_counter()
    manager = kv.KVCacheManager(big_page_config(64 * GiB, gpu_budget_bytes=64 * GiB))
    elapsed = time.perf_counter() - start
    region = manager.stats()["host_region"]
    assert region["reserved_bytes"] >= 127 * GiB and region["committed_bytes"] == 0
    assert elapsed < 1.0, elapsed
    host = manager.stats()["pool_groups"][0]
    assert host["slots"] * host["page_bytes"] * host["scale"] > 63 * GiB
    assert host["free_slots"] == host["slots"]
    cache = manager.create_cache()
    assert cache.resize(capacity=64 * 10)  # 10 pages in each group: one chunk each
    stats = manager.stats()
    assert stats["host_region"]["committed_bytes"] == 2 * host_region.DEFAULT_CHUNK_BYTES
    assert stats["host"]["committed_bytes"] == host_region.DEFAULT_CHUNK_BYTES
    slot_bytes = sum(g["page_bytes"] * g["scale"] for g in stats["pool_groups"])
    assert stats["host_region"]["used_bytes"] == 10 * slot_bytes
    manager.close()


def chunked_manager(chunk=PAGE_SIZE, ops=None, **kwargs):
    """Chunks of single pages (base pages: huge pages would make every piece 2 MiB)."""
    return kv.KVCacheManager(dsa_config(host_budget_bytes=1 << 21, gpu_budget_bytes=1 << 21),
                             host_chunk_bytes=chunk, host_threads=2, _host_ops=ops,
                             host_huge_pages=False, **kwargs)


def test_growth_commits_whole_chunks_and_keeps_addresses_and_bytes():
    manager = chunked_manager()
    group = pool_group(manager, 0)  # 128-B slots: 32 per 4 KiB chunk
    per_chunk = PAGE_SIZE // group.slot_bytes
    address = group.data.data_ptr()
    first = group.allocate(per_chunk)
    assert first == list(range(per_chunk)) and group.committed_bytes == PAGE_SIZE
    group.data[first] = 7
    second = group.allocate(1)  # first slot of the second chunk
    assert second == [per_chunk] and group.committed_bytes == 2 * PAGE_SIZE
    group.data[second] = 9
    many = group.allocate(3 * per_chunk + 1)  # spans three more chunks at once
    assert many == list(range(per_chunk + 1, 4 * per_chunk + 2))
    assert group.committed_bytes == 5 * PAGE_SIZE
    assert group.data.data_ptr() == address and manager.buffer_view("shared0", "kv").data_ptr() == address
    assert manager.pool(0, device_side=False).shape[0] == 5 * per_chunk  # the committed slots
    assert bool((group.data[:per_chunk] == 7).all()) and bool((group.data[per_chunk] == 9).all())
    assert int(group.data[per_chunk + 1:].sum()) == 0  # fresh pages read zero
    assert manager.stats()["pool_groups"][0]["committed_bytes"] == 5 * PAGE_SIZE
    manager.close()


def test_lowest_free_first_holds_across_chunks():
    """STO-5: released slots in committed chunks come first, then the next fresh slots."""
    manager = chunked_manager()
    group = pool_group(manager, 0)
    per_chunk = PAGE_SIZE // group.slot_bytes
    group.allocate(2 * per_chunk)
    group.release([3, per_chunk + 5, 1])
    assert group.allocate(4) == [1, 3, per_chunk + 5, 2 * per_chunk]
    assert group.free_slots == group.num_slots - 2 * per_chunk - 1
    group.release(range(2 * per_chunk + 1))  # everything back: allocation restarts at 0
    assert group.allocate(2) == [0, 1]
    assert group.committed_bytes == 3 * PAGE_SIZE  # committed memory stays committed
    manager.close()


def test_resize_across_a_chunk_boundary_uses_the_pages_and_keeps_their_bytes():
    manager = chunked_manager()
    view = manager.slot_pages("shared0", "kv")
    a = manager.create_cache()
    import_history(a, 20)
    for p, slot in enumerate(a.pages(0)):
        view[slot] = p + 1
    for _ in range(13):  # 16 more pages each: several chunks of the sparse group
        assert manager.create_cache().resize(capacity=64)
    group = manager.stats()["pool_groups"][0]
    assert manager.stats()["host"]["committed_bytes"] >= 208 * group["page_bytes"] * group["scale"]
    assert [int(view[s].float().mean()) for s in a.pages(0)] == list(range(1, len(a.pages(0)) + 1))
    manager.close()


# ---- huge pages: aligned reservation, whole huge pages per piece, refusal tolerated ----

class NoHugeOps(HostMemoryOps):
    def advise_huge(self, address, nbytes):
        return False


@pytest.mark.parametrize("refused", [False, True])
def test_the_region_is_huge_page_aligned_and_works_when_huge_pages_are_refused(refused):
    huge = host_region.HUGE_PAGE
    region = HostRegion(3 * huge + PAGE_SIZE, chunk_bytes=huge, threads=2,
                        ops=NoHugeOps() if refused else None)
    assert region.address % huge == 0 and region.nbytes == 4 * huge
    # exactly the reservation is mapped: the over-mapped ends were trimmed
    spans = mappings_overlapping(region.address - huge, region.nbytes + 2 * huge)
    inside = [(max(a, region.address), min(b, region.address + region.nbytes))
              for a, b, _ in spans if a < region.address + region.nbytes and b > region.address]
    assert sum(b - a for a, b in inside) == region.nbytes
    assert region.stats()["huge_pages"] is (not refused)
    assert region.stats()["thp_mode"] in ("always", "madvise", "never", "unknown")
    assert all(n % (huge if not refused else PAGE_SIZE) == 0
               for _, n in region.pieces([(0, 4 * huge)]))
    assert region.commit([(huge, 2 * huge)])
    region.tensor[huge:3 * huge] = 5
    assert int(region.tensor[huge:3 * huge].sum()) == 5 * 2 * huge
    region.close()


# ---- STO-7: faults part-way roll back, nothing leaks ----

@pytest.mark.parametrize("fault", ["populate", "register", "available"])
def test_a_failed_commit_rolls_back_and_the_region_stays_usable(fault, monkeypatch):
    monkeypatch.setattr(host_region, "PIECE_BYTES", PAGE_SIZE)  # many pieces per commit
    ops = CountingOps(fail_populate=3 if fault == "populate" else None,
                      fail_register=3 if fault == "register" else None,
                      available=PAGE_SIZE if fault == "available" else None)
    region = HostRegion(64 * PAGE_SIZE, chunk_bytes=PAGE_SIZE, threads=4, device=0, ops=ops,
                        huge_pages=False)  # pieces of single pages
    assert region.commit([(0, 2 * PAGE_SIZE)]) is (fault != "available")
    before = (dict(ops.live), region.committed_bytes, region.registered_bytes)
    assert len(region.pieces([(2 * PAGE_SIZE, 8 * PAGE_SIZE)])) == 8
    assert region.commit([(2 * PAGE_SIZE, 8 * PAGE_SIZE)]) is False
    assert (dict(ops.live), region.committed_bytes, region.registered_bytes) == before
    reason = {"populate": "injected: out of memory while populating",
              "register": "injected: cudaHostRegister refused", "available": "out of host memory"}
    assert reason[fault] in region.last_error and region.failed_commits == 1 + (fault == "available")
    ops.fail_populate = ops.fail_register = None
    ops.available = None
    assert region.commit([(2 * PAGE_SIZE, 8 * PAGE_SIZE)])
    assert region.registered_bytes == region.committed_bytes == (10 if fault != "available" else 8) * PAGE_SIZE
    assert sum(ops.live.values()) == region.registered_bytes
    address, nbytes = region.address, region.nbytes
    region.close()
    assert ops.live == {} and region.registered_bytes == 0
    assert all(perms.startswith("---") for _, _, perms in mappings_overlapping(address, nbytes))
    del region
    gc.collect()
    assert mappings_overlapping(address, nbytes) == []


def test_a_resize_whose_commit_fails_returns_false_and_changes_nothing():
    """REQ-1 + STO-7 through the manager: the cache, the free lists and the committed bytes are
    as before; once memory is back the same resize succeeds."""
    ops = CountingOps(available=0)
    manager = chunked_manager(ops=ops)
    cache = manager.create_cache()
    counts = lambda: [(g["free_slots"], g["committed_bytes"]) for g in manager.stats()["pool_groups"]]
    before = counts()
    assert cache.resize(capacity=40) is False
    assert (cache.capacity, cache.pages(0), cache.pages(1)) == (0, [], [])
    assert counts() == before
    assert "out of host memory" in manager.stats()["host_region"]["last_error"]
    ops.available = None
    assert cache.resize(capacity=40) and cache.pages(0) == list(range(10))
    manager.close()


# ---- STO-9: close, use after close, garbage collection ----

def test_close_releases_the_region_and_everything_refuses_afterwards():
    manager = chunked_manager()
    batch = manager.create_batch()
    cache = manager.create_cache()
    import_history(cache, 12)
    batch.add(cache)
    batch.publish()
    region = region_of(manager)
    stats = manager.stats()["host_region"]
    address, nbytes = stats["address"], stats["reserved_bytes"]
    assert stats["committed_bytes"] > 0
    manager.close()
    manager.close()  # idempotent
    assert manager.closed and region.closed
    assert all(perms.startswith("---") for _, _, perms in mappings_overlapping(address, nbytes))
    for call in (manager.create_cache, manager.create_batch, lambda: kv.Batch(manager), manager.stats,
                 lambda: manager.can_fit(8), lambda: cache.resize(capacity=20),
                 lambda: cache.pages(0), batch.publish,
                 lambda: batch.fetch("shared0"), lambda: manager.buffer_view("shared0", "kv")):
        with pytest.raises(RuntimeError, match="closed"):
            call()
    cache.close()  # closes after the manager's: nothing left to release, no error
    batch.close()
    assert cache.closed
    del manager, batch, cache, region
    gc.collect()
    assert mappings_overlapping(address, nbytes) == []


def test_garbage_collection_of_an_unclosed_manager_releases_its_region():
    ops = CountingOps()
    manager = chunked_manager(ops=ops)
    caches = [manager.create_cache() for _ in range(8)]
    assert all(cache.resize(capacity=64) for cache in caches)
    stats = manager.stats()["host_region"]
    address, nbytes = stats["address"], stats["reserved_bytes"]
    assert mappings_overlapping(address, nbytes)
    view = manager.buffer_view("shared0", "kv")  # a live view keeps the memory
    del manager, caches, stats
    gc.collect()
    assert mappings_overlapping(address, nbytes) and int(view[0].sum()) == 0
    del view
    gc.collect()
    assert mappings_overlapping(address, nbytes) == []


# ---- STO-8: admission ----

def prefill(cache, tokens: int, history: int) -> bool:
    """A request's prefill: pages for ``tokens``, the host-direct part declared written, history
    advanced over it; False (nothing changed) when the pools cannot supply the pages."""
    if not cache.resize(capacity=tokens):
        return False
    cache.record_host_write(history)
    return cache.resize(history=history)


def test_can_fit_matches_what_the_first_resize_of_a_request_gets():
    manager = kv.KVCacheManager(dsa_config())
    config = manager.config
    history_of = lambda t: min(g.sparse.inflight_start(0, t) for g in config.selection_groups)
    free_slots = lambda: [g["free_slots"] for g in manager.stats()["pool_groups"]]
    free = free_slots()
    for tokens in (0, 1, 4, 9, 64):
        assert manager.can_fit(tokens) and manager.can_fit(tokens, count=0)
    assert free_slots() == free  # nothing changed
    # Fill the pools with requests of 64 tokens until can_fit says no; every admitted one fits.
    admitted = 0
    while manager.can_fit(64):
        cache = manager.create_cache()
        assert prefill(cache, 64, history_of(64))
        admitted += 1
    cache = manager.create_cache()
    assert prefill(cache, 64, history_of(64)) is False
    assert admitted > 0
    smallest = min(g["free_slots"] for g in manager.stats()["pool_groups"] if g["window"] is None)
    assert manager.can_fit(4, count=smallest) and not manager.can_fit(4, count=smallest + 1)


def test_can_fit_counts_a_windowed_group_at_the_prefill_peak():
    """A windowed group (window 8, 4-token pages) releases pages only once history advances, so
    a request's prefill needs all its prompt's pages there first: can_fit says no with fewer
    left, and the prefill indeed fails without changing anything; with enough left both agree."""
    config = dsa_config(layers=1, window_layer=True)
    manager = kv.KVCacheManager(config)
    free_slots = lambda: [g["free_slots"] for g in manager.stats()["pool_groups"]]
    swa = next(g["index"] for g in manager.stats()["pool_groups"] if g["window"] is not None)
    history = min(g.sparse.inflight_start(0, 64) for g in config.selection_groups)
    held = take_slots(manager, swa, free_slots()[swa] - 15)  # 15 pages left; 64 tokens need 16
    free = free_slots()
    assert not manager.can_fit(64)
    assert prefill(manager.create_cache(), 64, history) is False
    assert free_slots() == free
    give_back_slots(manager, swa, held[:1])
    assert manager.can_fit(64)
    cache = manager.create_cache()
    assert prefill(cache, 64, history)
    assert free_slots()[swa] > 0  # the window gave back what history left behind it


@pytest.mark.parametrize("pages, fits", [(None, True), (-2, True), (-3, False)])
def test_can_fit_with_a_prefill_chunk_counts_a_windowed_group_at_its_chunked_peak(pages, fits):
    """A 2,000-token request on a windowed group (window 40, 16-token pages) prefilled in chunks
    of 48 holds at most ``windowed_peak_pages`` pages (11): with exactly those,
    ``can_fit(prefill_chunk=48)`` says yes where ``can_fit`` (the whole prompt's 125 pages) says
    no, and the chunked prefill never fails. The bound keeps two pages of slack: the prefill
    also fits in 9, and fails in 8 (the planted shortfall)."""
    from torch_kvcm2.lengths import windowed_peak_pages

    P, W, C, T = 16, 40, 48, 2000
    layer = kv.LayerSpec("w", [kv.BufferSpec("kv", 64)], window=W)

    def config(budget):
        return kv.CacheConfig(tokens_per_page=P, layers=[layer], max_rows=1,
                              max_tokens_per_row=2048, gpu_budget_bytes=budget,
                              host_budget_bytes=1 << 20)
    probe = kv.KVCacheManager(config(1 << 24))
    stats = probe.stats()
    probe.close()
    page = sum(g["page_bytes"] * g["scale"] for g in stats["pool_groups"])
    peak = windowed_peak_pages(W, 0, C, P)
    assert peak == 11
    manager = kv.KVCacheManager(config(stats["gpu"]["reserved_bytes"]
                                       + (peak + (pages or 0)) * page))
    assert manager.can_fit(T, prefill_chunk=C) == (pages is None) and not manager.can_fit(T)
    batch = kv.Batch(manager)
    cache = manager.create_cache()
    row = batch.add(cache)
    while cache.history_length < T:
        h = cache.history_length
        n = min(C, T - h)
        if batch.resize_rows([row], capacity=[h + n]):
            break
        batch.publish()
        batch.finish_step(torch.tensor([n], dtype=torch.int32))
        batch.poll()
    assert (cache.history_length == T) == fits
    batch.close(discard=True)
    manager.close()


@pytest.mark.parametrize("kwargs, error, message", [
    ({"tokens": -1}, ValueError, "tokens must be >= 0"),
    ({"tokens": 1.5}, TypeError, "tokens must be an int"),
    ({"tokens": 65}, ValueError, "exceeds max_tokens_per_row"),
    ({"tokens": 4, "count": -2}, ValueError, "count must be >= 0"),
    ({"tokens": 4, "prefill_chunk": -1}, ValueError, "prefill_chunk must be >= 0"),
])
def test_can_fit_rejects_bad_arguments(kwargs, error, message):
    with pytest.raises(error, match=message):
        kv.KVCacheManager(dsa_config()).can_fit(**kwargs)


# ---- bad input ----

@pytest.mark.parametrize("kwargs, message", [
    ({"host_chunk_bytes": PAGE_SIZE + 1}, "host_chunk_bytes must be a positive multiple"),
    ({"host_chunk_bytes": 0}, "host_chunk_bytes must be a positive multiple"),
    ({"host_chunk_bytes": True}, "host_chunk_bytes must be a positive multiple"),
    ({"host_threads": 0}, "host_threads must be an int >= 1"),
    ({"host_threads": 1.0}, "host_threads must be an int >= 1"),
    ({"numa": "near"}, "numa must be 'auto', None or a NUMA node id"),
    ({"numa": -1}, "numa must be 'auto', None or a non-negative NUMA node id"),
    ({"numa": 4096}, "numa=4096: NUMA node 4096 is not online"),
    ({"prefill_host_bytes": -1}, "prefill_host_bytes must be a non-negative int"),
    ({"prefill_host_bytes": 1 << 30}, r"prefill_host_bytes \(1073741824\) exceeds the host pools"),
])
def test_bad_host_options_raise_naming_the_argument(kwargs, message):
    with pytest.raises(ValueError, match=message):
        kv.KVCacheManager(dsa_config(), **kwargs)


def test_a_budget_beyond_the_address_space_raises_naming_it():
    """4 PiB of 64 MiB pages (2 PiB after the int32 slot cap): more than a 47-bit address space."""
    with pytest.raises(ValueError, match="host_budget_bytes.*: .* host address space cannot be reserved"):
        kv.KVCacheManager(big_page_config(1 << 52, gpu_budget_bytes=4 * GiB, latent=1 << 20))


# ---- NUMA and prefill ----

def test_numa_auto_on_a_cpu_device_binds_nothing_and_an_explicit_node_binds_strictly():
    assert kv.KVCacheManager(dsa_config()).stats()["host_region"]["numa_node"] is None
    node = host_region.online_numa_nodes()[0]

    class Binds(CountingOps):
        calls = []

        def bind(self, address, nbytes, n, strict):
            self.calls.append((n, strict))
            super().bind(address, nbytes, n, strict)

    manager = kv.KVCacheManager(dsa_config(), numa=node, _host_ops=Binds())
    stats = manager.stats()["host_region"]
    assert (stats["numa_node"], stats["numa_strict"]) == (node, True) and Binds.calls == [(node, True)]
    assert manager.create_cache().resize(capacity=40)  # commits under the policy


def test_a_refused_strict_binding_raises_and_releases_the_reservation():
    class Refuses(CountingOps):
        def bind(self, address, nbytes, node, strict):
            self.address, self.nbytes = address, nbytes
            raise OSError(1, "injected: mbind refused")

    ops = Refuses()
    with pytest.raises(RuntimeError, match=r"numa=0: binding the host region to NUMA node 0 failed"):
        kv.KVCacheManager(dsa_config(), numa=0, _host_ops=ops)
    gc.collect()
    assert mappings_overlapping(ops.address, ops.nbytes) == []


def test_prefill_commits_that_much_at_start_in_parallel(monkeypatch):
    monkeypatch.setattr(host_region, "PIECE_BYTES", 5 * PAGE_SIZE)
    ops = CountingOps()
    manager = chunked_manager(ops=ops, prefill_host_bytes=10 * PAGE_SIZE)
    stats = manager.stats()
    assert stats["host"]["committed_bytes"] >= 10 * PAGE_SIZE and stats["gpu"]["committed_bytes"] == 0
    assert ops.populates == 2  # one commit, split over the two threads
    assert manager.create_cache().resize(capacity=40)
    assert manager.stats()["host"]["committed_bytes"] == stats["host"]["committed_bytes"]


def test_a_failed_prefill_raises_and_releases_the_reservation(monkeypatch):
    made = []
    init = HostRegion.__init__

    def recording_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append((self.address, self.nbytes))

    monkeypatch.setattr(HostRegion, "__init__", recording_init)
    with pytest.raises(RuntimeError, match="prefill_host_bytes: committing .* out of host memory"):
        chunked_manager(ops=CountingOps(available=0), prefill_host_bytes=PAGE_SIZE)
    gc.collect()
    assert len(made) == 1 and mappings_overlapping(*made[0]) == []


# ---- CUDA: the UVA view over a grown region ----

@pytest.mark.cuda
def test_cuda_region_registers_each_committed_chunk_and_close_unregisters_them():
    manager = kv.KVCacheManager(dsa_config("cuda", host_budget_bytes=1 << 22), host_chunk_bytes=1 << 16)
    group, region = pool_group(manager, 0), region_of(manager)
    assert group.device_data.device.type == "cuda" and region.registered_bytes == 0
    assert group.device_data.data_ptr() == group.data.data_ptr()  # device pointer == host pointer
    slots = group.allocate(2 * (1 << 16) // group.slot_bytes + 1)
    assert region.registered_bytes == region.committed_bytes == 3 << 16
    group.device_data[slots] = 5  # the GPU writes host pages of every committed chunk
    torch.cuda.synchronize()
    assert bool((group.data[slots] == 5).all())
    manager.close()
    assert region.registrations == 0


@pytest.mark.cuda
def test_a_captured_step_stays_valid_on_pages_of_chunks_committed_after_capture(monkeypatch):
    """STO-6 + INT-3: the UVA view covers the whole reservation from the start, so a graph
    captured early fetches and flushes pages in chunks committed (and registered) later; it
    replays bit-identical to an eager twin."""
    import functools

    import stepping

    monkeypatch.setattr(kv, "KVCacheManager",
                        functools.partial(kv.KVCacheManager, host_chunk_bytes=PAGE_SIZE))
    twins = stepping.CapturedTwins(seed=5)
    captured = twins.captured
    region, host = region_of(captured.manager), pool_group(captured.manager, 0)
    commits, limit = region.commits, host.committed_slots
    twins.replay(24, churn=(7, 15))
    assert region.commits > commits and region.registered_bytes == region.committed_bytes
    assert any(slot >= limit for cache in captured.caches for slot in cache.pages(0) if slot >= 0)
