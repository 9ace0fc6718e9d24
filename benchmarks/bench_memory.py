"""Memory benchmarks: P-CAP (GPU bytes per request of the sparse layers, independent of the
context length) and P-START / P-START-GROW / P-START-OLD (the manager's start-up at growing
host budgets, and the host pool's growth rate against the thread count)."""
from __future__ import annotations

import statistics
import time

import torch

import torch_kvcm2 as kv
from harness import MLA_ROW, PAGE, Result, release, seat, sparse_config
from torch_kvcm2 import ops
from torch_kvcm2.memory import batch_memory_bytes


def bench_capacity(device, quick) -> Result:
    """P-CAP: GPU bytes per request of the sparse layers, read off the batch's cell tensors
    (numel / max_rows) with one request seated at each of two context lengths and one resolve +
    fetch over its whole history; must equal S x U x bytes_per_token per sparse buffer at both."""
    K, S, rows, layers, B = (64, 128, 2, 2, MLA_ROW) if quick else (2048, 4096, 2, 2, MLA_ROW)
    contexts = (1024, 4096) if quick else (32768, 131072)
    found = []
    for ctx in contexts:
        pages = -(-(ctx + 2 * PAGE) // PAGE)
        config = sparse_config(device, rows=rows, width=K, slots=S, unit=1, page=PAGE, bytes_per_token=B,
                               layers=layers, tokens_per_row=ctx + 2 * PAGE, groups=[1] * layers,
                               host_bytes=pages * layers * PAGE * B + (1 << 20))  # one request
        manager = kv.KVCacheManager(config)
        batch = kv.Batch(manager)
        g = torch.Generator().manual_seed(ctx)
        selected = torch.full((rows, K), -1, dtype=torch.int32)
        selected[0] = torch.randperm(ctx, generator=g)[:K].to(torch.int32)
        selected = selected.to(device)
        if device == "cuda":
            torch.cuda.synchronize()
        before = torch.cuda.memory_allocated() if device == "cuda" else 0
        seat(manager, batch, 1, ctx)
        for gi in range(layers):
            batch.resolve(gi, selected)
            batch.fetch(f"l{gi}")
        grew = torch.cuda.memory_allocated() - before if device == "cuda" else 0
        for gi in range(layers):
            assert batch.hit_rate(gi)["misses"] == K, "resolve over the whole context missed"
        cells = sum(batch.cells(f"l{i}", "kv").numel() for i in range(layers)) // batch.max_rows
        assert cells == layers * S * 1 * B, f"cells per request {cells} != S x U x B x layers"
        tables = batch_memory_bytes(config, manager.pool_groups, 1)["gpu"] - cells
        found.append({"context": ctx, "cells_bytes": cells, "dense_bytes": layers * ctx * B,
                      "table_bytes": tables, "gpu_alloc_for_request": grew})
        del manager, batch
        release(device)
    assert len({f["cells_bytes"] for f in found}) == 1, "cells per request depend on the context"
    per_layer = found[0]["cells_bytes"] // layers
    lo, hi = found
    note = (f"per request per sparse layer: cells {per_layer / 1e6:.2f} MB (S={S} x U=1 x {B} B) at "
            f"{lo['context']} and at {hi['context']} tokens, vs a dense layout "
            f"{lo['dense_bytes'] / layers / 1e6:.1f} / {hi['dense_bytes'] / layers / 1e6:.1f} MB; "
            f"61 layers: {61 * per_layer / 1e9:.3f} GB vs {61 * lo['dense_bytes'] / layers / 1e9:.2f} / "
            f"{61 * hi['dense_bytes'] / layers / 1e9:.2f} GB; device tables + residency per row "
            f"{lo['table_bytes']} / {hi['table_bytes']} B (4 B per {PAGE}-token page); GPU memory "
            f"allocated by seating + a step: {lo['gpu_alloc_for_request']} / {hi['gpu_alloc_for_request']} B")
    k = lambda n: f"{n // 1024}K"
    return Result("P-CAP", f"{per_layer / 1e6:.2f} MB/req/layer @{k(lo['context'])}={k(hi['context'])} "
                  f"(dense {hi['dense_bytes'] / layers / 1e6:.0f} MB)", 0.0,
                  target="indep. of context", passed=None if device == "cpu" else True,
                  extra={"contexts": found, "cells_bytes_per_layer": per_layer, "note": note})


def bench_start(device, quick) -> list:
    """P-START: ``KVCacheManager(config)`` with a 4 GiB, 64 GiB and 1 TiB host budget (a
    reservation: nothing is committed; the row's time is the slowest of the three), then
    P-START-GROW: the first allocation's growth rate (bytes committed [+ registered on CUDA] per
    second) against the thread count (the row: the default count; the note: every count), and
    P-START-OLD: the old path (zero the whole pool + one registration) on the same bytes."""
    from torch_kvcm2.host_region import available_cores, default_threads

    GiB = 1 << 30
    cuda = device == "cuda"
    sp = kv.SparseSpec(tokens_per_unit=PAGE, width=4, slots=12, max_inflight_tokens=PAGE)

    def config(host_bytes, max_tokens=1 << 20):
        layers = [kv.LayerSpec("mla", [kv.BufferSpec("kv", MLA_ROW, sparse=True)], sparse=sp)]
        return kv.CacheConfig(tokens_per_page=PAGE, layers=layers, max_rows=4,
                              max_tokens_per_row=max_tokens, gpu_budget_bytes=1 << 26,
                              host_budget_bytes=host_bytes, device=device)

    if cuda:  # the CUDA context and the caching allocator exist before any manager does
        torch.zeros(1, device=device)
    starts, tries, refused = {}, {}, []
    for label, nbytes in (("4 GiB", 4 * GiB), ("64 GiB", 64 * GiB), ("1 TiB", 1 << 40)):
        times = []
        for _ in range(1 if quick else 3):
            try:
                begin = time.perf_counter()
                manager = kv.KVCacheManager(config(nbytes))
                times.append(time.perf_counter() - begin)
                manager.close()
            except ValueError as exc:  # the host's address space or overcommit refuses it
                refused.append(f"{label} refused by this host: {exc}")
                break
        if times:
            starts[label] = statistics.median(times) * 1e6
            tries[label] = [t * 1e6 for t in times]
    worst = max(starts.values())
    note = "start-up " + ", ".join(f"{k} {v / 1e3:.2f} ms" for k, v in starts.items())
    results = [Result("P-START", "start, host budget " + " / ".join(starts), worst,
                      target="<= 1 s at every size",
                      passed=(worst <= 1e6 and not refused) if cuda else None,
                      extra={"note": "; ".join([note] + refused), "start_us": starts,
                             "tries_us": tries})]

    grow = (512 << 20) if quick else (8 * GiB if cuda else 2 * GiB)
    grow_tokens = grow // (MLA_ROW * PAGE) * PAGE
    cores, default = available_cores(), default_threads()
    counts = sorted({1, default, cores} if quick else
                    {t for t in (1, 2, 4, 8, 16, 32, 64) if t <= cores} | {default, cores})
    rates = {}
    for threads in dict.fromkeys(counts):
        # one request's resize takes all of it: one growth of the pool group, as one
        # allocation (its page bookkeeping, a few numpy writes, is timed with it)
        manager = kv.KVCacheManager(config(grow + (64 << 20), max_tokens=grow_tokens),
                                    host_threads=threads)
        cache = manager.create_cache()
        begin = time.perf_counter()
        assert cache.resize(capacity=grow_tokens), manager.stats()["host_region"]["last_error"]
        us = (time.perf_counter() - begin) * 1e6
        committed = manager.stats()["host_region"]["committed_bytes"]
        manager.close()
        rates[threads] = (us, committed)
        release(device)
    us, committed = rates[default]
    what = "populate + register" if cuda else "populate"
    results.append(Result(
        "P-START-GROW", f"first alloc {grow / GiB:g} GiB, {what}, {default} thr", us, nbytes=committed,
        target=">= 20 GB/s", passed=(committed / us / 1e3 >= 20) if cuda else None,
        extra={"note": ", ".join(f"{t} threads {c / u / 1e3:.1f} GB/s" for t, (u, c) in rates.items()),
               "rates_gbs": {t: c / u / 1e3 for t, (u, c) in rates.items()}}))

    begin = time.perf_counter()
    old = torch.zeros(grow, dtype=torch.uint8)
    view = ops.uva_view(old) if cuda else None  # registers the whole tensor, as the old pool did
    us = (time.perf_counter() - begin) * 1e6
    results.append(Result("P-START-OLD", f"zeros{' + register' if cuda else ''} {grow / GiB:g} GiB, "
                                         "1 thread", us, nbytes=grow, target="reference"))
    del view, old
    return results
