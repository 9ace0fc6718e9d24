"""TIER-1: the host tier of the dense pool groups (docs/DESIGN.md, "Preemption frees the GPU").

``suspend(offload=True)`` moves a request's private dense pages to the host tier and frees their
GPU slots (a suspended request holds 0 GPU bytes by ``stats()``), shared prefix pages stay;
``resume()`` brings them back into any free GPU slots and the row's page table is republished
before a step reads it; no room on the host tier or the GPU changes nothing, also when the host
memory runs out half-way; ``can_fit`` and ``stats`` count both tiers. The data-safety model with
shared prefixes runs with random suspends (offloading or not), detached suspends, resumes,
exports, imports and closes between decode steps and reads every token of every buffer back by
content. On CUDA: the copies run on the copy stream with no host wait, the copy to host waits
for the compute stream's writes, freed slots are not overwritten before it ran, and the first
read after a resume waits for the copy back.
"""
import dataclasses
import os

import numpy as np
import pytest
import torch

import torch_kvcm2 as kv
from configs import dsa_config, import_history
from conftest import DEVICE_PARAMS
from inspect_state import (arrival_of, live_range, offload_of, page_row, slot_owners, slot_refs,
    tier_pages, tier_slot_refs)
from safety_model import MAX_ROWS, P as SAFETY_P
from sharing_model import SharingModel, check_index, reserved_bytes, slot_bytes_per_medium
from torch_kvcm2.config import BAD
from torch_kvcm2.host_region import PAGE_SIZE, HostMemoryOps
from torch_kvcm2.tiers import copy_segments, slot_runs

STEPS = int(os.environ.get("KVCM2_SAFETY_STEPS", "1000")) // 3


def dense_buffers(config):
    """(key, layer, role, bytes_per_token) of every dense buffer with pages."""
    return [(100 + i * 16 + j, layer.name, buf.role, buf.bytes_per_token)
            for i, layer in enumerate(config.layers) for j, buf in enumerate(layer.buffers)
            if buf.bytes_per_token and not buf.sparse]


def token_bytes(key, positions, nbytes, salt=0):
    t = torch.as_tensor(positions, dtype=torch.int64)[:, None]
    return ((t * 37 + key * 11 + salt * 101 + torch.arange(nbytes) * 5 + 1) % 256).to(torch.uint8)


def synchronize(manager):
    if manager.config.device.type == "cuda":
        torch.cuda.synchronize(manager.config.device)


