"""Demotion benchmark P-DEMOTE (RSD-2): a request of ``victim`` tokens of a 61-layer DSA-like
model (656-B sparse latent + 132-B dense indexer key per token per layer) is on GPU-resident
history pages, which it fills exactly, while the other rows decode on cells; it grows by one
page, the pages cannot follow, and the next publish demotes it: its GPU pages are freed and its
cleared lease seeded from them, device to device.

The row's numbers (targets in brackets):

* the host time of the publish that demotes it, against the median of the other publishes
  (<= 1 ms), and how much of it the seed and its fetch calls took;
* bytes over PCIe in that publish and its seeding: the flushed, fetched and promoted bytes
  ``metrics()`` counts across it (0);
* the step right after it (the seeding's copies run first on the stream), timed with CUDA
  events, against the median of the steps before (<= 1.1x); every step is each group's
  ``resolve(fetch=True)`` and the flush, with 2% new units per row and group per step, the
  host resizing every row over its new token after it.

Checks: the row was on GPU pages before and on cells after; every seeded unit in its cells
holds its host page's bytes; the counters' misses. On the CPU (``--quick``) the same runs at
tiny shapes with wall-clock times (no claims).
"""
from __future__ import annotations

import contextlib
import statistics
import time

import torch

import torch_kvcm2 as kv
from torch_kvcm2 import gpu_history
from bench_preempt import INDEXER_KEY, dsa_layers, imported
from harness import MLA_ROW, PAGE, Result, fill_random
from torch_kvcm2.memory import batch_reserve_bytes

def demote_sizes(quick: bool) -> dict:
    if quick:
        return {"rows": 4, "K": 64, "S": 128, "history": 256, "victim": 1024, "groups": [2, 1],
                "steps": 6}
    return {"rows": 64, "K": 2048, "S": 4096, "history": 5120, "victim": 131072,
            "groups": [4] * 15 + [1], "steps": 20}


