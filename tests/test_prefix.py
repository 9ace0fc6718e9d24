"""Prefix sharing (PFX-1..6, docs/PREFIX.md): commit, match, create_cache(token_ids), reference
counts, cached pages and their LRU eviction, the windowed rule, residency, bad input, and the
data-safety run extended with shared prefixes (every token of every request read back by
content, shared pages included)."""
import os
import random

import numpy as np
import pytest
import torch

import torch_kvcm2 as kv
from configs import dsa_config, import_history
from inspect_state import (collide_prefix_keys, host_region, prefix_keys, prefix_tables,
                           slot_refs)
from safety_model import MAX_ROWS, P as SAFETY_P, Model
from sharing_model import SharingModel, check_index, check_references, sized

STEPS = int(os.environ.get("KVCM2_SAFETY_STEPS", "1000")) // 2


def usage(manager):
    """Per pool group (used, shared, cached, free) slots."""
    return [(g["used_slots"], g["shared_slots"], g["cached_slots"], g["free_slots"])
            for g in manager.stats()["pool_groups"]]


def all_pages(cache):
    return [cache.pages(g) for g in range(cache.manager.pool_groups)]


def fill_pages(cache, seed):
    """Write a distinct byte pattern into every page the cache holds, in every pool group;
    returns {(group, page): bytes} to compare later."""
    manager, written = cache.manager, {}
    gen = torch.Generator().manual_seed(seed)
    for g in range(manager.pool_groups):
        pool = manager.pool(g, device_side=False)  # uint8[committed slots, scale, page_bytes]
        for page, slot in enumerate(cache.pages(g)):
            if slot >= 0:
                data = torch.randint(0, 256, tuple(pool.shape[1:]), generator=gen,
                                     dtype=torch.uint8)
                pool[slot] = data
                written[(g, page)] = data
    return written


def read_pages(cache, pages):
    manager = cache.manager
    return {(g, p): manager.pool(g, device_side=False)[cache.pages(g)[p]].clone() for g, p in pages}


# ---- PFX-1, PFX-2, PFX-4: commit, share, release, cache ----
def test_commit_share_and_close_keep_pages_cached_and_counted():
    manager = kv.KVCacheManager(dsa_config(window_layer=False))
    P = manager.config.tokens_per_page
    ids = np.arange(1000, 1030)
    owner = import_history(manager.create_cache(), 30)
    written = fill_pages(owner, 1)
    assert manager.match(ids) == 0
    assert owner.commit(ids[:30]) == 28  # 7 whole pages; the partial 8th stays private
    assert owner.commit(torch.from_numpy(ids[:30])) == 28  # idempotent
    entries = manager.stats()["prefix"]["entries"]
    assert entries == 7
    assert manager.match(ids) == 28 and manager.match(ids[:13]) == 12
    assert manager.match(list(range(1000, 1008)) + [5] * 8) == 8  # diverges in page 2
    before = usage(manager)
    sharer = manager.create_cache(ids.tolist())
    assert (sharer.history_length, sharer.capacity, sharer.written, sharer.reused_tokens) == (28,) * 4
    for g in range(manager.pool_groups):
        assert sharer.pages(g) == owner.pages(g)[:7]
    after = usage(manager)
    for (u0, s0, c0, f0), (u1, s1, c1, f1) in zip(before, after):
        assert (u1, s1, c1, f1) == (u0, s0 + 7, c0, f0)  # references only: nothing allocated
    # the sharer's reads of its shared pages are the owner's bytes
    shared = [k for k in written if k[1] < 7]
    assert all(torch.equal(v, written[k]) for k, v in read_pages(sharer, shared).items())
    # growth goes to fresh private pages; the shared ones are untouched
    assert sharer.resize(capacity=40)
    for g in range(manager.pool_groups):
        new = sharer.pages(g)[7:]
        assert not set(new) & set(owner.pages(g))
    owner.close()  # its 8th page is freed; the 7 shared stay referenced by the sharer
    assert [u[:3] for u in usage(manager)] == [(10, 0, 0)] * len(after)
    sharer.close()
    stats = usage(manager)
    assert all(used == 0 and shared == 0 and cached == 7 for used, shared, cached, _ in stats)
    check_references(manager, [owner, sharer])
    assert manager.match(ids) == 28  # cached pages stay matchable
    again = manager.create_cache(ids)
    assert all(torch.equal(v, written[k]) for k, v in read_pages(again, shared).items())
    assert manager.stats()["prefix"]["hit_rate"] == pytest.approx(56 / 60)


