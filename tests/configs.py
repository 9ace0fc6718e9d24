"""Small configs shared by the host-side tests."""
import torch_kvcm2 as kv


def dsa_config(device="cpu", *, layers=3, max_rows=4, tokens_per_page=4, tokens_per_unit=1,
               width=4, slots=12, max_inflight_tokens=2, max_tokens_per_row=64,
               gpu_budget_bytes=1 << 20, host_budget_bytes=1 << 20, window_layer=True,
               latent_bytes=8, latent_chunks=1):
    """A DSA-like model: sparse latent + dense indexer keys in shared-indexer layers, a private
    sparse layer, a windowed dense layer and a zero-size buffer."""
    sparse = kv.SparseSpec(tokens_per_unit, width, slots, max_inflight_tokens, selection_id="idx")
    private = kv.SparseSpec(tokens_per_unit, width, slots, max_inflight_tokens)
    latent = kv.BufferSpec("kv", latent_bytes, sparse=True, chunks=latent_chunks)
    indexer = kv.BufferSpec("indexer_k", 4)
    specs = [kv.LayerSpec(f"shared{i}", [latent, indexer], sparse=sparse) for i in range(layers)]
    specs.append(kv.LayerSpec("private", [latent, kv.BufferSpec("scale", 0, sparse=True)],
                              sparse=private))
    if window_layer:
        specs.append(kv.LayerSpec("swa", [kv.BufferSpec("k", 8), kv.BufferSpec("v", 8)], window=8))
    return kv.CacheConfig(tokens_per_page=tokens_per_page, layers=specs, max_rows=max_rows,
                          max_tokens_per_row=max_tokens_per_row, gpu_budget_bytes=gpu_budget_bytes,
                          host_budget_bytes=host_budget_bytes, device=device)


def import_history(cache, history, capacity=None):
    """Give ``cache`` ``history`` tokens written straight to host pages (the prefill path), then
    set its capacity (default: ``history``). Capacity first grows far enough that the tokens lie
    before every in-flight range; declaring them written lets history advance over them (SAFE-2)."""
    groups = cache.manager.config.selection_groups
    slack = max((g.sparse.max_inflight_tokens + g.sparse.tokens_per_unit for g in groups), default=0)
    assert cache.resize(capacity=max(cache.capacity, history + slack))
    cache.record_host_write(history)
    assert cache.resize(history=history)
    assert cache.resize(capacity=history if capacity is None else capacity)
    return cache