def token_index(cache, layer, role, positions):
    P = cache.manager.config.tokens_per_page
    positions = torch.as_tensor(positions, dtype=torch.int64)
    pages = torch.from_numpy(cache.host_pages(layer, role))[positions // P]
    assert (pages >= 0).all()
    return pages, positions % P


def live(cache, layer, role, positions):
    """The positions whose pages the cache holds (a window releases pages)."""
    P = cache.manager.config.tokens_per_page
    positions = np.asarray(positions, dtype=np.int64)
    return positions[cache.host_pages(layer, role)[positions // P] >= 0]


def to_device(tensor, device):
    """``tensor`` on ``device`` without a host wait: on CUDA through pinned memory (a copy from
    pageable memory first waits for the stream's queued work, which the host-wait test must not)."""
    if device.type != "cuda":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)


def write_dense(cache, positions, salt=0):
    """Stand-in bytes into every dense buffer's live pages at ``positions`` (current stream; no
    host wait)."""
    manager = cache.manager
    for key, layer, role, nbytes in dense_buffers(manager.config):
        positions = live(cache, layer, role, positions)
        view = manager.buffer_view(layer, role)
        pages, offsets = token_index(cache, layer, role, positions)
        data = token_bytes(key, positions, nbytes, salt).view(len(pages), view.shape[1], -1)
        view[to_device(pages, view.device), :, to_device(offsets, view.device)] = to_device(data, view.device)


def read_dense(cache, layer, role, positions):
    """Read through ``host_pages`` (which orders the current stream after a resume's copy)."""
    view = cache.manager.buffer_view(layer, role)
    pages, offsets = token_index(cache, layer, role, positions)
    got = view[pages.to(view.device), :, offsets.to(view.device)]
    return got.reshape(len(pages), -1).cpu()


def check_dense(cache, positions, salt=0):
    for key, layer, role, nbytes in dense_buffers(cache.manager.config):
        positions = live(cache, layer, role, positions)
        assert len(positions)
        assert torch.equal(read_dense(cache, layer, role, positions),
                           token_bytes(key, positions, nbytes, salt)), (layer, role)


def gpu_slots_of(manager, caches):
    """Distinct GPU slots of the dense pool groups that ``caches`` hold."""
    held = set()
    dense = [g["index"] for g in manager.stats()["pool_groups"] if not g["sparse"]]
    for cache in caches:
        for g in dense:
            first, keep = live_range(cache, g)
            row = page_row(cache, g)[first:keep]
            held |= {(g, int(s)) for s in row[row >= 0]}
    return held


def tiered_manager(device, tier_slots=64, gpu_slots=None, **kwargs):
    """A dsa_config manager (two dense pool groups: indexer keys and a windowed layer) whose
    dense pool groups each have a host tier of ``tier_slots`` slots."""
    config = dsa_config(device, max_rows=4, max_tokens_per_row=64)
    probe = kv.KVCacheManager(config)
    dense = slot_bytes_per_medium(probe)["gpu"]  # the dense pool groups
    reserve = reserved_bytes(probe)
    probe.close()
    budgets = {"host_budget_bytes": config.host_budget_bytes + tier_slots * dense}
    if gpu_slots is not None:
        budgets["gpu_budget_bytes"] = reserve["gpu"] + gpu_slots * dense
    manager = kv.KVCacheManager(dataclasses.replace(config, **budgets),
                                host_tier_bytes=tier_slots * dense, **kwargs)
    assert all(g["host_tier"] is None or g["host_tier"]["slots"] == tier_slots
               for g in manager.stats()["pool_groups"])
    return manager


def tier_used(manager):
    return [None if g["host_tier"] is None else g["host_tier"]["used_slots"]
            for g in manager.stats()["pool_groups"]]


def test_slot_runs_cover_the_pairs_in_runs_consecutive_on_both_sides():
    assert slot_runs([], []) == []
    assert slot_runs([4, 5, 6, 9, 10, 2], [0, 1, 2, 3, 7, 8]) == [(4, 0, 3), (9, 3, 1), (10, 7, 1),
                                                                  (2, 8, 1)]
    assert slot_runs([3, 4], [1, 2]) == [(3, 1, 2)]


def test_copy_segments_never_cross_a_registration():
    # slots of 10 bytes; the tier starts at region offset 1000; registrations start at 1000,
    # 1025 and 1060: the run of tier slots 1..6 (bytes 10..70) is cut at 25 and 60
    assert copy_segments([5, 6, 7, 8, 9, 10], [1, 2, 3, 4, 5, 6], 10, 1000, [1000, 1025, 1060]) == \
        [(50, 10, 15), (65, 25, 35), (100, 60, 10)]
    assert copy_segments([0, 1], [7, 8], 10, 1000, []) == [(0, 70, 20)]
    assert copy_segments([0, 9], [0, 1], 10, 0, [10]) == [(0, 0, 10), (90, 10, 10)]


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_suspend_with_offload_holds_no_gpu_bytes_and_resume_brings_every_byte_back(device):
    manager = tiered_manager(device)
    batch = kv.Batch(manager)
    other = import_history(manager.create_cache(), 12)
    write_dense(other, np.arange(12), salt=1)
    batch.add(other)
    baseline = manager.stats()
    cache = import_history(manager.create_cache(), 30)
    write_dense(cache, np.arange(30))
    row = batch.add(cache)
    batch.publish()
    before = [cache.pages(g) for g in range(3)]
    assert manager.stats()["gpu"]["used_bytes"] > baseline["gpu"]["used_bytes"]

    assert cache.suspend() is True  # the default offloads: the manager has a host tier
    assert cache.suspended and cache.offloaded
    stats = manager.stats()
    assert stats["gpu"]["used_bytes"] == baseline["gpu"]["used_bytes"]  # 0 GPU bytes held
    assert gpu_slots_of(manager, [cache]) == set()
    assert cache.offloaded_pages() == [0, 8, 3]  # indexer keys: 8 pages; the window's 3 live
    assert tier_used(manager) == [None, 8, 3]
    tier_bytes = sum(g["host_tier"]["used_bytes"] for g in stats["pool_groups"] if g["host_tier"])
    assert tier_bytes == 8 * 3 * 16 + 3 * 2 * 32  # 8 slots of 3 indexer keys, 3 of the window's k, v
    assert stats["host"]["host_tier_used_bytes"] == tier_bytes
    assert stats["host"]["used_bytes"] == tier_bytes + sum(
        g["used_bytes"] for g in stats["pool_groups"] if g["medium"] == "host")
    assert cache.pages(0) == before[0]  # sparse pages stay on host pages
    assert set(cache.pages(1)) == {BAD}
    # the freed slots are reused at once (an unrelated request), writing other bytes there
    intruder = import_history(manager.create_cache(), 30)
    write_dense(intruder, np.arange(30), salt=2)
    intruder.close()
    batch.publish()
    assert batch.host_tables()["page_tables"][1][row].tolist() == [BAD] * manager.config.max_pages_per_row

    assert cache.resume() is True
    assert not cache.offloaded and tier_used(manager) == [None, 0, 0]
    with pytest.raises(RuntimeError, match="unpublished"):
        batch.resolve(0, torch.zeros(4, 4, dtype=torch.int32, device=device))
    batch.publish()  # the resumed row's page table is republished before any step
    tables = batch.host_tables()["page_tables"]
    for g in range(3):
        pages = cache.pages(g)
        assert tables[g][row][:len(pages)].tolist() == pages
        assert torch.equal(batch.page_tables[g][row].cpu(), torch.from_numpy(tables[g][row].copy()))
    assert cache.pages(0) == before[0]
    check_dense(cache, np.arange(30))
    check_dense(other, np.arange(12), salt=1)
    assert manager.metrics()["preemptions"] == 1 and manager.metrics()["resumes"] == 1
    cache.close()
    other.close()
    batch.close()
    stats = manager.stats()
    assert stats["gpu"]["used_bytes"] == stats["host"]["used_bytes"] == 0
    manager.close()


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_shared_prefix_pages_stay_on_the_gpu(device):
    manager = tiered_manager(device)
    owner = import_history(manager.create_cache(), 16)
    write_dense(owner, np.arange(16))
    ids = list(range(16))
    assert owner.commit(ids) == 16
    sharer = manager.create_cache(ids + [99] * 8)
    assert sharer.reused_tokens == 16
    assert sharer.resize(capacity=28)
    sharer.record_host_write(sharer.host_direct_end)
    assert sharer.resize(history=sharer.host_direct_end)
    assert sharer.resize(capacity=sharer.history_length)
    h = sharer.history_length
    write_dense(sharer, np.arange(16, h))
    shared = [sharer.pages(g)[:4] for g in range(3)]
    assert sharer.suspend(offload=True)
    # the four shared pages (refcount 2) stay with the suspended cache's reference; the
    # private ones moved
    assert sharer.pages(1)[:4] == shared[1]
    assert set(sharer.pages(1)[4:]) == {BAD}
    assert sharer.offloaded_pages()[1] == -(-h // 4) - 4
    assert all(slot_refs(manager, 1)[s] == 2 for s in shared[1])
    check_dense(owner, np.arange(16))  # the other sharer still reads them
    owner.close()  # the suspended cache keeps the shared pages alive
    assert sharer.resume()
    assert sharer.pages(1)[:4] == shared[1]
    check_dense(sharer, np.arange(h))
    sharer.close()
    manager.close()


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_no_room_on_the_host_tier_or_the_gpu_changes_nothing(device):
    manager = tiered_manager(device, tier_slots=3, gpu_slots=12)
    batch = kv.Batch(manager)
    cache = import_history(manager.create_cache(), 20)  # 5 pages of indexer keys
    write_dense(cache, np.arange(20))
    batch.add(cache)
    batch.publish()
    before = ([cache.pages(g) for g in range(3)], manager.stats())
    assert cache.suspend() is False  # the tier holds 3 slots per group
    assert not cache.suspended and not cache.offloaded
    assert ([cache.pages(g) for g in range(3)], manager.stats()) == before
    assert manager.metrics()["allocations_failed"] == 1 and manager.metrics()["preemptions"] == 0
    assert cache.suspend(offload=False)  # keeping the pages always works (REQ-4)
    assert [cache.pages(g) for g in range(3)] == before[0]
    assert cache.resume()

    small = import_history(manager.create_cache(), 8)  # 2 pages: fits the tier
    write_dense(small, np.arange(8), salt=3)
    assert small.suspend(offload=True)
    filler = manager.create_cache()  # takes every GPU slot left
    free = manager.stats()["pool_groups"][1]["free_slots"]
    assert filler.resize(capacity=4 * free)
    assert not manager.can_fit(0, resuming=[small])
    held = manager.stats()
    assert small.resume() is False  # no GPU slot to come back to
    assert small.suspended and small.offloaded and manager.stats() == held
    filler.close()
    assert manager.can_fit(0, resuming=[small]) and not manager.can_fit(64, count=4, resuming=[small])
    assert small.resume()
    check_dense(small, np.arange(8), salt=3)
    check_dense(cache, np.arange(20))
    with pytest.raises(ValueError, match="resuming must hold caches"):
        manager.can_fit(0, resuming=[object()])
    manager.close()


def test_offload_without_a_host_tier_and_bad_tier_sizes_are_refused():
    manager = kv.KVCacheManager(dsa_config())
    cache = import_history(manager.create_cache(), 8)
    with pytest.raises(ValueError, match="needs a host tier"):
        cache.suspend(offload=True)
    with pytest.raises(TypeError, match="offload must be a bool"):
        cache.suspend(offload=1)
    assert not cache.suspended
    assert cache.suspend()  # no tier: the default keeps the pages (REQ-4)
    assert not cache.offloaded and cache.pages(1) != [BAD] * 2
    assert all(g["host_tier"] is None for g in manager.stats()["pool_groups"])
    manager.close()
    with pytest.raises(ValueError, match="host_tier_bytes must be a non-negative int"):
        kv.KVCacheManager(dsa_config(), host_tier_bytes=-1)
    with pytest.raises(ValueError, match="must hold one slot of each of the 2 dense pool groups"):
        kv.KVCacheManager(dsa_config(), host_tier_bytes=8)
    with pytest.raises(ValueError, match="fit the host budget"):
        kv.KVCacheManager(dsa_config(), host_tier_bytes=1 << 21)
    sparse_only = kv.CacheConfig(
        tokens_per_page=4, layers=[kv.LayerSpec("s", [kv.BufferSpec("kv", 8, sparse=True)],
                                                sparse=kv.SparseSpec(1, 4, 12, 2))],
        max_rows=2, max_tokens_per_row=64, gpu_budget_bytes=1 << 20, host_budget_bytes=1 << 20)
    with pytest.raises(ValueError, match="no dense pool groups"):
        kv.KVCacheManager(sparse_only, host_tier_bytes=4096)
    # the tier comes out of the host budget: the sparse pools get the rest
    plain = kv.KVCacheManager(dsa_config())
    tiered = kv.KVCacheManager(dsa_config(), host_tier_bytes=1 << 19)
    slots = lambda m: m.stats()["pool_groups"][0]["slots"]
    assert slots(tiered) < slots(plain)
    assert tiered.stats()["host"]["host_tier_bytes"] == 1 << 19
    plain.close()
    tiered.close()


class ArmedOps(HostMemoryOps):
    """Real system calls, counted; once armed, every populate from the ``fail_from``-th on fails
    (the host memory runs out)."""

    def __init__(self):
        self.populates = 0
        self.fail_from = None

    def populate(self, address, nbytes):
        self.populates += 1
        if self.fail_from is not None and self.populates >= self.fail_from:
            raise MemoryError("injected: out of host memory")
        super().populate(address, nbytes)


def test_host_memory_running_out_mid_offload_leaves_cache_and_manager_usable():
    """The first tier's commit succeeds, the second's fails: the first is undone, the cache is
    as it was, every byte is accounted, and everything works once memory is back."""
    ops = ArmedOps()
    manager = tiered_manager("cpu", tier_slots=256, host_chunk_bytes=PAGE_SIZE, host_threads=1,
                             host_huge_pages=False, _host_ops=ops)
    cache = import_history(manager.create_cache(), 40)
    write_dense(cache, np.arange(40))
    pages = [cache.pages(g) for g in range(3)]
    stats = manager.stats()
    ops.fail_from = ops.populates + 2  # the indexer keys' tier commits, the window's does not
    assert cache.suspend(offload=True) is False
    assert ops.populates == ops.fail_from  # both commits were tried
    assert not cache.suspended and [cache.pages(g) for g in range(3)] == pages
    after = manager.stats()
    assert tier_used(manager) == [None, 0, 0]
    for key in ("used_bytes", "free_bytes", "shared_bytes", "cached_bytes"):
        assert after["gpu"][key] == stats["gpu"][key] and after["host"][key] == stats["host"][key]
    # committed memory stays committed (as for the sparse pools); the failed one rolled back
    assert after["pool_groups"][1]["host_tier"]["committed_bytes"] > 0
    assert after["pool_groups"][2]["host_tier"]["committed_bytes"] == 0
    ops.fail_from = None
    other = import_history(manager.create_cache(), 8)  # the manager is usable
    assert cache.suspend(offload=True) and cache.offloaded
    assert cache.resume()
    check_dense(cache, np.arange(40))
    other.close()
    cache.close()
    assert manager.stats()["gpu"]["used_bytes"] == manager.stats()["host"]["used_bytes"] == 0
    manager.close()


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_export_and_close_of_an_offloaded_cache(device):
    manager = tiered_manager(device)
    cache = import_history(manager.create_cache(), 26)
    write_dense(cache, np.arange(26))
    expected = cache.export()
    assert cache.suspend(offload=True)
    with pytest.raises(RuntimeError, match="in the host tier"):
        cache.commit(list(range(24)))  # its dense pages have no GPU slot to offer
    record = cache.export()  # reads the dense pages from the host tier
    for layer, roles in expected.pages.items():
        for role, data in roles.items():
            assert torch.equal(record.pages[layer][role], data), (layer, role)
    assert record.first_page == expected.first_page
    moved = manager.import_cache(record)
    check_dense(moved, np.arange(26))
    cache.close()  # frees the host tier pages
    assert tier_used(manager) == [None, 0, 0]
    moved.close()
    assert manager.stats()["gpu"]["used_bytes"] == manager.stats()["host"]["used_bytes"] == 0
    manager.close()


# ---- the copy back in pieces (resume_piece_bytes) ----
FILL = 0xEE  # what the GPU pools hold where a piece has not been copied back yet


def returning_order(cache):
    """(pool group, page ordinal, GPU slot) of the cache's offloaded pages in the order the
    copy back issues them: pool group by pool group, page ordinals ascending."""
    order = []
    for group, ordinals in sorted(offload_of(cache).ordinals.items()):
        order += [(group, int(i)) for i in ordinals]
    return order


def slot_bytes_of(manager, group, slot):
    return manager.pool(group, device_side=False)[slot].reshape(-1).cpu().clone()


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_resume_copies_back_in_pieces_one_per_publish_and_completes_at_the_first_read(device):
    """A detached resume copies the first piece at once and one more at each publish of any
    batch of the manager (one slot per piece here); tier slots are freed piece by piece; the
    first read of the pages issues the rest, and every byte comes back exactly."""
    manager = tiered_manager(device, resume_piece_bytes=1)  # every piece one slot
    batch = kv.Batch(manager)
    other = import_history(manager.create_cache(), 8)  # a batch whose publishes carry the pieces
    batch.add(other)
    batch.publish()
    cache = import_history(manager.create_cache(), 40)
    write_dense(cache, np.arange(40))
    synchronize(manager)
    dense = [g["index"] for g in manager.stats()["pool_groups"] if not g["sparse"]]
    before = {(g, i): slot_bytes_of(manager, g, int(page_row(cache, g)[i]))
              for g in dense for i in range(*live_range(cache, g))}
    assert cache.suspend(offload=True)
    order = returning_order(cache)
    assert len(order) > 4 and sorted(order) == sorted(before)
    synchronize(manager)
    for g in dense:  # what stays in a GPU slot no piece reached yet
        manager.pool(g, device_side=False).fill_(FILL)
    used = sum(n for n in tier_used(manager) if n)
    assert used == len(order)
    assert cache.resume()

    def issued():
        synchronize(manager)
        done = [torch.equal(slot_bytes_of(manager, g, int(page_row(cache, g)[i])), before[g, i])
                for g, i in order]
        untouched = [bool((slot_bytes_of(manager, g, int(page_row(cache, g)[i])) == FILL).all())
                     for g, i in order]
        assert all(a != b for a, b in zip(done, untouched))  # each page whole or not at all
        return sum(done)

    groups = manager.stats()["pool_groups"]
    sizes = [groups[g]["page_bytes"] * groups[g]["scale"] for g, _ in order]
    for publishes in range(3):
        k = 1 + publishes
        assert issued() == k, publishes  # the first k pieces, in order
        assert cache.returning_bytes == sum(sizes[k:])
        assert sum(n for n in tier_used(manager) if n) == len(order) - k  # freed as issued
        batch.publish()
    check_dense(cache, np.arange(40))  # host_pages issues the rest first
    assert cache.returning_bytes == 0 and issued() == len(order)
    assert sum(n for n in tier_used(manager) if n) == 0
    for c in (cache, other):
        c.close()
    batch.close()
    manager.close()


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_a_row_seated_with_pieces_left_gets_them_all_at_its_publish(device):
    manager = tiered_manager(device, resume_piece_bytes=1)
    batch = kv.Batch(manager)
    cache = import_history(manager.create_cache(), 40)
    write_dense(cache, np.arange(40))
    assert cache.suspend(offload=True)
    assert cache.resume() and cache.returning_bytes > 0
    row = batch.add(cache)
    batch.publish()  # the row's first publish: the rest of the copy, then its page entries
    assert cache.returning_bytes == 0
    assert batch.row_of(cache) == row
    check_dense(cache, np.arange(40))
    # a resume while seated: the same, at the next publish
    assert cache.suspend(offload=True) and cache.resume() and cache.returning_bytes > 0
    batch.publish()
    assert cache.returning_bytes == 0
    check_dense(cache, np.arange(40))
    cache.close()
    batch.close()
    manager.close()


def test_pieces_pack_whole_slots_of_several_pool_groups_within_the_budget():
    """Restore.take cuts a copy back into pieces of whole slots, pool group by pool group, of at
    most the budget; only a piece that could otherwise take nothing takes one slot over it."""
    from types import SimpleNamespace

    from torch_kvcm2.tiers import Restore

    storage = SimpleNamespace(groups=[SimpleNamespace(slot_bytes=100),
                                      SimpleNamespace(slot_bytes=300)])
    slots = lambda *xs: np.array(xs, dtype=np.int64)  # noqa: E731
    restore = Restore({0: (slots(1, 2, 3), slots(11, 12, 13)), 1: (slots(5, 6), slots(15, 16))})
    assert restore.pending_bytes(storage) == 900
    piece = restore.take(450, storage)  # the three 100-B slots, then no 300-B slot fits 150
    assert [(g, gpu.tolist(), tier.tolist()) for g, gpu, tier in piece] == \
        [(0, [1, 2, 3], [11, 12, 13])]
    assert restore.take(250, storage, at_least_one=False) == []  # a 300-B slot over 250
    piece = restore.take(250, storage)  # forced: one slot, over the budget
    assert [(g, gpu.tolist()) for g, gpu, _ in piece] == [(1, [5])]
    assert [(g, gpu.tolist()) for g, gpu, _ in restore.take(None, storage)] == [(1, [6])]
    assert restore.parts == {} and restore.pending_bytes(storage) == 0


def test_resume_piece_bytes_zero_copies_back_whole_and_bad_values_are_refused():
    manager = tiered_manager("cpu", resume_piece_bytes=0)
    cache = import_history(manager.create_cache(), 40)
    write_dense(cache, np.arange(40))
    assert cache.suspend(offload=True) and cache.resume()
    assert cache.returning_bytes == 0 and arrival_of(cache).parts == {}
    assert sum(n for n in tier_used(manager) if n) == 0
    check_dense(cache, np.arange(40))
    cache.close()
    manager.close()
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="resume_piece_bytes"):
            tiered_manager("cpu", resume_piece_bytes=bad)


# ---- random runs: the data-safety model with shared prefixes and the host tier ----
class TieringModel(SharingModel):
    """SharingModel whose requests also write their dense buffers (bytes by token id, like the
    sparse ones), get suspended with and without offload (seated, or detached and parked),
    resumed, exported (checked against what they wrote) and imported as new requests; every
    step checks the reference counts of both tiers and the stats, and every resume reads the
    dense history back."""

    def __init__(self, device, seed, slots, tier_slots, piece_bytes=None):
        super().__init__(device, seed, slots)
        self.batch.close()
        self.manager.close()
        config = self.config
        probe = kv.KVCacheManager(config)
        per, reserve = slot_bytes_per_medium(probe), reserved_bytes(probe)
        probe.close()
        tier_bytes = tier_slots * per["gpu"]
        self.manager = kv.KVCacheManager(dataclasses.replace(
            config, gpu_budget_bytes=reserve["gpu"] + slots * per["gpu"],
            host_budget_bytes=reserve["host"] + slots * per["host"] + tier_bytes),
            host_tier_bytes=tier_bytes,
            **({} if piece_bytes is None else {"resume_piece_bytes": piece_bytes}))
        self.batch = kv.Batch(self.manager)
        # with small pieces some detached resumes wait, pieces still coming back, before they
        # are seated (the engine's pattern) or closed
        self.pieces = piece_bytes is not None
        self.returning = []
        self.dense = [(200 + i, layer, role, nbytes)
                      for i, (_, layer, role, nbytes) in enumerate(dense_buffers(config))]
        self.parked = []  # suspended and detached
        self.counts = dict(offloaded=0, kept=0, refused=0, resumed=0, exported=0, imported=0,
                           parked=0, dense_checked=0, returning=0, seated_returning=0)

    # ---- dense bytes ----
    def write(self, group_index):
        super().write(group_index)
        if group_index:
            return
        for cache in self.batch.members().values():  # every in-flight token's dense bytes
            if cache.suspended or cache.capacity == cache.history_length:
                continue
            self.write_dense(cache, np.arange(cache.history_length, cache.capacity))

    def write_dense(self, cache, positions):
        ids = self.ids[cache.request_id][positions]
        for key, layer, role, nbytes in self.dense:
            view = self.manager.buffer_view(layer, role)
            pages, offsets = token_index(cache, layer, role, positions)
            data = self.content(key, torch.as_tensor(positions), ids, nbytes)
            view[pages.to(view.device), :, offsets.to(view.device)] = \
                data.view(len(pages), view.shape[1], -1).to(view.device)

    def dense_expected(self, cache, layer, role, key, nbytes, positions):
        ids = self.ids[cache.request_id][positions]
        return self.content(key, torch.as_tensor(positions), ids, nbytes)

    def live(self, cache, layer, role):
        """History positions whose pages the cache holds (the window releases pages)."""
        P = self.config.tokens_per_page
        h = cache.history_length
        group = self.manager.buffer(layer, role).pool_group
        first = live_range(cache, group)[0]
        return np.arange(first * P, h) if first * P < h else np.arange(0)

    def check_dense(self, cache):
        if cache.offloaded:  # pages in the host tier: read them through export
            record = cache.export()
            for key, layer, role, nbytes in self.dense:
                positions = self.live(cache, layer, role)
                first = record.first_page[layer]
                data = record.pages[layer][role]
                P = self.config.tokens_per_page
                got = data[positions // P - first, :, positions % P].reshape(len(positions), -1)
                assert torch.equal(got, self.dense_expected(cache, layer, role, key, nbytes,
                                                            positions)), (layer, role)
            self.counts["exported"] += 1
            return
        for key, layer, role, nbytes in self.dense:
            positions = self.live(cache, layer, role)
            if len(positions):
                assert torch.equal(read_dense(cache, layer, role, positions),
                                   self.dense_expected(cache, layer, role, key, nbytes,
                                                       positions)), (cache, layer, role)
                self.counts["dense_checked"] += len(positions)

    def check_host(self, cache):
        super().check_host(cache)
        self.check_dense(cache)

    # ---- the moves ----
    def suspend(self, cache):
        offload = self.rng.choice([None, True, False])
        if cache.suspend(offload=offload):
            self.counts["offloaded" if cache.offloaded else "kept"] += 1
            return True
        self.counts["refused"] += 1
        assert not cache.suspended
        return False

    def resume(self, cache, check=True):
        if not cache.resume():
            assert cache.suspended
            return False
        self.counts["resumed"] += 1
        if check:
            self.check_dense(cache)  # bit-exact, before the row's first step
        return True

    def returning_moves(self):
        """Seat (its first publish takes the rest of the copy back) or close a request resumed
        detached whose pieces were still coming back."""
        rng, batch = self.rng, self.batch
        if not self.returning or rng.random() > 0.3:
            return
        cache = self.returning.pop(rng.randrange(len(self.returning)))
        if rng.random() < 0.8 and len(batch.members()) < MAX_ROWS:
            self.counts["seated_returning"] += int(cache.returning_bytes > 0)
            batch.add(cache)
            batch.publish()
            assert cache.returning_bytes == 0
            self.check_dense(cache)
        else:
            self.check_host(cache)
            cache.close()
            self.caches.remove(cache)

    def membership(self):
        super().membership()
        rng, batch = self.rng, self.batch
        if self.pieces:
            self.returning_moves()
        members = batch.members()
        roll = rng.random()
        if roll < 0.10 and members:
            cache = rng.choice(list(members.values()))
            if cache.suspended:
                self.resume(cache)
            elif cache.history_length == cache.capacity:
                self.suspend(cache)
        elif roll < 0.16 and members:  # preempt like an engine: suspend, then leave the row
            cache = rng.choice(list(members.values()))
            if cache.history_length == cache.capacity and (cache.suspended or self.suspend(cache)):
                batch.remove(cache)
                self.parked.append(cache)
                self.counts["parked"] += 1
        elif roll < 0.22 and self.parked and len(members) < MAX_ROWS:
            cache = self.parked.pop(rng.randrange(len(self.parked)))
            if rng.random() < 0.5:  # resume detached, then sit down
                keep_away = self.pieces  # ... some steps later
                if not self.resume(cache, check=not keep_away):
                    self.parked.append(cache)
                    return
                if keep_away:
                    self.returning.append(cache)
                    self.counts["returning"] += 1
                    return
            row = batch.add(cache)
            if cache.suspended and not self.resume(cache):
                batch.remove(cache)
                self.parked.append(cache)
                return
            assert batch.row_of(cache) == row
        elif roll < 0.25 and self.parked:  # a parked request aborts
            cache = self.parked.pop(rng.randrange(len(self.parked)))
            self.check_host(cache)
            cache.close()
            self.caches.remove(cache)
        elif roll < 0.30 and members:  # export, check, and import as a new request
            cache = rng.choice(list(members.values()))
            if cache.history_length != cache.capacity or cache.history_length == 0:
                return
            h = cache.history_length
            ids = self.ids[cache.request_id]
            record = cache.export(ids[:h] if rng.random() < 0.5 else None)
            self.counts["exported"] += 1
            moved = self.manager.import_cache(record)
            if moved is None:
                return
            self.counts["imported"] += 1
            self.ids[moved.request_id] = ids
            self.caches.append(moved)
            self.everyone.append(moved)
            self.check_host(moved)
            if len(batch.members()) < MAX_ROWS:
                batch.add(moved)
            else:
                moved.close()
                self.caches.remove(moved)

    def step(self, number):
        super(SharingModel, self).step(number)
        check_both_tiers(self.manager, self.everyone)
        if number % 25 == 0:
            for cache in self.batch.members().values():
                self.check_dense(cache)


def check_both_tiers(manager, caches):
    """Every GPU slot's reference count is the number of open caches whose page rows hold it,
    every host tier slot is held by exactly one suspended cache (its offload) and the tiers'
    stats add up; free slots are unreferenced and uncommitted."""
    for group in manager.stats()["pool_groups"]:
        g, tier = group["index"], group["host_tier"]
        refs, owners, tier_refs = slot_refs(manager, g), slot_owners(manager, g), tier_slot_refs(manager, g)
        expected = np.zeros(group["slots"], dtype=np.int64)
        tier_expected = np.zeros(tier["slots"] if tier is not None else 0, dtype=np.int64)
        for cache in caches:
            if cache.closed:
                continue
            first, keep = live_range(cache, g)
            row = page_row(cache, g)[first:keep]
            offloaded = tier_pages(cache, g)
            if arrival_of(cache) is not None:  # a copy back with pieces not issued yet
                np.add.at(tier_expected, arrival_of(cache).tier_slots(g), 1)
            if offloaded is None:
                assert (row >= 0).all()
            else:
                assert cache.suspended
                slots = offloaded[1][first:keep]
                assert ((row >= 0) != (slots >= 0)).all()  # each page in exactly one tier
                np.add.at(tier_expected, slots[slots >= 0], 1)
            np.add.at(expected, row[row >= 0], 1)
        assert np.array_equal(refs, expected), g
        cached = (refs == 0) & (owners != 0)
        assert int(cached.sum()) == group["cached_slots"]
        assert int((refs > 0).sum()) + group["cached_slots"] + group["free_slots"] == group["slots"]
        if tier is not None:
            assert np.array_equal(tier_refs, tier_expected), g
            assert int((tier_refs > 0).sum()) + tier["free_slots"] == tier["slots"]
    stats = manager.stats()
    used = sum(g["host_tier"]["used_bytes"] for g in stats["pool_groups"] if g["host_tier"])
    assert stats["host"]["host_tier_used_bytes"] == used
    check_index(manager)


@pytest.mark.parametrize("seed,slots,tier_slots,piece_bytes", [
    (0, 80, 24, None), (1, 120, 400, None), (2, 400, 60, None),
    (3, 120, 60, 1), (4, 200, 120, 100)])  # copies back in pieces of one slot / ~2 slots
def test_random_runs_with_the_host_tier_lose_no_kv(device, seed, slots, tier_slots, piece_bytes):
    """Suspends with and without offload (seated and detached), resumes, exports, imports and
    closes between decode steps with shared prefixes under pool pressure; every selected token
    is read back from its cell, every history token of every buffer by content (dense pages
    after every resume, and from the host tier through export), and both tiers' reference
    counts are exact after every step."""
    model = TieringModel(device, seed, slots, tier_slots, piece_bytes)
    for number in range(STEPS):
        model.step(number)
    for cache in model.caches:
        model.check_host(cache)
    counts = model.counts
    assert model.checked_tokens > 1000 and counts["dense_checked"] > 1000
    assert counts["offloaded"] > 5 and counts["kept"] > 0 and counts["resumed"] > 5
    assert counts["parked"] > 0 and counts["imported"] > 0 and counts["exported"] > 0
    if tier_slots < 30:
        assert counts["refused"] > 0  # the small tier filled up
    if piece_bytes is not None:
        assert counts["returning"] > 0 and counts["seated_returning"] > 0, counts
    for cache in list(model.caches):
        cache.close()
    model.batch.close()
    stats = model.manager.stats()
    assert stats["gpu"]["used_bytes"] == 0 and stats["host"]["used_bytes"] == 0
    assert stats["host"]["host_tier_used_bytes"] == 0


# ---- CUDA: streams and events (no host waits; ordering against the compute stream) ----
@pytest.mark.cuda
def test_cuda_copies_run_on_the_copy_stream_without_host_waits_and_in_order():
    manager = tiered_manager("cuda")
    batch = kv.Batch(manager)
    # a first offload and resume commits (and registers with CUDA) the tier's host memory and
    # creates the copy stream: host work that may take longer than the sleeps below
    warm = import_history(manager.create_cache(), 40)
    assert warm.suspend(offload=True) and warm.resume()
    warm.close()
    cache = import_history(manager.create_cache(), 40)
    row = batch.add(cache)
    batch.publish()
    torch.cuda.synchronize()
    compute, copy = torch.cuda.current_stream(), manager.tier.stream
    # the offload copy waits for the compute stream's writes queued before it
    torch.cuda._sleep(50_000_000)
    write_dense(cache, np.arange(40), salt=5)  # queued behind the sleep
    with torch.cuda.stream(copy):
        torch.cuda._sleep(300_000_000)  # the copy to host starts long after the writes
    assert cache.suspend(offload=True)
    assert not compute.query() and not copy.query()  # the host did not wait
    # freed slots handed out at once: their writer waits for the copy (the fence); without it
    # these writes would land before the late copy read the pages
    intruder = import_history(manager.create_cache(), 40)
    write_dense(intruder, np.arange(40), salt=6)
    assert not compute.query()
    torch.cuda.synchronize()
    check_dense(intruder, np.arange(40), salt=6)
    intruder.close()
    # the copy back runs behind a busy copy stream; the first read after it waits on its event
    with torch.cuda.stream(manager.tier.stream):
        torch.cuda._sleep(200_000_000)
    assert cache.resume()
    assert not manager.tier.stream.query()  # still copying: resume did not wait
    batch.publish()  # the row's first publish orders the current stream after the copy
    assert arrival_of(cache) is None
    got = []
    for key, layer, role, nbytes in dense_buffers(manager.config):
        positions = live(cache, layer, role, np.arange(40))  # the window's pages, and the rest
        got.append((key, positions, nbytes, read_dense(cache, layer, role, positions)))
    torch.cuda.synchronize()
    for key, positions, nbytes, data in got:
        assert len(positions) and torch.equal(data, token_bytes(key, positions, nbytes, salt=5))
    assert batch.row_of(cache) == row
    cache.close()
    batch.close()
    manager.close()


@pytest.mark.cuda
def test_cuda_pieces_follow_the_compute_stream_and_the_first_read_waits_for_the_last():
    """Each piece of a copy back is queued after the compute stream's work so far (a late write
    to the slots it reuses lands first), and the publish that seats the row issues the rest
    behind a busy copy stream and orders the compute stream after it, with no host wait."""
    manager = tiered_manager("cuda", resume_piece_bytes=1)
    batch = kv.Batch(manager)
    warm = import_history(manager.create_cache(), 40)  # commits the tier, makes the copy stream
    assert warm.suspend(offload=True) and warm.resume()
    warm.close()
    other = import_history(manager.create_cache(), 8)
    batch.add(other)
    batch.publish()
    cache = import_history(manager.create_cache(), 40)
    write_dense(cache, np.arange(40), salt=5)
    assert cache.suspend(offload=True)
    torch.cuda.synchronize()
    compute, copy = torch.cuda.current_stream(), manager.tier.stream
    # the freed slots go to an intruder that writes them late (behind a sleep) and leaves
    intruder = import_history(manager.create_cache(), 40)
    taken = gpu_slots_of(manager, [intruder])
    torch.cuda._sleep(100_000_000)
    write_dense(intruder, np.arange(40), salt=9)
    intruder.close()
    assert cache.resume() and cache.returning_bytes > 0
    assert gpu_slots_of(manager, [cache]) & taken  # the resume reuses the intruder's slots
    batch.publish()
    batch.publish()
    with torch.cuda.stream(copy):
        torch.cuda._sleep(200_000_000)
    batch.add(cache)
    batch.publish()  # the rest of the copy, behind the sleep; the compute stream waits for it
    assert cache.returning_bytes == 0
    assert not compute.query() and not copy.query()  # the host did not wait
    got = [read_dense(cache, layer, role, live(cache, layer, role, np.arange(40)))
           for _, layer, role, _ in dense_buffers(manager.config)]
    for (key, layer, role, nbytes), data in zip(dense_buffers(manager.config), got):
        assert torch.equal(data, token_bytes(key, live(cache, layer, role, np.arange(40)),
                                             nbytes, salt=5)), (layer, role)
    for c in (cache, other):
        c.close()
    batch.close()
    manager.close()
