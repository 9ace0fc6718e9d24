"""Sink tokens of sliding-window layers (TIER-3, docs/DESIGN.md "Sink tokens"): a windowed
layer with ``sinks`` keeps its first ceil(sinks / P) pages forever beside sparse and full layers
in one config and one batch; its GPU pages stay bounded by window + sinks whatever the context,
its page and index tables keep the sinks' entries valid and read BAD between the sinks and the
window, every token it holds reads back bit-exactly, and prefix sharing, export/import and
suspend(offload)/resume carry the sink pages. Config refusals name the field."""
import numpy as np
import pytest
import torch

import torch_kvcm2 as kv
from conftest import DEVICE_PARAMS
from inspect_state import drop_windowed_slot
from standins import check_tokens, prefilled
from standins import decode as standin_decode

P, WINDOW = 4, 8
SINKS = {"swa": 5, "swa_sparse": 3}  # two sink pages, one sink page
SINK_PAGES = {"swa": 2, "swa_sparse": 1}


def sinks_config(device="cpu", swa_sinks=5, **kwargs):
    """A full dense layer, a full sparse layer, a windowed dense layer with ``swa_sinks`` sink
    tokens and a windowed sparse layer with 3."""
    sparse = kv.SparseSpec(1, 4, 12, 2)
    layers = [
        kv.LayerSpec("full", [kv.BufferSpec("k", 8)]),
        kv.LayerSpec("sparse", [kv.BufferSpec("kv", 16, sparse=True, chunks=2)], sparse=sparse),
        kv.LayerSpec("swa", [kv.BufferSpec("k", 8), kv.BufferSpec("v", 8)], window=WINDOW,
                     sinks=swa_sinks),
        kv.LayerSpec("swa_sparse", [kv.BufferSpec("kv", 8, sparse=True)], window=WINDOW,
                     sinks=3, sparse=sparse),
    ]
    settings = dict(tokens_per_page=P, layers=layers, max_rows=2, max_tokens_per_row=256,
                    gpu_budget_bytes=1 << 20, host_budget_bytes=1 << 20, device=device)
    settings.update(kwargs)
    return kv.CacheConfig(**settings)


def group_of(manager, layer):
    return manager.buffer(layer, manager.config.layer(layer).buffers[0].role).pool_group


def window_bound(layer):
    """Most pages a windowed group holds for one request: its sink pages, the pages that cover
    the window and the partly filled page past it, and the page a decode step grows into."""
    return SINK_PAGES[layer] + WINDOW // P + 2


