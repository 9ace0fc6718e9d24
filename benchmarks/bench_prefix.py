"""P-PFX: 16 requests sharing a 25,600-token prefix, then 512 private tokens each.

    python benchmarks/run.py --only P-PFX            # on the GPU machine
    python benchmarks/run.py --quick --only P-PFX    # CPU smoke run (small sizes)

One request prefills the prefix (written to its host pages and dense GPU pages) and commits it;
15 more start from it with ``create_cache(token_ids)``; each then prefills its own 512 tokens. The
same 16 requests are built again without sharing (every request prefills everything). Rows:

* ``bytes``: host and dense GPU bytes in use (``stats()``) with and without sharing, against one
  prefix plus the 16 private parts (target <= 1.1x); every sharing request's page lists are
  checked against the owner's for the prefix, the tables the batch publishes against the page
  lists, and every page's bytes against the token ids they were written for.
* ``create+seat+publish``: host time until a request whose prefix is cached is ready to decode
  (target <= 1 ms): ``create_cache(token_ids)`` (26,112 int64 ids, 400 cached pages),
  ``Batch.add`` and the publish that uploads its row (on CUDA up to the synchronize after it);
  the parts are in ``extra``. No slot is allocated, no byte copied, and the published row is
  checked against the shared page list.
* ``step``: one decode step's cache ops (per selection group resolve, then fetch of its layers;
  K selected units per row, 1% new ones per step) over the 16 sharing rows and over the 16
  private rows, on identical selections: sharing costs nothing per step (equal within noise).
  Every selected unit is read back from its cell against its host bytes.
"""
from __future__ import annotations

import statistics
import time

import torch

import torch_kvcm2 as kv
from harness import MLA_ROW as ROW  # bytes per token of the sparse latent (DeepSeek FP8 MLA)
from harness import PAGE, Result

DENSE = 128  # bytes per token of a dense buffer (indexer keys) in GPU pools


def sizes(quick: bool) -> dict:
    if quick:
        return dict(rows=16, prefix=1024, private=128, layers=2, K=64, S=128, inflight=4, calls=4,
                    repeats=5)
    return dict(rows=16, prefix=25600, private=512, layers=4, K=2048, S=4096, inflight=16,
                calls=8, repeats=20)


