"""Moving a request between managers (TIER-2, docs/DESIGN.md): export a cache, import it into a
manager of a compatible but different config (other budgets, rows, sparse settings), decode
there through a Batch, and read every token back bit-exactly; the same across two processes
through a file; a windowed layer; and the refusals (an incompatible field named, tokens in
flight, a full target left unchanged, closed managers, bad files)."""
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

import torch_kvcm2 as kv
from configs import dsa_config
from conftest import DEVICE_PARAMS
from standins import HISTORY, check_tokens, prefilled
from standins import decode as standin_decode
from torch_kvcm2.transfer import CacheRecord


def other_config(device, **kwargs):
    """Compatible with dsa_config() but different where a deployment may differ: rows, budgets,
    max_tokens_per_row and the sparse settings that shape cells (width, slots, in-flight)."""
    return dsa_config(device, max_rows=2, width=6, slots=16, max_inflight_tokens=3,
                      max_tokens_per_row=128, gpu_budget_bytes=3 << 19,
                      host_budget_bytes=3 << 19, **kwargs)


def window_units(group, t):
    """``standins.decode``'s choice: K history units spread over the group's live range (inside
    a windowed group's window), none released."""
    U, K = group.sparse.tokens_per_unit, group.sparse.width
    low = 0 if group.window is None else max(0, -(-(t - group.window) // U))
    return torch.linspace(low, t // U - 1, K).to(torch.int32), torch.zeros(K, dtype=torch.bool)


def decode(batch, cache, steps):
    """``steps`` stand-in decode steps of ``cache`` selecting inside the window
    (``standins.decode``); returns the tokens checked in cells."""
    return standin_decode(batch, cache, steps, window_units)


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_a_request_moves_to_a_different_config_and_decodes_there_bit_exactly(device):
    source = kv.KVCacheManager(dsa_config(device))
    cache = prefilled(source)
    record = cache.export()
    assert record.history == HISTORY and record.token_ids is None
    assert record.first_page["swa"] == (HISTORY - 8) // 4 and record.first_page["shared0"] == 0
    assert all(t.device.type == "cpu" and t.dtype == torch.uint8
               for roles in record.pages.values() for t in roles.values())
    assert tuple(record.pages["shared0"]["kv"].shape) == (8, 1, 4, 8)
    assert "scale" not in record.pages["private"]  # zero-size: no pages
    assert (record.pages["shared0"]["kv"][-1, :, HISTORY % 4:] == 0).all()

    target = kv.KVCacheManager(other_config(device))
    before = target.stats()
    moved = target.import_cache(record)
    assert (moved.capacity, moved.history_length, moved.written) == (HISTORY,) * 3
    assert moved.seated_in == (None, None) and moved.manager is target
    for g, (old, new) in enumerate(zip(before["pool_groups"], target.stats()["pool_groups"])):
        assert new["used_slots"] - old["used_slots"] == len(
            [s for s in moved.pages(g) if s >= 0])  # only the live pages were taken
    assert check_tokens(moved, HISTORY, source=cache) > 0

    batch = target.create_batch()
    batch.add(moved, row=1)
    assert decode(batch, moved, 5) > 0
    assert moved.history_length == HISTORY + 5
    assert check_tokens(moved, HISTORY + 5, source=cache) > 0
    # the source is untouched and still usable
    assert check_tokens(cache, HISTORY) > 0
    assert cache.resize(capacity=HISTORY + 2)


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_a_seated_cache_exports_what_its_decode_steps_flushed(device):
    """The engine's path: a request decodes in a batch (its new tokens reach host pages through
    flush), then moves while seated; the target continues from there."""
    source = kv.KVCacheManager(dsa_config(device))
    cache = prefilled(source)
    batch = source.create_batch()
    batch.add(cache)
    decode(batch, cache, 3)
    record = cache.export()
    assert record.history == HISTORY + 3 and cache.seated_in[0] is batch
    target = kv.KVCacheManager(other_config(device))
    moved = target.import_cache(record)
    assert check_tokens(moved, HISTORY + 3, source=cache) > 0
    other = target.create_batch()
    other.add(moved)
    decode(other, moved, 2)
    assert check_tokens(moved, HISTORY + 5) > 0
    decode(batch, cache, 1)  # the source decodes on, unaffected


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_a_record_crosses_processes_through_a_file(device, tmp_path):
    """The prefill instance (a child process) exports and saves; this process loads, imports and
    decodes."""
    path = tmp_path / "request.kvrec"
    tests = os.path.dirname(__file__)
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {tests!r})
        import torch_kvcm2 as kv
        from configs import dsa_config
        from standins import prefilled
        cache = prefilled(kv.KVCacheManager(dsa_config({device!r})))
        cache.export(token_ids=list(range(100, 100 + cache.history_length + 1))).save({str(path)!r})
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.dirname(tests)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    subprocess.run([sys.executable, "-c", script], check=True, env=env, timeout=300)
    record = CacheRecord.load(path)
    assert record.history == HISTORY
    assert torch.equal(record.token_ids, torch.arange(100, 100 + HISTORY + 1))
    target = kv.KVCacheManager(other_config(device))
    moved = target.import_cache(record)
    assert check_tokens(moved, HISTORY) > 0
    # the record's token ids were committed: a later request with this prompt shares its pages
    assert target.match(record.token_ids) == HISTORY // 4 * 4
    batch = target.create_batch()
    batch.add(moved)
    decode(batch, moved, 3)
    assert check_tokens(moved, HISTORY + 3) > 0


def windowed_sparse_config(device="cpu", **kwargs):
    """A dense full-attention layer beside a windowed sparse layer (its host pages released
    behind the window too)."""
    sparse = kv.SparseSpec(1, 2, 8, 2)
    layers = [kv.LayerSpec("full", [kv.BufferSpec("k", 8)]),
              kv.LayerSpec("local", [kv.BufferSpec("kv", 16, sparse=True, chunks=2)],
                           window=8, sparse=sparse)]
    settings = dict(tokens_per_page=4, layers=layers, max_rows=2, max_tokens_per_row=64,
                    gpu_budget_bytes=1 << 18, host_budget_bytes=1 << 18, device=device)
    settings.update(kwargs)
    return kv.CacheConfig(**settings)


@pytest.mark.parametrize("device", DEVICE_PARAMS)
def test_a_windowed_layer_travels_from_its_first_live_page(device):
    source = kv.KVCacheManager(windowed_sparse_config(device))
    cache = prefilled(source, 27)
    record = cache.export()
    assert record.first_page == {"full": 0, "local": (27 - 8) // 4}
    assert tuple(record.pages["local"]["kv"].shape) == (7 - 4, 2, 4, 8)
    target = kv.KVCacheManager(windowed_sparse_config(device, max_rows=3,
                                                      host_budget_bytes=1 << 19))
    moved = target.import_cache(record)
    local = target.buffer("local", "kv").pool_group
    assert moved.pages(local)[:4] == [kv.BAD] * 4 and min(moved.pages(local)[4:]) >= 0
    assert check_tokens(moved, 27, source=cache) > 0
    batch = target.create_batch()
    batch.add(moved)
    decode(batch, moved, 6)  # history 33: the window releases page 4 on the way
    assert moved.pages(local)[:6] == [kv.BAD] * 6
    assert check_tokens(moved, 33) > 0


# ---- refusals ----
@pytest.mark.parametrize("changes,message", [
    (dict(latent_bytes=16), "import_cache: layer 'shared0' buffer 'kv' bytes_per_token 8 != 16"),
    (dict(latent_chunks=2), "import_cache: layer 'shared0' buffer 'kv' chunks 1 != 2"),
    (dict(tokens_per_page=8, slots=16), "import_cache: tokens_per_page 4 != 8"),
    (dict(tokens_per_unit=2, slots=14, width=4), "import_cache: layer 'shared0' tokens_per_unit 1 != 2"),
    (dict(window_layer=False), r"import_cache: layer count 5 != 4 \(layer 'swa'\)"),
    (dict(layers=2), "import_cache: layer 2 name 'shared2' != 'private'"),
    (dict(max_tokens_per_row=16), "import_cache: history 30 exceeds max_tokens_per_row 16"),
])
def test_an_incompatible_config_is_refused_naming_the_first_mismatch(changes, message):
    record = prefilled(kv.KVCacheManager(dsa_config())).export()
    target = kv.KVCacheManager(dsa_config(**changes))
    before = target.stats()
    with pytest.raises(ValueError, match=message):
        target.import_cache(record)
    assert target.stats() == before


def test_a_swapped_window_and_a_damaged_record_are_refused():
    record = prefilled(kv.KVCacheManager(windowed_sparse_config())).export()
    layers = list(windowed_sparse_config().layers)
    layers[1] = kv.LayerSpec("local", layers[1].buffers, window=12, sparse=layers[1].sparse)
    with pytest.raises(ValueError, match="layer 'local' window 8 != 12"):
        kv.KVCacheManager(windowed_sparse_config(layers=layers)).import_cache(record)
    target = kv.KVCacheManager(windowed_sparse_config())
    record.pages["full"]["k"] = record.pages["full"]["k"][1:]
    with pytest.raises(ValueError, match=r"layer 'full' buffer 'k' pages must be uint8\[8, 1, 4, 8\]"):
        target.import_cache(record)
    with pytest.raises(TypeError, match="needs a CacheRecord"):
        target.import_cache({"history": 3})


def test_tokens_in_flight_are_refused_naming_the_call():
    manager = kv.KVCacheManager(dsa_config())
    cache = prefilled(manager)
    assert cache.resize(capacity=HISTORY + 1)
    with pytest.raises(RuntimeError, match=r"tokens are in flight \(history 30 < capacity 31\).*"
                                           r"resize\(capacity=30\)"):
        cache.export()
    assert cache.resize(capacity=HISTORY)
    assert cache.export().history == HISTORY


def test_an_import_into_a_full_manager_returns_none_and_changes_nothing():
    source = kv.KVCacheManager(dsa_config())
    cache = prefilled(source)
    record = cache.export(token_ids=list(range(HISTORY)))
    target = kv.KVCacheManager(dsa_config(max_rows=1, gpu_budget_bytes=1 << 15,
                                          host_budget_bytes=1 << 15))
    fillers = []
    while True:
        filler = target.create_cache()
        if not filler.resize(capacity=HISTORY):
            break
        fillers.append(filler)
    assert fillers and not target.can_fit(HISTORY)
    before = target.stats()
    assert target.import_cache(record) is None
    assert target.stats() == before
    # both managers stay usable: the source exports again, the target imports once room is made
    assert torch.equal(cache.export().pages["shared0"]["kv"], record.pages["shared0"]["kv"])
    fillers.pop().close()
    moved = target.import_cache(record)
    assert moved is not None and check_tokens(moved, HISTORY, source=cache) > 0
    assert target.match(list(range(HISTORY))) == 28


def test_closed_managers_and_caches_refuse():
    source = kv.KVCacheManager(dsa_config())
    cache = prefilled(source)
    record = cache.export()
    target = kv.KVCacheManager(dsa_config())
    target.close()
    with pytest.raises(RuntimeError, match="KVCacheManager.import_cache: the KVCacheManager is closed"):
        target.import_cache(record)
    other = prefilled(source)
    other.close()
    with pytest.raises(RuntimeError, match="the cache is closed"):
        other.export()
    source.close()
    with pytest.raises(RuntimeError, match="closed"):
        cache.export()


def test_save_and_load_round_trip_and_refuse_other_files(tmp_path):
    record = prefilled(kv.KVCacheManager(dsa_config())).export(token_ids=np.arange(HISTORY))
    record.save(tmp_path / "r")
    loaded = CacheRecord.load(tmp_path / "r")
    assert loaded.fingerprint == record.fingerprint and loaded.first_page == record.first_page
    assert torch.equal(loaded.token_ids, record.token_ids)
    for layer, roles in record.pages.items():
        for role, data in roles.items():
            assert torch.equal(loaded.pages[layer][role], data)
    torch.save({"weights": torch.zeros(3)}, tmp_path / "other")
    with pytest.raises(ValueError, match="is not a torch_kvcm2.CacheRecord file"):
        CacheRecord.load(tmp_path / "other")
    with pytest.raises(ValueError, match="non-negative"):
        prefilled(kv.KVCacheManager(dsa_config())).export(token_ids=[1, -2])
