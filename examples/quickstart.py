"""Quickstart: one sparse layer pair sharing an indexer, a few requests, one resolve + fetch.

Runs on CUDA when the extension has CUDA kernels and a GPU is visible, else on the CPU.
"""
import torch

import torch_kvcm2 as kv

device = "cuda" if kv.has_cuda_kernels() and torch.cuda.is_available() else "cpu"
P, U, K, S, I = 16, 1, 8, 16, 4
latent = kv.BufferSpec("kv", bytes_per_token=64, sparse=True)
indexer = kv.BufferSpec("indexer_k", bytes_per_token=32)
sparse = kv.SparseSpec(tokens_per_unit=U, width=K, slots=S, max_inflight_tokens=I,
                       selection_id="indexer0")
config = kv.CacheConfig(
    tokens_per_page=P,
    layers=[kv.LayerSpec(f"layer{i}", [latent, indexer], sparse=sparse) for i in range(2)],
    max_rows=4, max_tokens_per_row=256, gpu_budget_bytes=1 << 20, host_budget_bytes=1 << 20,
    device=device,
)
manager = kv.KVCacheManager(config)
batch = kv.Batch(manager)

# Two requests with 40 and 70 tokens of history already on their host pages.
caches = [manager.create_cache() for _ in range(2)]
for cache, length in zip(caches, (40, 70)):
    assert cache.resize(capacity=length, history=length)
    batch.add(cache)
host = manager.storage.view("layer0", "kv", device_side=False)  # [pages, chunks, P, bytes]
place = manager.storage.place("layer0", "kv")
scale = manager.storage.groups[place.group].scale
for cache in caches:  # write a recognisable byte per token into each request's host pages
    for ordinal, slot in enumerate(cache.pages(place.group)):
        host[slot * scale + place.pos, 0] = torch.arange(P, dtype=torch.uint8)[:, None] + ordinal * P
batch.publish()

selected = torch.full((config.max_rows, K), -1, dtype=torch.int32, device=device)
selected[0, :5] = torch.tensor([3, 17, 39, 3, 1000])  # a duplicate and an out-of-range ordinal
selected[1, :3] = torch.tensor([0, 64, 69])
index = batch.resolve("layer0", selected)
for layer in ("layer0", "layer1"):
    batch.fetch(layer)
cells = batch.cells("layer0", "kv")
print("device:", device)
print("index table:\n", index[:2].cpu())
first = cells.view(-1, cells.shape[-1])[index[0, 0].item()][0].item()
print("byte 0 of token 3 read back from its cell:", first)
print("counters:", batch.hit_rate("layer0"))
index = batch.resolve("layer0", selected)
print("same selection again:", batch.hit_rate("layer0"))