def make_manager(device, sz):
    sparse = kv.SparseSpec(1, sz["K"], sz["S"], sz["inflight"], selection_id="g")
    latent = kv.BufferSpec("kv", ROW, sparse=True)
    dense = kv.BufferSpec("idx", DENSE)
    layers = [kv.LayerSpec(f"l{i}", [latent, dense], sparse=sparse) for i in range(sz["layers"])]
    tokens = sz["prefix"] + sz["private"] + PAGE
    per_row = -(-tokens // PAGE) * PAGE * sz["layers"]
    cells = (sz["rows"] + 1) * sz["S"] * ROW * sz["layers"]
    config = kv.CacheConfig(
        tokens_per_page=PAGE, layers=layers, max_rows=sz["rows"] + 1, max_tokens_per_row=tokens,
        gpu_budget_bytes=cells + sz["rows"] * per_row * DENSE + (64 << 20),
        host_budget_bytes=sz["rows"] * per_row * ROW + (64 << 20), device=device)
    manager = kv.KVCacheManager(config)
    return manager, kv.Batch(manager, sz["rows"] + 1)


def token_bytes(ids: torch.Tensor, layer: int, nbytes: int) -> torch.Tensor:
    """What a model writes for tokens ``ids`` in layer ``layer``: uint8[n, nbytes], a function
    of the token id (and layer), not of the request."""
    base = ((ids.long() * 7 + layer * 13) % 251).to(torch.int16)
    return ((base[:, None] + torch.arange(nbytes, dtype=torch.int16)) % 251).to(torch.uint8)


def prefill(cache, ids: torch.Tensor, end: int) -> None:
    """Take the request from its history to ``end`` tokens written straight to host pages (and
    dense pages): allocate, write the new pages' bytes, declare, advance history."""
    manager = cache.manager
    start = cache.history_length
    slack = max(g.sparse.max_inflight_tokens + g.sparse.tokens_per_unit
                for g in manager.config.selection_groups)
    assert cache.resize(capacity=end + slack)
    first, last = start // PAGE, -(-end // PAGE)
    tokens = torch.arange(first * PAGE, last * PAGE)
    for i, layer in enumerate(manager.config.layers):
        for buf in layer.buffers:
            group = manager.buffer(layer.name, buf.role).pool_group
            slots = torch.tensor(cache.pages(group)[first:last], dtype=torch.long)
            pages = manager.slot_pages(layer.name, buf.role, device_side=not buf.sparse)
            data = token_bytes(ids[tokens.clamp(max=len(ids) - 1)], i, buf.bytes_per_token)
            pages[slots.to(pages.device)] = data.view(last - first, 1, PAGE, -1).to(pages.device)
    cache.record_host_write(end)
    assert cache.resize(history=end)
    assert cache.resize(capacity=end)


def build(device, sz, share: bool):
    """16 requests of the prefix + their own private tokens, seated; returns (manager, batch,
    caches, ids per request, admission host seconds)."""
    manager, batch = make_manager(device, sz)
    g = torch.Generator().manual_seed(7)
    prefix = torch.randint(0, 150_000, (sz["prefix"],), generator=g)
    caches, ids = [], []
    start = time.perf_counter()
    for r in range(sz["rows"]):
        own = torch.cat([prefix, torch.randint(0, 150_000, (sz["private"],), generator=g)])
        cache = manager.create_cache(own if share else None)
        if r == 0 or not share:
            prefill(cache, own, sz["prefix"])
            if share:
                cache.commit(own[:sz["prefix"]])
        assert cache.history_length == sz["prefix"]
        prefill(cache, own, sz["prefix"] + sz["private"])
        batch.add(cache)
        caches.append(cache)
        ids.append(own)
    seconds = time.perf_counter() - start
    batch.publish()
    return manager, batch, caches, ids, seconds, prefix


def used_bytes(manager) -> dict:
    stats = manager.stats()
    return {m: sum(g["used_bytes"] + g["cached_bytes"] for g in stats["pool_groups"]
                   if g["medium"] == m) for m in ("host", "gpu")}


def check_requests(manager, batch, caches, ids, sz, share: bool) -> None:
    """Page lists share the owner's prefix pages (sharing) or hold none of them (private); the
    published tables equal the page lists; every page holds its tokens' bytes."""
    prefix_pages = sz["prefix"] // PAGE
    for gi in range(manager.pool_groups):
        table = batch.page_tables[gi].cpu()
        owner = caches[0].pages(gi)[:prefix_pages]
        for cache in caches:
            pages = cache.pages(gi)
            row = batch.row_of(cache)
            assert table[row, :len(pages)].tolist() == pages, "published table != page list"
            if cache is not caches[0]:
                same = pages[:prefix_pages] == owner
                assert same == share, "prefix pages shared wrongly"
    for i, layer in enumerate(manager.config.layers):
        for buf in layer.buffers:
            group = manager.buffer(layer.name, buf.role).pool_group
            pages = manager.slot_pages(layer.name, buf.role, device_side=not buf.sparse)
            for cache, own in zip(caches, ids):
                slots = torch.tensor(cache.pages(group), dtype=torch.long)
                n = cache.history_length
                got = pages[slots.to(pages.device)].cpu().reshape(-1, buf.bytes_per_token)[:n]
                assert torch.equal(got, token_bytes(own[:n], i, buf.bytes_per_token)), \
                    f"request {cache.request_id}, layer {layer.name}/{buf.role}: wrong bytes"


def selections(sz, history: int, device):
    """sels[0] (made resident first) and sels[1..calls], each replacing 1% of the previous
    selection with units not used before."""
    g = torch.Generator().manual_seed(3)
    rows, K = sz["rows"] + 1, sz["K"]
    new = max(1, K // 100)
    order = [torch.randperm(history, generator=g) for _ in range(rows)]
    sels, current = [], torch.stack([o[:K] for o in order])
    for step in range(sz["calls"] + 1):
        sels.append(current.to(torch.int32).to(device))
        current = current.clone()
        for r in range(rows):
            fresh = order[r][K + step * new:K + (step + 1) * new]
            current[r, torch.randperm(K, generator=g)[:new]] = fresh
    return sels


def time_step(timer, manager, batch, sels, sz):
    """Median µs of one step (resolve + fetch of every layer) over the seated rows, replayed
    from the steady state; checks every selected unit's cell bytes afterwards."""
    state = batch.group(0)
    layers = [layer.name for layer in manager.config.layers]
    mask = torch.zeros(sz["rows"] + 1, 1, dtype=torch.bool, device=sels[0].device)
    for row in batch.members():
        mask[row] = True
    sels = [torch.where(mask, s, torch.full_like(s, -1)) for s in sels]  # empty rows: padding
    batch.resolve(0, sels[0])
    batch.fetch(*layers)
    saved = [t.clone() for t in (state.resident, state.recency, state.counters)]
    step = [0]

    def reset():
        for t, c in zip((state.resident, state.recency, state.counters), saved):
            t.copy_(c)
        step[0] = 0

    def body():
        batch.resolve(0, sels[1 + step[0] % sz["calls"]])
        batch.fetch(*layers)
        step[0] += 1

    us = timer.graph(body, sz["calls"], reset)
    reset()
    for _ in range(sz["calls"]):
        body()
    # every selected unit of the last selection, through the index table, holds its host bytes
    last = sels[sz["calls"]].long().cpu()
    index = state.index_table.long().cpu()
    for i, name in enumerate(layers):
        cells = batch.cells(name, "kv").cpu()
        host = manager.slot_pages(name, "kv", device_side=False)
        table = batch.page_table(name, "kv").long().cpu()
        for row in batch.members():
            units, entries = last[row], index[row]
            assert bool((entries >= 0).all()), "a selected unit has no cell"
            got = cells[entries // PAGE, 0, entries % PAGE]
            want = host[table[row, units // PAGE], 0, units % PAGE]
            assert torch.equal(got, want), f"row {row} layer {name}: cells != host pages"
    return us


def create_and_seat(manager, batch, ids, sz, repeats: int) -> dict:
    """Median host µs until a request with a cached prefix is ready to decode: create_cache(ids)
    + Batch.add + the publish that uploads its row (on CUDA through the synchronize after it,
    so the upload is done), and each part alone; checks the share, the published row and that
    nothing was allocated."""
    before = used_bytes(manager)
    cuda = manager.config.device.type == "cuda"
    parts = {"total": [], "create": [], "add": [], "publish": []}
    for _ in range(repeats + 1):
        start = time.perf_counter()
        cache = manager.create_cache(ids)
        created = time.perf_counter()
        row = batch.add(cache)
        added = time.perf_counter()
        batch.publish()
        if cuda:
            torch.cuda.synchronize()
        end = time.perf_counter()
        assert cache.reused_tokens == sz["prefix"] and cache.history_length == sz["prefix"]
        assert used_bytes(manager) == before, "create_cache(token_ids) allocated slots"
        for g in range(manager.pool_groups):
            pages = cache.pages(g)
            got = batch.page_tables[g][row, :len(pages)].cpu().tolist()
            assert got == pages, "the published row is not the shared page list"
        for name, seconds in (("total", end - start), ("create", created - start),
                              ("add", added - created), ("publish", end - added)):
            parts[name].append(seconds * 1e6)
        batch.remove(cache)
        cache.close()
        batch.publish()  # the hole, outside the timed part
    return {name: statistics.median(v[1:]) for name, v in parts.items()}


def bench_prefix(timer, device, quick) -> list:
    """The P-PFX rows."""
    sz = sizes(quick)
    cuda = device != "cpu"
    runs = {}
    for share in (True, False):
        manager, batch, caches, ids, seconds, prefix = build(device, sz, share)
        check_requests(manager, batch, caches, ids, sz, share)
        runs[share] = dict(manager=manager, batch=batch, caches=caches, ids=ids, seconds=seconds,
                           bytes=used_bytes(manager), prefix=prefix)
    rows, P = sz["rows"], PAGE
    per_token = {"host": ROW * sz["layers"], "gpu": DENSE * sz["layers"]}
    ideal = {m: (sz["prefix"] + rows * sz["private"]) * n for m, n in per_token.items()}
    shared, private = runs[True]["bytes"], runs[False]["bytes"]
    ratio = {m: shared[m] / ideal[m] for m in ideal}
    history = sz["prefix"] + sz["private"]
    sels = selections(sz, history, device)
    step_shared = time_step(timer, runs[True]["manager"], runs[True]["batch"], sels, sz)
    step_private = time_step(timer, runs[False]["manager"], runs[False]["batch"], sels, sz)
    m = runs[True]["manager"]
    request = torch.cat([runs[True]["prefix"], torch.randint(0, 150_000, (sz["private"],))])
    seat = create_and_seat(m, runs[True]["batch"], request, sz, sz["repeats"])
    shape = f"{rows} req x ({sz['prefix'] // 1000:g}K shared + {sz['private']})"
    out = [
        Result("P-PFX", f"{shape}: bytes", runs[True]["seconds"] * 1e6 / rows,
               target="<= 1.1x one prefix + private",
               passed=None if not cuda else max(ratio.values()) <= 1.1,
               extra={"host_bytes_shared": shared["host"], "host_bytes_private": private["host"],
                      "gpu_bytes_shared": shared["gpu"], "gpu_bytes_private": private["gpu"],
                      "ideal_host_bytes": ideal["host"], "ideal_gpu_bytes": ideal["gpu"],
                      "ratio_host": ratio["host"], "ratio_gpu": ratio["gpu"],
                      "admit_us_per_request_private": runs[False]["seconds"] * 1e6 / rows,
                      "note": f"host bytes {shared['host'] / 2**20:.1f} MiB shared vs "
                              f"{private['host'] / 2**20:.1f} MiB private "
                              f"({ratio['host']:.3f}x one prefix + private parts); dense "
                              f"{'GPU' if cuda else 'pool'} bytes {shared['gpu'] / 2**20:.1f} vs "
                              f"{private['gpu'] / 2**20:.1f} MiB ({ratio['gpu']:.3f}x); median "
                              f"us: host time per request to admit and prefill it, the "
                              f"benchmark's byte writes included (private: "
                              f"{runs[False]['seconds'] * 1e6 / rows:.0f} us)"}),
        Result("P-PFX", f"create+seat+publish, {sz['prefix'] // P}-page cached prefix",
               seat["total"], target="<= 1 ms host, no copy",
               passed=None if not cuda else seat["total"] <= 1000,
               extra={"create_us": seat["create"], "add_us": seat["add"],
                      "publish_us": seat["publish"], "tokens": len(request),
                      "note": f"ready to decode: create_cache(int64 ids of {len(request)} tokens) "
                              f"{seat['create']:.0f} us + Batch.add {seat['add']:.0f} us + the "
                              f"publish of its row {seat['publish']:.0f} us"
                              f"{' (to the synchronize after it)' if cuda else ''}; no slot "
                              f"allocated"}),
        Result("P-PFX", f"step, {rows} sharing rows x K={sz['K']} x {sz['layers']}L", step_shared,
               target="~= private rows",
               passed=None if not cuda else step_shared <= 1.1 * step_private,
               extra={"private_us": step_private, "ratio": step_shared / step_private,
                      "note": f"resolve + fetch step: {step_shared:.1f} us with 16 sharing rows, "
                              f"{step_private:.1f} us with 16 private rows "
                              f"({step_shared / step_private:.2f}x); cells checked"}),
    ]
    for run in runs.values():
        run["manager"].close()
    return out
