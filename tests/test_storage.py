"""Storage (STO-1..5): pool groups, views, budgets, slot allocation."""
import pytest

import torch_kvcm2 as kv
from configs import dsa_config
from inspect_state import pool_group, pool_reservation
from torch_kvcm2.memory import batch_reserve_bytes


def test_pool_groups_coalesce_by_life_cycle_sparsity_and_page_bytes():
    """STO-1: buffers sharing (window, sparse, page bytes) share a pool group, in config order."""
    manager = kv.KVCacheManager(dsa_config())
    summary = [(g["window"], g["sparse"], g["page_bytes"], g["buffers"])
               for g in manager.stats()["pool_groups"]]
    assert summary == [
        (None, True, 32, [("shared0", "kv"), ("shared1", "kv"), ("shared2", "kv"), ("private", "kv")]),
        (None, False, 16, [("shared0", "indexer_k"), ("shared1", "indexer_k"), ("shared2", "indexer_k")]),
        (8, False, 32, [("swa", "k"), ("swa", "v")]),
    ]
    assert manager.buffer("private", "kv").pos == 3
    assert manager.buffer("private", "scale").pool_group is None  # CFG-6: zero-size takes no memory


@pytest.mark.parametrize("changes", [{}, dict(window_layer=False), dict(layers=1, max_rows=1),
                                     dict(latent_bytes=4, latent_chunks=2, max_rows=7)])
def test_batch_reserve_from_the_config_alone_is_what_the_manager_reserves(changes):
    """STO-4: ``memory.batch_reserve_bytes(config)`` (what an example sizes its budgets with
    before building anything) counts the pool groups as Storage makes them and equals the
    reserve the manager takes."""
    from torch_kvcm2.memory import pool_group_count

    config = dsa_config(**changes)
    manager = kv.KVCacheManager(config)
    assert pool_group_count(config) == manager.pool_groups
    stats = manager.stats()
    assert batch_reserve_bytes(config) == {m: stats[m]["reserved_bytes"] for m in ("gpu", "host")}
    assert min(batch_reserve_bytes(config).values()) > 0


def test_sparse_groups_live_in_host_memory_dense_in_device_memory():
    """STO-2 (CPU build: every medium is CPU memory, the same code paths run)."""
    manager = kv.KVCacheManager(dsa_config())
    assert [g["medium"] for g in manager.stats()["pool_groups"]] == ["host", "gpu", "gpu"]
    for g in range(manager.pool_groups):
        host, device_side = manager.pool(g, device_side=False), manager.pool(g)
        assert host.device.type == "cpu" and device_side.data_ptr() == host.data_ptr()


def test_buffer_view_page_index_is_slot_times_scale_plus_pos():
    """STO-3: page s*scale+pos of a buffer's view is that buffer's page in slot s."""
    manager = kv.KVCacheManager(dsa_config(latent_chunks=2))
    view = manager.buffer_view("shared1", "kv")
    info = manager.buffer("shared1", "kv")
    assert (info.pool_group, info.scale, info.pos) == (0, 4, 1)
    slots = manager.stats()["pool_groups"][0]["slots"]
    data = pool_reservation(manager, 0)  # slot 5 is not committed yet: past manager.pool(0)
    assert tuple(view.shape) == (slots * 4, 2, 4, 4)
    view[5 * 4 + 1] = 7
    assert bool((data[5, 1] == 7).all()) and int(data.sum()) == 7 * 32
    by_slot = manager.slot_pages("shared1", "kv")
    assert tuple(by_slot.shape) == (slots, 2, 4, 4)
    assert bool((by_slot[5] == 7).all())
    empty = manager.buffer_view("private", "scale")
    assert tuple(empty.shape) == (0, 1, 4, 0)


def test_budgets_are_split_evenly_over_a_mediums_groups_after_the_batch_reserve():
    """STO-4: GPU and host budgets are accounted separately; stats() reports them."""
    manager = kv.KVCacheManager(dsa_config())
    stats = manager.stats()
    groups = stats["pool_groups"]
    reserve = batch_reserve_bytes(manager.config)
    slot_bytes = lambda g: g["page_bytes"] * g["scale"]
    for medium in ("gpu", "host"):
        mine = [g for g in groups if g["medium"] == medium]
        budget = 1 << 20
        expected = (budget - reserve[medium]) // sum(slot_bytes(g) for g in mine)
        assert all(g["slots"] == expected for g in mine)
        assert stats[medium]["used_bytes"] == 0
        assert stats[medium]["free_bytes"] == expected * sum(slot_bytes(g) for g in mine)
        assert stats[medium]["reserved_bytes"] == reserve[medium]
    cache = manager.create_cache()
    assert cache.resize(capacity=9)  # 3 pages in every group
    stats = manager.stats()
    assert [g["used_slots"] for g in stats["pool_groups"]] == [3, 3, 3]
    assert stats["host"]["used_bytes"] == 3 * slot_bytes(groups[0])


def test_a_budget_too_small_for_one_slot_raises_before_allocating():
    reserve = batch_reserve_bytes(dsa_config())
    with pytest.raises(ValueError, match="STO-4: the host budget .* cannot hold one slot"):
        kv.KVCacheManager(dsa_config(host_budget_bytes=reserve["host"] + 127))
    with pytest.raises(ValueError, match="STO-4: the gpu budget .* cannot hold one slot"):
        kv.KVCacheManager(dsa_config(gpu_budget_bytes=reserve["gpu"] + 10))
    with pytest.raises(ValueError, match="smaller than the memory of a batch"):
        kv.KVCacheManager(dsa_config(gpu_budget_bytes=reserve["gpu"] - 1))


def test_slots_are_handed_out_lowest_free_first_and_failures_take_nothing():
    """STO-5."""
    group = pool_group(kv.KVCacheManager(dsa_config()), 1)
    assert group.allocate(3) == [0, 1, 2]
    group.release([1])
    assert group.allocate(2) == [1, 3]
    free = group.free_slots
    assert group.allocate(free + 1) is None
    assert group.free_slots == free