def demote_config(device, sz: dict) -> kv.CacheConfig:
    """The layers of ``sz["groups"]``; GPU history pages for exactly the victim's pages; pools
    for every row's pages and the victim's."""
    specs = dsa_layers(sz)
    layers, R = len(specs), sz["rows"]
    victim_pages = -(-(sz["victim"] + 1) // PAGE)
    history = victim_pages * PAGE * MLA_ROW * layers

    def make(gpu, host):
        return kv.CacheConfig(tokens_per_page=PAGE, layers=specs, max_rows=R,
                              max_tokens_per_row=sz["victim"] + 4 * PAGE, gpu_budget_bytes=gpu,
                              host_budget_bytes=host, device=device, gpu_history_bytes=history)

    reserve = batch_reserve_bytes(make(0, 0))
    pages = (R - 1) * (-(-sz["history"] // PAGE) + 1) + victim_pages + 2
    return make(reserve["gpu"] + pages * layers * PAGE * INDEXER_KEY + (64 << 20),
                reserve["host"] + pages * layers * PAGE * MLA_ROW + (16 << 20))


def moved_bytes(manager) -> int:
    m = manager.metrics()
    return (m["flushed_bytes"] + m["gpu_history"]["promoted_bytes"]
            + sum(g["fetched_bytes"] for g in m["selection_groups"].values()))


def bench_demote(device, quick) -> list:
    sz = demote_sizes(quick)
    cuda = device == "cuda"
    config = demote_config(device, sz)
    manager = kv.KVCacheManager(config)
    batch = kv.Batch(manager)
    assert batch.gpu_history_slots > 0
    R, K, H = sz["rows"], sz["K"], sz["history"]
    # the requests' histories on their host pages first (a history changes only through the
    # cache), then seated, the victim first: rows are promoted in row order while the pages
    # last, and they are exactly its pages, so the others stay on cells
    victim = imported(manager, sz["victim"])
    others = [imported(manager, H) for _ in range(R - 1)]
    for g in range(manager.pool_groups):
        fill_random(manager.pool(g), seed=g)
    for cache in [victim] + others:
        assert cache.resize(capacity=cache.history_length + 1)
        batch.add(cache)
    batch.publish()  # the victim moves onto GPU pages (its history copied in)
    assert batch.row_counts()["gpu_history"] == 1, "the victim is not on GPU pages"
    gen = torch.Generator().manual_seed(0)
    groups = config.selection_groups

    def selection(step: int) -> list:
        """Per group: K units per row, 2% of them new each step (the rest kept)."""
        out = []
        for g in groups:
            sel = torch.empty((R, K), dtype=torch.int32)
            for row, cache in batch.members().items():
                units = cache.history_length
                base = torch.randperm(units, generator=gen)[:K] if step == 0 else None
                sel[row] = (base if base is not None else
                            torch.randint(0, units, (K,), generator=gen)).to(torch.int32)
            out.append(sel.to(device))
        return out

    selections = selection(0)

    def step() -> None:
        for g in groups:
            batch.resolve(g.index, selections[g.index], fetch=True)
        batch.flush()

    def timed_step() -> float:
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) * 1e3
        begin = time.perf_counter()
        step()
        return (time.perf_counter() - begin) * 1e6

    def publish() -> float:
        begin = time.perf_counter()
        batch.publish()
        return (time.perf_counter() - begin) * 1e6

    def advance(caches) -> None:  # the host's end of a step: history over the new token
        for cache in caches:
            assert cache.resize(history=cache.capacity, capacity=cache.capacity + 1)

    steps, publishes = [], []
    for n in range(sz["steps"]):
        publishes.append(publish())
        new = max(1, int(0.02 * K))  # 2% of each row's selection changes
        for sel in selections:
            sel[:, :new] = torch.randint(0, H, (R, new), dtype=torch.int32, device=device)
        steps.append(timed_step())
        advance(others + [victim])
    publishes.append(publish())
    steps.append(timed_step())  # the others are published and stepped: only the victim changes
    # the demotion: the victim takes a page of reserve, which the GPU history pages (exactly
    # its pages so far) cannot supply; the publish has its row alone, so no other row moves
    # onto the pages it frees there
    victim.set_reserve(PAGE)
    assert victim.resize()
    before = moved_bytes(manager)
    with timed_calls() as parts:
        demote_us = publish()
    moved = moved_bytes(manager) - before
    assert batch.row_counts()["gpu_history"] == 0, "the victim was not demoted"
    assert manager.metrics()["gpu_history"]["demotions"] == 1
    check_seeds(manager, batch, victim)
    after_us = timed_step()
    manager.close()
    base_step = statistics.median(steps)
    base_publish = statistics.median(publishes)
    ratio = after_us / base_step
    return [Result(
        "P-DEMOTE", f"{sz['victim'] // 1024}K tokens x {len(config.layers)} layers, "
                    f"{R - 1} rows decode", demote_us,
        target="host <= 1 ms, 0 B over PCIe, step <= 1.1x",
        passed=None if not cuda else (demote_us <= 1000 and moved == 0 and ratio <= 1.1),
        extra={"demote_publish_us": demote_us, "publish_median_us": base_publish,
               "seed_us": parts["seed"], "seed_fetch_us": parts["fetch"],
               "bytes_moved": moved, "step_median_us": base_step, "step_after_us": after_us,
               "step_ratio": ratio,
               "note": f"the demoting publish {demote_us:.0f} us on the host (others "
                       f"{base_publish:.0f}; the seed {parts['seed']:.0f} of it, its fetch calls "
                       f"{parts['fetch']:.0f}), {moved} B over PCIe, the step after it "
                       f"{after_us:.0f} us = {ratio:.2f}x the median of {len(steps)}"})]


@contextlib.contextmanager
def timed_calls():
    """The host µs of the calls inside the block to ``GpuHistory.seed`` and, within it, to the
    fetch op (where a slow demoting publish spends its time)."""
    parts = {"seed": 0.0, "fetch": 0.0}
    seed, fetch = gpu_history.GpuHistory.seed, gpu_history.ops.fetch

    def timed(name, fn):
        def call(*args, **kwargs):
            begin = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                parts[name] += (time.perf_counter() - begin) * 1e6
        return call

    gpu_history.GpuHistory.seed = timed("seed", seed)
    gpu_history.ops.fetch = timed("fetch", fetch)
    try:
        yield parts
    finally:
        gpu_history.GpuHistory.seed, gpu_history.ops.fetch = seed, fetch


def check_seeds(manager, batch, victim) -> None:
    """Every unit seeded into the victim's lease holds its host page's bytes, in every layer."""
    row = batch.row_of(victim)
    lease = batch.lease_of(row)
    for g, state in zip(manager.config.selection_groups, batch.groups):
        S = g.sparse.slots
        units = state.resident[lease].cpu()
        seeded = units[units >= 0].long()
        assert len(seeded) > 0, "nothing was seeded"
        slots = torch.nonzero(units >= 0).flatten()
        for layer in g.layers:
            cells = batch.cells(layer, "kv")
            host = manager.buffer_view(layer, "kv")
            pages = torch.as_tensor(victim.host_pages(layer, "kv"), device=cells.device)
            entry = (lease * S + slots).to(cells.device)
            t = seeded.to(cells.device)  # one token per unit (U = 1)
            got = cells[entry // PAGE, :, entry % PAGE]
            want = host[pages[t // PAGE], :, t % PAGE]
            assert torch.equal(got, want.to(got.device)), f"{layer}: a seeded unit is wrong"