def test_chain_keys_cover_the_whole_prefix_and_a_sharer_extends_the_chain():
    manager = kv.KVCacheManager(dsa_config(window_layer=False))
    a = import_history(manager.create_cache(), 16)
    a.commit(list(range(16)))
    # same page 1 content after a different page 0: no match at all past page 0
    other = [99, 1, 2, 3] + list(range(4, 16))
    assert manager.match(other) == 0
    b = manager.create_cache(list(range(24)))
    assert b.reused_tokens == 16
    import_history(b, 24)  # prefill the rest
    assert b.commit(np.arange(24, dtype=np.int32)) == 24  # int32 ids hash like int64 ones
    assert manager.stats()["prefix"]["entries"] == 6
    c = manager.create_cache(torch.arange(30))
    assert c.reused_tokens == 24
    assert c.pages(0)[:4] == a.pages(0)[:4] and c.pages(0)[4:6] == b.pages(0)[4:6]
    check_references(manager, [a, b, c])


def test_equal_content_committed_twice_stays_private_and_never_double_owned():
    manager = kv.KVCacheManager(dsa_config(window_layer=False))
    a = import_history(manager.create_cache(), 8)
    b = import_history(manager.create_cache(), 12)
    a.commit(list(range(8)))
    b.commit(list(range(12)))  # pages 0, 1 exist (a's); page 2 is b's own
    assert manager.stats()["prefix"]["entries"] == 3
    c = manager.create_cache(list(range(12)))
    assert c.pages(0) == a.pages(0)[:2] + [b.pages(0)[2]]
    b.close()
    a.close()
    check_references(manager, [a, b, c])
    # b's pages 0 and 1 were private duplicates: freed at close, not cached
    assert usage(manager)[0][2] == 0 and (slot_refs(manager, 0)[c.pages(0)] == 1).all()


def test_key_collisions_never_share_other_ids():
    """Keys only find entries; sharing compares token ids and parents. With every key of a depth
    made equal (multipliers zeroed), no page of other ids is shared, and a colliding commit
    keeps its pages private."""
    manager = kv.KVCacheManager(dsa_config(window_layer=False))
    collide_prefix_keys(manager)  # key of page i: the depth salt alone
    a_ids = list(range(12))
    a = import_history(manager.create_cache(), 12)
    written = fill_pages(a, 3)
    assert a.commit(a_ids) == 12
    keys = prefix_keys(manager, np.arange(8), 2)
    assert len(set(keys.tolist()) & set(prefix_tables(manager).entry_of)) == 2
    assert manager.match([50] + a_ids[1:]) == 0  # page 0 differs: its key collides
    assert manager.match(a_ids[:4] + [50] + a_ids[5:]) == 4  # page 1 differs
    b_ids = a_ids[:4] + [7] * 8
    b = manager.create_cache(b_ids)
    assert b.reused_tokens == 4 and b.pages(0)[:1] == a.pages(0)[:1]
    import_history(b, 12)
    assert b.commit(b_ids) == 12  # pages 1, 2 collide with a's: they stay private
    assert manager.stats()["prefix"]["entries"] == 3
    assert manager.match(b_ids) == 4 and manager.match(a_ids) == 12
    c = manager.create_cache(a_ids)
    assert c.pages(0) == a.pages(0)[:3]
    shared = [k for k in written if k[1] < 3]
    assert all(torch.equal(v, written[k]) for k, v in read_pages(c, shared).items())
    check_references(manager, [a, b, c])


def test_a_page_whose_predecessor_was_evicted_waits_for_it_and_is_shared_again():
    """b's page 2 extends a's entries for pages 0, 1 (b's equal pages stayed private). Evicting
    a's pages keeps their entries slot-less (b's page 2 names one as its parent): nothing
    matches; b committing again gives them its slots, and the chain matches whole again."""
    manager = small_manager(8)
    a = import_history(manager.create_cache(), 8)
    a.commit(list(range(8)))
    b = import_history(manager.create_cache(), 12)
    b.commit(list(range(12)))  # pages 0, 1: a's entries; page 2: a new entry on b's slots
    a.close()  # a's 2 pages cached
    hog = manager.create_cache()
    assert hog.resize(capacity=20)  # 5 pages: 3 free + both cached evicted
    assert manager.stats()["prefix"]["evicted_slots"] == 2
    assert manager.match(list(range(12))) == 0
    assert manager.stats()["prefix"]["entries"] == 1  # b's page 2; pages 0, 1 hold no slot
    assert len(prefix_tables(manager).entry_of) == 3
    check_references(manager, [b, hog])
    assert b.commit(list(range(12))) == 12
    assert manager.stats()["prefix"]["entries"] == 3
    c = manager.create_cache(list(range(16)))
    assert c.reused_tokens == 12 and c.pages(0) == b.pages(0)[:3]
    check_references(manager, [b, hog, c])
    for cache in (b, c):
        cache.close()
    assert hog.resize(capacity=32)  # all 8 slots: every cached page evicted, every entry removed
    assert manager.stats()["prefix"]["entries"] == 0 and not prefix_tables(manager).entry_of
    check_references(manager, [hog])