def check_pages(manager, cache, batch=None):
    """Each windowed group holds exactly its sink pages and its window's pages (BAD between),
    within window + sinks pages; the batch's device page table equals the cache's pages."""
    h = cache.history_length
    stats = manager.stats()["pool_groups"]
    for layer, sink_pages in SINK_PAGES.items():
        g = group_of(manager, layer)
        pages = np.array(cache.pages(g))
        first = max(0, (h - WINDOW) // P)
        held = np.flatnonzero(pages >= 0)
        expected = sorted(set(range(min(sink_pages, first))) | set(range(first, len(pages))))
        assert held.tolist() == expected, (layer, h, pages)
        assert stats[g]["used_slots"] <= window_bound(layer), (layer, h, stats[g])
        if batch is not None:
            row = batch.row_of(cache)
            device = batch.page_tables[g][row].cpu().numpy()
            assert (device[:len(pages)] == pages).all() and (device[len(pages):] == -1).all()


def sink_and_window_units(group, t):
    """``standins.decode``'s choice: a full group the K newest units; a windowed one (U = 1) the
    first sink unit, a unit on a page released between the sinks and the window (its entry
    must read BAD), and the window's newest units."""
    K = group.sparse.width
    gap = []
    if group.window is None:
        units = list(range(max(0, t - K), t))
    else:
        low = max(0, t - group.window)
        sink_end = -(-group.sinks // P) * P  # the sink pages' end
        gap = [sink_end] if low // P * P > sink_end else []  # a page released between
        units = [0] + gap + list(range(max(low, t - K + 1 + len(gap)), t))
    released = torch.tensor(units[:K]) == (gap[0] if gap else -2)
    released = torch.cat([released, torch.zeros(K - len(released), dtype=torch.bool)])
    return torch.tensor((units + [-1] * K)[:K], dtype=torch.int32), released


def decode(batch, cache, steps):
    """``steps`` stand-in decode steps selecting sink and window units (``standins.decode``),
    the pages checked after each publish; returns the tokens checked in cells."""
    return standin_decode(batch, cache, steps, sink_and_window_units,
                          lambda: check_pages(batch.manager, cache, batch))


# ---- config ----
def test_sinks_are_refused_where_made_naming_the_field():
    buf = [kv.BufferSpec("k", 8)]
    for bad in (-1, 1.5, "4", True):
        with pytest.raises(ValueError, match="TIER-3.*sinks must be a non-negative int"):
            kv.LayerSpec("swa", buf, window=8, sinks=bad)
    with pytest.raises(ValueError, match="layer 'full'.*TIER-3.*sinks \\(4\\) needs a window"):
        kv.LayerSpec("full", buf, sinks=4)
    assert kv.LayerSpec("swa", buf, window=8).sinks == 0


def test_a_selection_group_agrees_on_sinks():
    sparse = kv.SparseSpec(1, 4, 12, 2, selection_id="idx")
    layers = [kv.LayerSpec(f"l{i}", [kv.BufferSpec("kv", 8, sparse=True)], window=8, sinks=s,
                           sparse=sparse) for i, s in enumerate((4, 8))]
    with pytest.raises(ValueError, match="CFG-4.*sinks \\(8\\) differs from layer 'l0' \\(4\\)"):
        kv.CacheConfig(tokens_per_page=4, layers=layers, max_rows=2, max_tokens_per_row=64,
                       gpu_budget_bytes=1 << 20, host_budget_bytes=1 << 20)


def test_pool_groups_are_keyed_by_window_and_sinks():
    """STO-1, TIER-3: a life cycle is (window, sinks): equal windows with other sinks get their
    own pool group; equal (window, sinks) coalesce; stats() reports each group's sinks."""
    layers = [kv.LayerSpec(f"l{i}", [kv.BufferSpec("k", 8)], window=8, sinks=s)
              for i, s in enumerate((4, 4, 0, 9))]
    config = kv.CacheConfig(tokens_per_page=4, layers=layers, max_rows=2, max_tokens_per_row=64,
                            gpu_budget_bytes=1 << 20, host_budget_bytes=1 << 20)
    manager = kv.KVCacheManager(config)
    groups = manager.stats()["pool_groups"]
    assert [(g["window"], g["sinks"], g["buffers"]) for g in groups] == [
        (8, 4, [("l0", "k"), ("l1", "k")]), (8, 0, [("l2", "k")]), (8, 9, [("l3", "k")])]
    assert kv.memory.pool_group_count(config) == 3


# ---- decoding past many windows ----
@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_decoding_past_many_windows_keeps_the_sinks_within_window_plus_sinks(device):
    manager = kv.KVCacheManager(sinks_config(device))
    cache = prefilled(manager, 10)
    check_pages(manager, cache)
    batch = manager.create_batch()
    batch.add(cache)
    assert decode(batch, cache, 70) > 0  # ~10 windows of 8 tokens
    h = cache.history_length
    assert h == 80
    batch.publish()  # the last advance released a page: the device table follows at publish
    check_pages(manager, cache, batch)
    assert check_tokens(cache, h) > 0  # every held token of every buffer, sinks included
    for layer, role in (("swa", "k"), ("swa", "v"), ("swa_sparse", "kv")):
        idx = cache.host_pages(layer, role)
        assert (idx[:SINK_PAGES[layer]] >= 0).all() and (idx[SINK_PAGES[layer]:16] == -1).all()
    cache.close()
    assert all(g["used_slots"] == 0 for g in manager.stats()["pool_groups"])


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_a_long_prefill_jumps_past_the_window_and_takes_the_sink_pages(device):
    """A cache that grows from nothing to far past its window in one resize takes its sink
    pages and its window's pages only; a shrink back to history keeps them."""
    manager = kv.KVCacheManager(sinks_config(device))
    cache = prefilled(manager, 50)
    check_pages(manager, cache)
    assert check_tokens(cache, 50) > 0
    g = group_of(manager, "swa")
    assert manager.stats()["pool_groups"][g]["used_slots"] == 2 + (50 - (50 - WINDOW) // P * P
                                                                  + P - 1) // P


# ---- export / import ----
@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_sink_pages_travel_with_an_exported_record(device, tmp_path):
    source = kv.KVCacheManager(sinks_config(device))
    cache = prefilled(source, 10)
    batch = source.create_batch()
    batch.add(cache)
    decode(batch, cache, 30)
    h = cache.history_length
    record = cache.export()
    assert record.sink_pages == {"full": 0, "sparse": 0, "swa": 2, "swa_sparse": 1}
    assert record.first_page["swa"] == (h - WINDOW) // P
    assert tuple(record.pages["swa"]["k"].shape) == (2 + -(-h // P) - (h - WINDOW) // P, 1, P, 8)
    record.save(tmp_path / "r.kvrec")
    loaded = kv.transfer.CacheRecord.load(tmp_path / "r.kvrec")
    assert loaded.sink_pages == record.sink_pages

    target = kv.KVCacheManager(sinks_config(device, max_rows=3, max_tokens_per_row=128))
    moved = target.import_cache(loaded)
    check_pages(target, moved)
    assert check_tokens(moved, h, source=cache) > 0
    other = target.create_batch()
    other.add(moved)
    decode(other, moved, 12)
    assert check_tokens(moved, h + 12) > 0

    different = kv.KVCacheManager(sinks_config(device, swa_sinks=8))
    before = different.stats()
    with pytest.raises(ValueError, match="layer 'swa' sinks 5 != 8"):
        different.import_cache(record)
    assert different.stats() == before


# ---- suspend(offload) / resume ----
@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_offload_and_resume_carry_the_sink_pages(device):
    manager = kv.KVCacheManager(sinks_config(device), host_tier_bytes=1 << 18)
    cache = prefilled(manager, 10)
    batch = manager.create_batch()
    batch.add(cache)
    decode(batch, cache, 25)
    h = cache.history_length
    g = group_of(manager, "swa")
    held = len([s for s in cache.pages(g) if s >= 0])
    assert cache.offloaded_pages()[g] == 0
    assert cache.suspend(offload=True)
    assert cache.offloaded_pages()[g] == held == 2 + -(-h // P) - (h - WINDOW) // P
    stats = manager.stats()
    assert all(s["used_slots"] == 0 for s in stats["pool_groups"] if s["medium"] == "gpu")
    assert manager.can_fit(0, resuming=[cache])
    assert cache.resume()
    batch.publish()
    check_pages(manager, cache, batch)
    assert check_tokens(cache, h) > 0
    decode(batch, cache, 10)
    assert check_tokens(cache, h + 10) > 0


# ---- prefix sharing ----
@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_a_shared_prefix_brings_the_sink_pages(device):
    """PFX-5, TIER-3: a committed prefix past the window is shared with its window's pages and
    its sink pages (the same slots); without a sink page's slot the match gets shorter."""
    manager = kv.KVCacheManager(sinks_config(device))
    ids = list(range(1000, 1040))
    cache = prefilled(manager, 40)
    assert cache.commit(ids) == 40
    shared = manager.create_cache(ids + [7])
    assert shared.reused_tokens == 40
    for layer in SINK_PAGES:
        g = group_of(manager, layer)
        mine, theirs = np.array(shared.pages(g)), np.array(cache.pages(g))
        assert (mine == theirs).all() and (mine[:SINK_PAGES[layer]] >= 0).all(), layer
    check_pages(manager, shared)
    assert check_tokens(shared, 40, source=cache) > 0
    sink_slot = cache.pages(group_of(manager, "swa"))[0]
    shared.close()
    cache.close()
    # the prefix index loses the first sink page of the windowed dense group (what evicting
    # it does): every match past the window needs it, and one inside the window needs page 0
    drop_windowed_slot(manager, group_of(manager, "swa"), sink_slot)
    assert manager.match(ids) == 0
