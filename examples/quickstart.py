"""Quickstart: two layers sharing one indexer, a few requests, a prefill and a few decode steps.

Every step follows the documented order (publish; resolve once per selection group; per layer
fetch, write the new tokens, read the cells; flush; resize) and checks that every selected token
read back from the cells holds the bytes written for it. Runs on CUDA when the extension has
CUDA kernels and a GPU is visible, else on the CPU.

    python examples/quickstart.py [--prompt-lengths 40,70] [--steps 6] [--device cpu] [--help]
"""
import argparse
import dataclasses
import sys

import torch

import torch_kvcm2 as kv
from torch_kvcm2.memory import batch_reserve_bytes

from flags import (Part, add_device_flag, check_memory, pick_device, positive_int,
                   prompt_lengths)  # examples/flags.py
from running import Estimate  # examples/running.py

P, U, K, S, I, B = 16, 1, 8, 16, 4, 64  # page, unit, width, slots, in-flight tokens, bytes/token
LAYERS = ("layer0", "layer1")


parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
parser.add_argument("--prompt-lengths", type=prompt_lengths, default="40,70",
                    help="comma-separated prompt lengths, one request each")
parser.add_argument("--steps", type=positive_int, default=6,
                    help="steps: the prefill, then decode steps")
add_device_flag(parser)
args = parser.parse_args()
device = pick_device(args.device)
prompts = args.prompt_lengths
ROWS = len(prompts)
max_tokens = -(-(max(prompts) + args.steps) // P) * P  # whole pages for the longest request
pool_bytes = ROWS * max_tokens * B * len(LAYERS)  # every page of every request
latent = kv.BufferSpec("kv", bytes_per_token=B, sparse=True)
sparse = kv.SparseSpec(tokens_per_unit=U, width=K, slots=S, max_inflight_tokens=I,
                       selection_id="indexer0")
config = kv.CacheConfig(tokens_per_page=P, layers=[kv.LayerSpec(n, [latent], sparse=sparse) for n in LAYERS],
                        max_rows=ROWS, max_tokens_per_row=max_tokens,
                        gpu_budget_bytes=0, host_budget_bytes=0, device=device)  # budgets below
# the batch's cells, tables and staging come off the budgets first (nothing allocated yet)
reserve = batch_reserve_bytes(config)
check_memory(parser, sys.argv[1:], [  # before anything is allocated
    Part("the cache's host pages", pool_bytes, ("--prompt-lengths", "--steps"), "host"),
    Part("the batch's staging", reserve["host"], ("--prompt-lengths", "--steps"), "host"),
    Part("the batch's cells and tables", reserve["gpu"], ("--prompt-lengths", "--steps"),
         "device"),
    Part("the prefill's positions and token bytes", max(prompts) * (ROWS * 8 + 18 * B),
         ("--prompt-lengths",), "host"),
], device)
device = device.type
config = dataclasses.replace(config, gpu_budget_bytes=reserve["gpu"] + (1 << 20),
                             host_budget_bytes=reserve["host"] + pool_bytes + (1 << 20))
manager = kv.KVCacheManager(config)
batch = kv.Batch(manager)


def token_bytes(layer: int, positions: torch.Tensor) -> torch.Tensor:
    """The KV bytes the 'model' writes for tokens at ``positions`` of a layer."""
    return ((positions[:, None] * 7 + layer * 101 + torch.arange(B, device=device)) % 251).to(torch.uint8)


def write(target: torch.Tensor, index: torch.Tensor, positions: torch.Tensor, layer: int):
    """Write tokens at ``positions`` to token indices ``index`` of a paged tensor (BAD skipped)."""
    ok = index >= 0
    index, positions = index[ok].long(), positions[ok].long()
    target[index // P, 0, index % P] = token_bytes(layer, positions)


def write_step():
    """Write every row's new tokens: [history, s0) straight to host pages, [s0, capacity) to cells."""
    table, start = batch.write_indices(0)
    for i, layer in enumerate(LAYERS):
        for row, cache in batch.members().items():
            h, s0 = cache.history_length, int(start[row])
            host = torch.arange(h, s0, dtype=torch.int32, device=device)
            positions = torch.full((ROWS, max(len(host), 1)), -1, dtype=torch.int32, device=device)
            positions[row, :len(host)] = host
            index = batch.host_token_indices(layer, "kv", positions)[row]
            write(manager.buffer_view(layer, "kv"), index, positions[row], i)
            inflight = s0 + torch.arange(table.shape[1], device=device)
            write(batch.cells(layer, "kv"), table[row], inflight, i)


caches = [manager.create_cache() for _ in prompts]
for cache, length in zip(caches, prompts):
    assert cache.resize(capacity=length)  # prefill: the whole prompt is new this step
    batch.add(cache)
generator = torch.Generator().manual_seed(0)
estimate = Estimate("quickstart", args.steps, "steps", flags=("--steps", "--prompt-lengths"))
for step in range(args.steps):
    batch.publish()
    selected = torch.full((ROWS, K), -1, dtype=torch.int32)
    for row, cache in batch.members().items():  # the 'indexer': K units of the history
        if cache.history_length:
            selected[row] = torch.randint(0, cache.history_length, (K,), generator=generator)
    selected = selected.to(device)
    index = batch.resolve(0, selected)
    for layer in LAYERS:
        batch.fetch(layer)
    write_step()
    batch.record_host_writes()  # declare the tokens written straight to host pages
    for i, layer in enumerate(LAYERS):  # 'attention' reads the selected tokens from the cells
        cells = batch.cells(layer, "kv")
        for row in range(ROWS):
            ok = index[row] >= 0
            entry = index[row][ok].long()  # U = 1: the token index of a unit's token is its entry
            got = cells[entry // P, 0, entry % P]
            assert torch.equal(got, token_bytes(i, selected[row][ok])), (step, layer, row)
    batch.flush()
    for cache in caches:
        assert cache.resize(history=cache.capacity)
        assert cache.resize(capacity=cache.capacity + 1)  # room for the next token
    stats = batch.hit_rate(0)
    print(f"step {step}: lengths {[c.history_length for c in caches]}, selected tokens read back "
          f"from cells OK, hits {stats['hits']} misses {stats['misses']}")
    estimate.update(step + 1)  # one line on stderr first if the steps will take minutes
host = manager.slot_pages("layer1", "kv", device_side=False)  # [slot, chunk, P, B]
for cache in caches:  # every token of history is on its host pages
    pages = torch.tensor(cache.pages(manager.buffer("layer1", "kv").pool_group))
    t = torch.arange(cache.history_length)
    assert torch.equal(host[pages[t // P], 0, t % P], token_bytes(1, t.to(device)).cpu())
print(f"device {device}: all history verified on host pages; hit rate {batch.hit_rate(0)['hit_rate']:.2f}")