def test_a_cached_entry_touched_by_a_duplicate_commit_stays_evictable():
    manager = small_manager(8)
    a = import_history(manager.create_cache(), 8)
    a.commit(list(range(8)))
    a.close()  # 2 cached
    b = import_history(manager.create_cache(), 8)
    b.commit(list(range(8)))  # equal content: b stays private, a's entries are used again
    hog = manager.create_cache()
    assert hog.resize(capacity=24)  # 6 pages: 4 free + both cached evicted
    assert manager.match(list(range(8))) == 0
    assert manager.stats()["prefix"]["evicted_slots"] == 2  # group 0 evicts; group 1 gets the freed
    check_references(manager, [b, hog])


# ---- PFX-4: eviction, LRU, failed allocation ----
def small_manager(slots, **kwargs):
    """A dsa_config manager (no windowed layer) whose pool groups hold ``slots`` slots each."""
    config = dsa_config(window_layer=False, max_rows=2, max_tokens_per_row=64)
    return sized(config, {"gpu": slots, "host": slots}, **kwargs)


def test_cached_pages_are_evicted_least_recently_used_first_and_only_without_free_slots():
    manager = small_manager(12)
    prompts = [list(range(100 * k, 100 * k + 8)) for k in range(3)]
    for k, ids in enumerate(prompts):  # three 2-page prompts committed, then closed
        cache = import_history(manager.create_cache(), 8)
        cache.commit(ids)
        cache.close()
    assert usage(manager)[0] == (0, 0, 6, 6)
    manager.create_cache(prompts[0]).close()  # prompt 0 used again: now the most recent
    assert manager.can_fit(48) and not manager.can_fit(52)  # cached pages count as free
    big = manager.create_cache()
    assert big.resize(capacity=24)  # 6 pages: the free slots, nothing evicted
    assert usage(manager)[0] == (6, 0, 6, 0)
    assert [manager.match(p) for p in prompts] == [8, 8, 8]
    assert big.resize(capacity=28)  # one more page: the oldest cached page goes, deepest first
    assert [manager.match(p) for p in prompts] == [8, 4, 8]
    assert big.resize(capacity=36)  # two more: prompt 1's first page, then prompt 2's second
    assert [manager.match(p) for p in prompts] == [8, 0, 4]
    check_references(manager, [big])
    # a failed allocation changes nothing: no eviction, no index change
    before = (usage(manager), manager.stats()["prefix"]["entries"], big.pages(0))
    assert not big.resize(capacity=64)
    assert (usage(manager), manager.stats()["prefix"]["entries"], big.pages(0)) == before
    assert [manager.match(p) for p in prompts] == [8, 0, 4]


def test_referenced_pages_are_never_evicted():
    manager = small_manager(8)
    owner = import_history(manager.create_cache(), 16)
    owner.commit(list(range(16)))
    sharer = manager.create_cache(list(range(16)))
    owner.close()
    hog = manager.create_cache()
    assert not hog.resize(capacity=20)  # 5 pages, only 4 free: the shared 4 are referenced
    assert hog.resize(capacity=16)
    assert manager.match(list(range(16))) == 16
    check_references(manager, [sharer, hog])
    sharer.close()
    assert hog.resize(capacity=32)  # now evictable
    assert manager.match(list(range(16))) == 0
    check_references(manager, [hog])


def test_a_failed_host_commit_after_free_slots_evicts_nothing():
    """The free slots' memory is committed before any eviction: a commit failure leaves the
    index and every count as they were (STO-5)."""
    manager = small_manager(40, host_chunk_bytes=4096)
    group = lambda: manager.stats()["pool_groups"][0]  # 128-byte slots: 32 per 4 KiB chunk
    assert group()["page_bytes"] * group()["scale"] == 128
    a = import_history(manager.create_cache(), 8)
    a.commit(list(range(8)))
    a.close()  # slots 0, 1 cached
    holders = [manager.create_cache(), manager.create_cache()]
    assert holders[0].resize(capacity=64) and holders[1].resize(capacity=56)  # slots 2..31
    assert group()["free_slots"] == 8 and group()["committed_bytes"] == 4096  # 32..39: no memory
    before = (usage(manager), manager.match(list(range(8))), manager.stats()["prefix"])
    region = host_region(manager)
    region_commit = region.commit
    region.commit = lambda ranges: False
    hog = manager.create_cache()
    try:
        assert not hog.resize(capacity=36)  # 9 pages: 8 free (their commit fails) + 1 evicted
    finally:
        region.commit = region_commit
    assert (usage(manager), manager.match(list(range(8))), manager.stats()["prefix"]) == before
    assert hog.resize(capacity=36)  # with memory: the free slots, then the LRU page (page 1)
    assert manager.match(list(range(8))) == 4
    assert manager.stats()["prefix"]["evicted_slots"] == 1
    check_references(manager, [*holders, hog])


# ---- PFX-5: windowed life cycles ----
def test_windowed_groups_match_only_the_pages_their_window_covers():
    """The swa group (window 8, P = 4) keeps pages [(h - 8) // 4, ...): a match of m pages
    needs full-attention pages [0, m) and windowed pages [(4m - 8) // 4, m); the match is the
    longest m for which they are committed, else shorter."""
    manager = kv.KVCacheManager(dsa_config())
    swa = next(g["index"] for g in manager.stats()["pool_groups"] if g["window"] is not None)
    ids = list(range(40))
    a = import_history(manager.create_cache(), 24)  # swa holds pages 4, 5
    assert a.pages(swa) == [-1] * 4 + a.pages(swa)[4:] and a.pages(swa)[4] >= 0
    a.commit(ids[:24])
    assert manager.match(ids[:24]) == 24  # window of h = 24: pages 4, 5: held
    assert manager.match(ids[:20]) == 0  # h = 20 needs pages 3, 4: 3 is gone; so are 2..0's
    b = manager.create_cache(ids)
    assert b.reused_tokens == 24 and b.pages(swa) == a.pages(swa)[:6]
    assert slot_refs(manager, swa)[a.pages(swa)[4]] == 2
    # b grows: its window moves on and drops the shared windowed pages it no longer covers
    import_history(b, 36)
    assert b.pages(swa)[:7] == [-1] * 7
    b.commit(ids[:36])  # pages 6..8: swa holds 7, 8 of them (b's window at 36)
    assert manager.match(ids[:36]) == 36
    assert manager.match(ids[:32]) == 24  # h = 32 needs swa page 6: gone; h = 28 needs 5, 6
    check_references(manager, [a, b])
    # a windowed slot's eviction only drops that page: the full-attention pages stay matchable
    a.close()
    b.close()
    assert manager.match(ids) == 36


def test_windowed_eviction_drops_only_the_windowed_page_and_shortens_the_match():
    """A windowed group in another medium (fewer slots) runs out first: its LRU cached slot is
    evicted alone; the entries stay, and the match shrinks to what the window rule allows."""
    full = kv.SparseSpec(1, 4, 12, 2)
    layers = [kv.LayerSpec("full", [kv.BufferSpec("kv", 8, sparse=True)], sparse=full),
              kv.LayerSpec("swa", [kv.BufferSpec("k", 8)], window=8)]
    config = kv.CacheConfig(tokens_per_page=4, layers=layers, max_rows=2, max_tokens_per_row=64,
                            gpu_budget_bytes=1 << 20, host_budget_bytes=1 << 20, device="cpu")
    manager = sized(config, {"gpu": 6, "host": 32})
    cached = lambda: tuple(g["cached_slots"] for g in manager.stats()["pool_groups"])  # host, swa
    ids = list(range(16))
    a = import_history(manager.create_cache(), 16)  # swa holds pages 2, 3
    a.commit(ids)
    a.close()
    assert manager.match(ids) == 16
    assert cached() == (4, 2)
    hog = manager.create_cache()
    assert hog.resize(capacity=16)  # 4 pages: swa has 4 free
    assert manager.match(ids) == 16
    assert hog.resize(capacity=20)  # a 5th: swa evicts its LRU cached slot (page 3's)
    assert cached() == (4, 1)
    assert manager.stats()["prefix"]["entries"] == 4
    assert manager.match(ids) == 0  # m = 4 needs swa page 3; m <= 3 needs pages never held
    check_references(manager, [hog])
    assert not hog.resize(capacity=28)  # swa: 1 free + 1 cached < 2 more: nothing changes
    assert cached() == (4, 1)


def test_without_full_attention_groups_only_the_window_is_needed():
    sparse = kv.SparseSpec(1, 4, 12, 2)
    layers = [kv.LayerSpec("w", [kv.BufferSpec("kv", 8, sparse=True)], sparse=sparse, window=8)]
    config = kv.CacheConfig(tokens_per_page=4, layers=layers, max_rows=2, max_tokens_per_row=64,
                            gpu_budget_bytes=1 << 20, host_budget_bytes=1 << 20, device="cpu")
    manager = kv.KVCacheManager(config)
    ids = list(range(30))
    a = import_history(manager.create_cache(), 24)  # holds pages 4, 5 only
    assert a.commit(ids[:24]) == 24
    assert manager.stats()["prefix"]["entries"] == 2  # pages behind the window are not offered
    assert manager.match(ids) == 24
    assert manager.match(ids[:20]) == 0  # h = 20 would need page 3
    b = manager.create_cache(ids)
    assert b.reused_tokens == 24 and b.pages(0) == [-1] * 4 + a.pages(0)[4:6]
    check_references(manager, [a, b])


# ---- PFX-3: write paths never reach shared or committed pages ----
def test_a_shared_cache_writes_only_its_private_pages_through_the_batch():
    model = Model("cpu", 11)
    manager, batch = model.manager, model.batch
    ids = list(range(7, 7 + 40))
    owner = import_history(manager.create_cache(), 20)
    owner.commit(ids[:20])
    groups = range(manager.pool_groups)
    committed = {g: set(owner.pages(g)[:5]) - {-1} for g in groups}
    snapshot = [manager.pool(g, device_side=False).clone() for g in groups]
    sharer = manager.create_cache(ids)
    batch.add(sharer)
    assert sharer.resize(capacity=31)  # a prefill of 11 tokens
    batch.publish()
    for group in model.config.selection_groups:
        batch.resolve(group.index, torch.full((MAX_ROWS, group.sparse.width), -1,
                                              dtype=torch.int32))
    for layer, role, *_ in model.buffers:
        positions = torch.full((MAX_ROWS, 11), -1, dtype=torch.int32)
        positions[batch.row_of(sharer)] = torch.arange(20, 31, dtype=torch.int32)
        host = batch.host_token_indices(layer, role, positions.to(batch.config.device))
        info = manager.buffer(layer, role)
        slots = host[host >= 0].long() // SAFETY_P // info.scale
        assert not set(slots.tolist()) & committed[info.pool_group]
        batch.cells(layer, role).fill_(0x5A)
    batch.record_host_writes()
    batch.flush()
    assert sharer.resize(history=31)
    for g, before in zip(groups, snapshot):
        pool = manager.pool(g, device_side=False)
        for slot in committed[g]:
            assert torch.equal(pool[slot], before[slot]), (g, slot)


# ---- PFX-6: residency ----
def test_a_shared_request_starts_with_empty_residency_and_fetches_the_shared_pages():
    model = Model("cpu", 12)
    manager, batch = model.manager, model.batch
    ids = list(range(500, 540))
    owner = manager.create_cache()
    batch.add(owner)
    assert owner.resize(capacity=36)
    batch.publish()
    for group in model.config.selection_groups:
        batch.resolve(group.index, torch.full((MAX_ROWS, group.sparse.width), -1,
                                              dtype=torch.int32))
    model.write(0)  # every group's tokens of [0, s0) to host pages, the rest into cells
    model.write(1)
    batch.record_host_writes()
    batch.flush()
    assert owner.resize(history=36)
    owner.commit(ids[:36])
    batch.remove(owner)
    sharer = manager.create_cache(ids)
    assert sharer.reused_tokens == 36
    batch.add(sharer, row=2)
    batch.publish()
    for group in model.config.selection_groups:
        state = batch.groups[group.index]
        assert (state.resident[2] < 0).all()  # a fresh lease: nothing resident
        U = group.sparse.tokens_per_unit
        selected = torch.full((MAX_ROWS, group.sparse.width), -1, dtype=torch.int32)
        selected[2] = torch.arange(group.sparse.width, dtype=torch.int32) + 36 // U - group.sparse.width
        index = batch.resolve(group.index, selected)
        for layer in group.layers:
            batch.fetch(layer)
        model.check_cells(group, selected, index)  # tokens from the shared host pages
    assert model.checked_tokens > 0
    model.check_host(sharer)


# ---- bad input ----
@pytest.mark.parametrize("bad,error,match", [
    ("abc", TypeError, "list of ints, a CPU integer tensor or a numpy integer array"),
    ([1.0, 2.0], TypeError, "list of int token ids"),
    ([True, False], TypeError, "list of int token ids"),
    (np.zeros(8, dtype=np.float32), TypeError, "integer token ids"),
    (torch.zeros(8), TypeError, "integer token ids"),
    (torch.zeros(8, dtype=torch.bool), TypeError, "integer token ids"),
    (np.zeros((2, 4), dtype=np.int64), ValueError, "must be 1-D"),
    ([0, 1, -2, 3], ValueError, "non-negative"),
    (torch.tensor([5, -1]), ValueError, "non-negative"),
    ([2**70], ValueError, "does not fit int64"),
])
def test_bad_token_ids_are_refused_with_nothing_changed(bad, error, match):
    manager = kv.KVCacheManager(dsa_config())
    cache = import_history(manager.create_cache(), 8)
    cache.commit(list(range(8)))
    before = (usage(manager), manager.stats()["prefix"], all_pages(cache))
    with pytest.raises(error, match=match):
        cache.commit(bad)
    with pytest.raises(error, match=match):
        manager.match(bad)
    with pytest.raises(error, match=match):
        manager.create_cache(bad)
    assert (usage(manager), manager.stats()["prefix"], all_pages(cache)) == before


def test_commit_and_create_cache_refuse_what_they_cannot_do():
    manager = kv.KVCacheManager(dsa_config())
    cache = import_history(manager.create_cache(), 10)
    assert cache.resize(capacity=14)
    with pytest.raises(ValueError, match=r"3 whole pages \(12 tokens\) but history holds 10"):
        cache.commit(list(range(14)))
    assert manager.stats()["prefix"]["entries"] == 0
    assert cache.commit(list(range(11))) == 8
    with pytest.raises(ValueError, match="page 1 of this cache was committed or shared under other"):
        cache.commit([0, 1, 2, 3, 9, 9, 9, 9])
    sharer = manager.create_cache(list(range(8)))
    with pytest.raises(ValueError, match="page 0 of this cache was committed or shared under other"):
        sharer.commit([7] * 8)
    assert manager.stats()["prefix"]["entries"] == 2
    with pytest.raises(ValueError, match="more than max_tokens_per_row"):
        manager.create_cache(list(range(65)))
    with pytest.raises(ValueError, match="more than max_tokens_per_row"):
        manager.match(list(range(65)))
    cache.close()
    with pytest.raises(RuntimeError, match="the cache is closed"):
        cache.commit(list(range(8)))
    manager.close()
    with pytest.raises(RuntimeError, match="KVCacheManager is closed"):
        manager.create_cache(list(range(8)))
    with pytest.raises(RuntimeError, match="KVCacheManager is closed"):
        manager.match(list(range(8)))


# ---- random runs: the data-safety model with shared prefixes (sharing_model.py) ----
@pytest.mark.parametrize("seed,slots", [(0, 80), (1, 120), (2, 400)])
def test_random_runs_with_shared_prefixes_lose_no_kv(device, seed, slots):
    """Requests commit, share, diverge, close and get evicted under pressure (80 and 120 slots
    per group against 4 rows of up to 24 pages), interleaved with decode steps; every selected
    token is read back from its cell, every history token from its host page (shared pages
    included), and every slot's reference count is exact after every step."""
    model = SharingModel(device, seed, slots)
    for number in range(STEPS):
        model.step(number)
    for cache in model.caches:
        model.check_host(cache)
    assert model.checked_tokens > 1000
    assert model.shared_tokens > 0 and model.commits > 0
    stats = model.manager.stats()
    assert stats["prefix"]["matched_tokens"] == model.shared_tokens
    if slots < 400:  # pressure: cached pages were evicted
        assert stats["prefix"]["evicted_slots"] > 0
