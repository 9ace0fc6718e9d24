"""torch_kvcm2 benchmarks: one command, one table, ratios against ceilings measured in the same run.

    python benchmarks/run.py [--json out.json]   # on the GPU machine (every P- id of docs/REQUIREMENTS.md §15)
    python benchmarks/run.py --scaling           # also the scaling table (rows, K, S, miss rate)
    python benchmarks/run.py --only P-RES,P-STEP # a subset of the ids
    python benchmarks/run.py --quick             # CPU smoke run of the harness (no numbers claimed)

On CUDA it first measures the copy-engine H2D / D2H bandwidth and the HBM copy bandwidth, then
times each op as CUDA-graph replays (several calls per graph, state restored between replays, so
launch overhead is amortised and every replay does the same work) and checks each op's outputs
before its time counts. Targets: docs/REQUIREMENTS.md §15.

Beyond the single ops: P-INDEX-L runs P-INDEX's kernel on 256 MB (bandwidth-bound, next to
torch's copy and an elementwise kernel on the same bytes); P-TORCH times a straightforward
torch-op resolve + fetch against the library's on P-RES's workload (eagerly: it synchronises);
P-STEP times a whole decode step of cache ops (61 sparse layers in 16 selection groups) as one
graph replay, next to the same step with 61 private groups (P-STEP-HS, the HiSparse shape);
P-CAP reads the GPU bytes per request off the batch's cell tensors at two context lengths.

Memory on the GPU machine (default run): P-STEP's 61 layers x 64 rows x 4096 slots x 656 B are
10.5 GB of GPU cells and 64 rows x 2,560 tokens of history x 61 layers are 6.7 GB of pinned
host pages; P-STEP and P-STEP-HS are built one after the other (peak ~10.6 GB GPU, ~6.7 GB
pinned). Everything else is below 1 GB on either side.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

import torch_kvcm2 as kv
from torch_kvcm2 import ops
from torch_kvcm2.memory import batch_memory_bytes
from torch_kvcm2.storage import Storage

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_mtp import bench_mtp  # noqa: E402  (P-RES-MTP)
from bench_prefix import bench_prefix  # noqa: E402  (P-PFX)
from bench_tp import bench_tp  # noqa: E402  (P-TP)

MLA_ROW = 656  # bytes per token of DeepSeek's FP8 MLA latent row
PAGE = 64  # tokens per page in every benchmark


@dataclass
class Result:
    id: str
    shape: str
    median_us: float
    nbytes: int = 0
    ceiling: str = ""
    ceiling_gbs: float = 0.0
    target: str = ""
    passed: bool | None = None
    extra: dict = field(default_factory=dict)

    @property
    def gbs(self) -> float:
        return self.nbytes / self.median_us / 1e3 if self.nbytes and self.median_us else 0.0

    @property
    def pct(self) -> float:
        return 100 * self.gbs / self.ceiling_gbs if self.ceiling_gbs else 0.0


class Timer:
    """Medians of CUDA-event-timed graph replays (CUDA) or wall-clock loops (CPU)."""

    def __init__(self, device: str, repeats: int):
        self.device, self.repeats = device, repeats

    def graph(self, body, calls: int, reset=lambda: None, keep: bool = False):
        """Median µs per call of ``body`` (run ``calls`` times in one captured graph); ``reset``
        runs, untimed, before every replay so each replay does the same work. With ``keep`` it
        returns ``(us, replay)``: ``replay()`` resets and runs the captured graph once more
        (synchronised), so a check can look at what the graph itself wrote."""
        if self.device == "cpu":
            times = []
            for _ in range(self.repeats):
                reset()
                start = time.perf_counter()
                for _ in range(calls):
                    body()
                times.append((time.perf_counter() - start) * 1e6 / calls)

            def replay_cpu():
                reset()
                for _ in range(calls):
                    body()

            us = statistics.median(times)
            return (us, replay_cpu) if keep else us
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up outside capture
            reset()
            body()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        reset()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                body()
        times = []
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for _ in range(self.repeats):
            reset()
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3 / calls)
        us = statistics.median(times)
        if not keep:
            return us

        def replay():
            reset()
            graph.replay()
            torch.cuda.synchronize()

        return us, replay

    def graph_net(self, body, reset, calls: int = 8):
        """Median µs of one ``body`` whose state ``reset`` restores first, both captured:
        ``calls`` x (reset, body) in one graph, less ``calls`` x reset in another, per call. A
        small body timed alone by one replay between two events also counts the replay's launch
        (~10 µs on the H200); here consecutive bodies are separated by the reset's copies only.
        Returns ``(us, replay)``; ``replay()`` runs one reset + body (synchronised). On the CPU it
        is ``graph(body, 1, reset, keep=True)``."""
        if self.device == "cpu":
            return self.graph(body, 1, reset, keep=True)
        both = self.graph(lambda: (reset(), body()), calls)
        alone = self.graph(reset, calls)

        def replay():
            reset()
            body()
            torch.cuda.synchronize()

        return both - alone, replay

    def eager(self, body, calls: int, reset=lambda: None) -> float:
        """Median µs per call of ``body`` run eagerly (for code that synchronises and so cannot be
        captured): CUDA events around ``calls`` calls, after one warm-up call."""
        if self.device == "cpu":
            return self.graph(body, calls, reset)
        reset()
        body()
        torch.cuda.synchronize()
        times = []
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for _ in range(self.repeats):
            reset()
            torch.cuda.synchronize()
            start.record()
            for _ in range(calls):
                body()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3 / calls)
        return statistics.median(times)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> float:
        """Median µs of one ``dst.copy_(src)`` (the copy engine for host <-> device)."""
        dst.copy_(src, non_blocking=True)
        if self.device == "cpu":
            return self.graph(lambda: dst.copy_(src), 1)
        times = []
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for _ in range(self.repeats):
            start.record()
            dst.copy_(src, non_blocking=True)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        return statistics.median(times)


def median_call_us(fn, reps: int, warmup: int, sync=None, sync_every: int = 16) -> float:
    """Median host time of one call of ``fn`` in µs, over ``reps`` calls after ``warmup``; with
    ``sync`` (a device's synchronise), called every ``sync_every`` calls outside the timed part,
    so the GPU keeps up and no call waits on a full launch queue."""
    for _ in range(warmup):
        fn()
    if sync:
        sync()
    times = []
    for i in range(reps):
        start = time.perf_counter_ns()
        fn()
        times.append(time.perf_counter_ns() - start)
        if sync and i % sync_every == sync_every - 1:
            sync()
    if sync:
        sync()
    return statistics.median(times) / 1e3


def ceilings(timer: Timer, device: str, quick: bool) -> dict:
    n = (16 if quick else 256) << 20
    pin = device == "cuda"
    host = torch.randint(0, 255, (n,), dtype=torch.uint8).pin_memory() if pin else torch.empty(n, dtype=torch.uint8)
    dev = torch.empty(n, dtype=torch.uint8, device=device)
    h2d = n / timer.copy(dev, host) / 1e3
    d2h = n / timer.copy(host, dev) / 1e3
    big = torch.empty(4 * n, dtype=torch.uint8, device=device)
    other = torch.empty_like(big)
    hbm = 2 * big.numel() / timer.copy(other, big) / 1e3  # bytes read + written
    return {"h2d": h2d, "d2h": d2h, "hbm": hbm}


def release(device: str) -> None:
    """Free what the last benchmark held: batches and caches refer to each other (a cycle), so
    their cells and pinned host pages go only with a collection."""
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def sparse_config(device, *, rows, width, slots, unit, page, bytes_per_token, layers=1,
                  inflight=16, tokens_per_row, host_bytes=None, groups=None):
    """Layers ``l0..`` with one sparse buffer ``kv`` each, all in one host pool group.
    ``groups`` lists the selection-group sizes in layer order (default: one group of all
    layers; a group of one layer is private). The GPU budget is the batch's exact reserve (there
    are no dense pools) plus 64 MiB; ``host_bytes`` defaults to pages for ``tokens_per_row``
    tokens of every row."""
    groups = [layers] if groups is None else list(groups)
    assert sum(groups) == layers, (groups, layers)
    buf = kv.BufferSpec("kv", bytes_per_token, sparse=True)
    specs = []
    for gi, size in enumerate(groups):
        sparse = kv.SparseSpec(unit, width, slots, inflight, selection_id=f"g{gi}" if size > 1 else None)
        for _ in range(size):
            specs.append(kv.LayerSpec(f"l{len(specs)}", [buf], sparse=sparse))

    def make(gpu, host):
        return kv.CacheConfig(tokens_per_page=page, layers=specs, max_rows=rows,
                              max_tokens_per_row=tokens_per_row, gpu_budget_bytes=gpu,
                              host_budget_bytes=host, device=device)

    probe = make(0, 0)
    reserve = {m: rows * n for m, n in batch_memory_bytes(probe, len(Storage(probe).groups), 1).items()}
    if host_bytes is None:
        pages = -(-tokens_per_row // page)
        host_bytes = rows * pages * layers * page * bytes_per_token + (1 << 20)
    return make(reserve["gpu"] + (64 << 20), reserve["host"] + host_bytes)


def seat(manager, batch, rows, history, capacity=None):
    """Seat ``rows`` requests with ``history`` tokens imported to host pages (DESIGN.md)."""
    caches = []
    slack = max(g.sparse.max_inflight_tokens + g.sparse.tokens_per_unit for g in manager.config.selection_groups)
    for _ in range(rows):
        cache = manager.create_cache()
        assert cache.resize(capacity=history + slack)
        cache.record_host_write(history)  # the host pages are filled by the benchmark
        assert cache.resize(history=history)
        assert cache.resize(capacity=history if capacity is None else capacity)
        batch.add(cache)
        caches.append(cache)
    batch.publish()
    return caches


def fill_random(pool, seed: int) -> None:
    """Random bytes in the committed slots of a host pool group, written in place by a kernel
    through the view ops see (the UVA view on CUDA: it reaches every registered range, where
    one copy-engine transfer may not span two registrations). Only the committed prefix is
    real memory; the rest of the reservation is left alone."""
    flat = pool.device_data[:pool.committed_slots].view(-1)
    gen = torch.Generator(device=flat.device).manual_seed(seed)
    chunk = 1 << 28
    for i in range(0, flat.numel(), chunk):
        flat[i:i + chunk].random_(0, 256, generator=gen)


def resolve_only(batch, group, selected):
    """The resolve op alone on a batch's state, for the rows that time resolve itself (P-RES,
    P-RES-MTP): ``Batch.resolve`` also computes the group's write indices in the same call
    (OP-STEP). Returns the index table, the one ``Batch.resolve`` returns."""
    st = batch.group(group)
    sp = st.spec.sparse
    table = st.index_table if selected.dim() == 2 else st.index_views[selected.shape[1] - 1]
    kv.ops.resolve(st.resident, st.recency, table, st.miss_list, st.miss_count, st.counters,
                   st.inflight_slots, selected, batch.history, batch.capacity, batch.lease,
                   sp.tokens_per_unit, batch.config.tokens_per_page, sp.max_inflight_tokens,
                   st.spec.window or 0, st.resolve_scratch)
    return table


def snapshot(states) -> list:
    """Residency state and counters of selection groups, to restore between replays."""
    return [[t.clone() for t in (s.resident, s.recency, s.counters)] for s in states]


def restore(states, saved) -> None:
    for s, copies in zip(states, saved):
        for t, c in zip((s.resident, s.recency, s.counters), copies):
            t.copy_(c)


def rows_isin(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per row: is ``a[r, j]`` among ``b[r, :]`` (non-negative int tensors, same rows)."""
    off = torch.arange(a.shape[0], device=a.device, dtype=torch.int64)[:, None] << 32
    return torch.isin(a.long() + off, b.long() + off)


def host_units(host: torch.Tensor, page_table: torch.Tensor, units: torch.Tensor) -> torch.Tensor:
    """Bytes ``[R, K, B]`` of units (U = 1, one chunk) ``units[r, k]`` of row r on its host pages;
    ``host`` is ``slot_pages(...)`` (the device-side view on CUDA: a gather over PCIe)."""
    units = units.long()
    slots = page_table.long().gather(1, units // PAGE)
    return host[:, 0][slots, units % PAGE]


def cell_units(cells: torch.Tensor, entries: torch.Tensor) -> torch.Tensor:
    """Bytes ``[R, K, B]`` of the cells at ``entries`` (U = 1, one chunk)."""
    entries = entries.long()
    return cells[:, 0][entries // PAGE, entries % PAGE]


def check_selection(cells, host, page_table, selected, index_table, fresh) -> None:
    """Every selected unit reads back from its cell through the index table: the host bytes
    where the unit was fetched in the checked run (``fresh``), zeros where it was a hit (the
    cells were zeroed before that run, so a hit that was fetched again, or a miss that was not,
    shows)."""
    assert bool((index_table >= 0).all()), "a selected unit has no entry"
    want = torch.where(fresh[..., None], host_units(host, page_table, selected), 0)
    got = cell_units(cells, index_table)
    assert torch.equal(got, want.to(torch.uint8)), "cells hold wrong bytes for the selection"


def resolve_workload(device, quick, seed=0):
    """P-RES's workload: 64 rows, K=2048, S=4096, U=1, history 8K; selections ``sels[0..calls]``
    where each replaces 1% of the previous one with never-used units."""
    rows, K, S = (4, 256, 512) if quick else (64, 2048, 4096)
    history = 8 * K
    config = sparse_config(device, rows=rows, width=K, slots=S, unit=1, page=PAGE,
                           bytes_per_token=MLA_ROW, tokens_per_row=history + 64,
                           host_bytes=rows * (history + 128) * MLA_ROW + (16 << 20))
    manager = kv.KVCacheManager(config)
    batch = kv.Batch(manager)
    seat(manager, batch, rows, history)
    g = torch.Generator().manual_seed(seed)
    calls = 4 if quick else 16
    new = max(1, K // 100)
    order = [torch.randperm(history, generator=g) for _ in range(rows)]  # fresh units come in order
    sels, current = [], torch.stack([o[:K] for o in order])
    for step in range(calls + 1):  # step i replaces 1% of the selection with never-used units
        sels.append(current.to(torch.int32).to(device))
        current = current.clone()
        for r in range(rows):
            fresh = order[r][K + step * new:K + (step + 1) * new]
            current[r, torch.randperm(K, generator=g)[:new]] = fresh
    return SimpleNamespace(manager=manager, batch=batch, state=batch.group(0), sels=sels, rows=rows,
                           K=K, S=S, history=history, calls=calls, new=new)


def bench_resolve(timer, device, quick) -> Result:
    """P-RES: 64 rows, K=2048, S=4096, U=1, 1% misses per step."""
    w = resolve_workload(device, quick)
    batch, state, rows, K, S, calls, new = w.batch, w.state, w.rows, w.K, w.S, w.calls, w.new
    batch.resolve(0, w.sels[0])  # steady state: the first selection resident
    saved = snapshot([state])
    step = [0]

    def reset():  # every replay: the steady state, then sels[1..calls] in order
        restore([state], saved)
        step[0] = 0

    def body():
        resolve_only(batch, 0, w.sels[1 + step[0] % calls])
        step[0] += 1

    us = timer.graph(body, calls, reset)
    # check: one replay's outputs — every selection resolved, 1% misses per step
    reset()
    for _ in range(calls):
        body()
    table = state.index_table
    hits, misses, invalid = (state.counters - saved[0][2]).tolist()
    ok = (misses == calls * rows * new and invalid == 0 and hits == calls * rows * (K - new)
          and bool((table >= 0).all()))
    assert ok, f"resolve produced hits={hits} misses={misses} invalid={invalid}"
    return Result("P-RES", f"{rows} rows x K={K} x S={S}, 1% misses", us, target="<= 8 us",
                  passed=None if device == "cpu" else us <= 8.0)


def fetch_setup(device, quick, *, units, unit_tokens, page, row_bytes=MLA_ROW):
    rows = 64 if not quick else 4
    per_row = units // rows
    K = max(per_row, 8)
    S = ((K + 16 + 2 + page // unit_tokens - 1) // (page // unit_tokens)) * (page // unit_tokens)
    history = max(16 * K * unit_tokens, 4 * page)
    config = sparse_config(device, rows=rows, width=K, slots=S, unit=unit_tokens, page=page,
                           bytes_per_token=row_bytes, tokens_per_row=history + 2 * page,
                           host_bytes=rows * (history + 4 * page) * row_bytes + (16 << 20))
    manager = kv.KVCacheManager(config)
    batch = kv.Batch(manager)
    seat(manager, batch, rows, history)
    fill_random(manager.storage.groups[0], 0)
    g = torch.Generator().manual_seed(1)
    selected = torch.stack([torch.randperm(history // unit_tokens, generator=g)[:K] for _ in range(rows)])
    selected[:, per_row:] = -1
    batch.resolve(0, selected.to(torch.int32).to(device))  # a cold resolve: per_row misses a row
    state = batch.group(0)
    assert int(state.miss_count[0]) == rows * per_row
    return manager, batch, state, selected


def bench_fetch(timer, device, quick, *, units, unit_tokens, page, rid, target_pct, ceil,
                row_bytes=MLA_ROW) -> Result:
    """P-FETCH-ROW / P-FETCH-PAGE: a fetch of ``units`` missed units of ``unit_tokens`` tokens of
    ``row_bytes`` each (fetch_sweep.py varies the row size)."""
    manager, batch, state, selected = fetch_setup(device, quick, units=units, unit_tokens=unit_tokens,
                                                  page=page, row_bytes=row_bytes)
    calls = 2 if quick else 10
    us = timer.graph(lambda: batch.fetch("l0"), calls)
    # check every fetched unit's bytes against its host page
    cells = batch.cells("l0", "kv").cpu()
    host = manager.storage.slot_pages("l0", "kv", device_side=False)
    misses = state.miss_list[: int(state.miss_count[0])].cpu().long()
    S, U = state.spec.sparse.slots, unit_tokens
    E = page // U
    entry = misses[:, 0] * S + misses[:, 1]
    tables = batch.page_tables[0].cpu().long()
    slot = tables[misses[:, 2], misses[:, 3] // E]
    src = host.view(host.shape[0], page // U, U, -1)[slot, (misses[:, 3] % E)]
    dst = cells.view(cells.shape[0], page // U, U, -1)[entry // E, entry % E]
    assert torch.equal(src, dst), "fetch copied wrong bytes"
    nbytes = len(misses) * U * row_bytes
    # the copy engine moving the same bytes, contiguous, timed the same way: what a launch of
    # this size reaches on the link (the ceiling is a 256 MB copy)
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device == "cuda")
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    same = timer.graph(lambda: dst.copy_(src, non_blocking=True), calls)
    same_pct = 100 * nbytes / same / 1e3 / ceil["h2d"]
    return Result(rid, f"{len(misses)} units x {U * row_bytes} B", us, nbytes, "CE H2D", ceil["h2d"],
                  f">= {target_pct}% of CE H2D",
                  extra={"ce_same_bytes_us": same, "ce_same_bytes_pct": same_pct,
                         "note": f"{nbytes / 1e6:.2f} MB per fetch; the copy engine moves the same "
                                 f"bytes (one contiguous copy) in {same:.1f} us = {same_pct:.1f}% "
                                 f"of the ceiling; the fetch reaches "
                                 f"{100 * same / us:.1f}% of that"})


def bench_flush(timer, device, quick, ceil) -> Result:
    """P-FLUSH: one new token per row per layer, 64 rows x 61 layers, one launch per pool group."""
    rows, layers = (4, 4) if quick else (64, 61)
    K, S, history = 8, 64, 256
    config = sparse_config(device, rows=rows, width=K, slots=S, unit=1, page=64, layers=layers,
                           bytes_per_token=MLA_ROW, tokens_per_row=history + 64, inflight=1,
                           host_bytes=layers * rows * (history + 128) * MLA_ROW + (16 << 20))
    manager = kv.KVCacheManager(config)
    batch = kv.Batch(manager)
    seat(manager, batch, rows, history, capacity=history + 1)
    batch.resolve(0, torch.full((rows, K), -1, dtype=torch.int32, device=device))  # admits token h
    table, start = batch.write_indices(0)
    for i in range(layers):
        cells = batch.cells(f"l{i}", "kv")
        idx = table[:, 0].long()
        cells[idx // 64, 0, idx % 64] = (i + torch.arange(rows, device=device)[:, None] * 3 +
                                         torch.zeros(MLA_ROW, device=device, dtype=torch.long)).to(torch.uint8)
    assert len(batch._flush_args) == 1, "one launch per sparse pool group"
    calls = 2 if quick else 10
    us = timer.graph(lambda: batch.flush(), calls)
    host = manager.storage.slot_pages("l0", "kv", device_side=False)
    for row, cache in batch.members().items():
        slot = cache.pages(0)[history // 64]
        for i in (0, layers - 1):
            host_i = manager.storage.slot_pages(f"l{i}", "kv", device_side=False)
            assert bool((host_i[slot, 0, history % 64] == (i + row * 3) % 256).all()), "flush wrote wrong bytes"
    del host
    nbytes = rows * layers * MLA_ROW
    return Result("P-FLUSH", f"{rows} rows x {layers} layers x 1 token x {MLA_ROW} B", us, nbytes,
                  "CE D2H", ceil["d2h"], ">= 75% of CE D2H")


def bench_index(timer, device, quick, ceil, rows: int, pages: int, rid: str = "P-INDEX") -> Result:
    """P-INDEX: page-form conversion of rows x pages (the target's shape: 64 x 2048). P-INDEX-L runs the
    same kernel on a shape large enough for HBM bandwidth, not the launch, to bound it (1024 x
    32768 pages: 256 MB moved, 5x the 50 MB L2, which flattered a 34 MB shape to 100%)."""
    g = torch.Generator().manual_seed(2)
    table = torch.randint(0, 1 << 20, (rows, pages), generator=g, dtype=torch.int32).to(device)
    capacity = torch.full((rows,), pages * 64, dtype=torch.int32, device=device)
    out = torch.empty((rows, pages), dtype=torch.int32, device=device)
    calls = 4 if quick else 20
    us = timer.graph(lambda: ops.convert_page_indices(out, table, capacity, 2, 1, 1, 64), calls)
    assert torch.equal(out, table * 2 + 1), "index conversion is wrong"
    nbytes = 2 * out.numel() * 4
    # What the same bytes cost torch, timed the same way: its copy (a memcpy node in the graph)
    # and an elementwise kernel reading the table and writing the result. At 1 MB the HBM ratio
    # is bound by the fixed cost of one graph node, and these show that floor.
    copy = torch.empty_like(out)
    copy_us = timer.graph(lambda: copy.copy_(table), calls)
    assert torch.equal(copy, table), "reference copy is wrong"
    add_us = timer.graph(lambda: torch.add(table, 1, out=copy), calls)
    assert torch.equal(copy, table + 1), "reference kernel is wrong"
    target = ">= 60% of HBM" if rid == "P-INDEX" else "reference"
    return Result(rid, f"{rows} x {pages} pages", us, nbytes, "HBM copy", ceil["hbm"], target,
                  extra={"copy_same_bytes_us": copy_us, "add_same_bytes_us": add_us,
                         "note": f"torch on the same {nbytes / 1e6:.2f} MB, graph-replayed the same way: "
                                 f"copy_ {copy_us:.2f} us, elementwise add {add_us:.2f} us "
                                 f"(this op: {us / copy_us:.2f}x / {us / add_us:.2f}x of them)"})


class TorchResolveFetch:
    """The baseline a user writes first (the torch-only baseline of P-TORCH): resolve + fetch of one selection group
    in plain torch ops, vectorised over rows. Hits: ``torch.isin`` of the selection against the
    resident units (rows kept apart by a per-row key offset) and ``sort`` + ``searchsorted`` for
    the slot of each hit; victims: ``argsort`` of a last-use stamp with the selected slots
    masked off (LRU); fetch: the missed units by boolean mask (``nonzero``: a host
    synchronisation, so it runs eagerly) gathered by advanced indexing from the host pages'
    view into the cells. Covers P-RES's workload (U = 1, no padding, no duplicates, no tokens in
    flight); rows hold leases 0..R-1."""

    def __init__(self, resident, recency, cells, host, page_table):
        R, S = resident.shape
        dev = resident.device
        self.S = S
        self.resident = resident.long()  # a copy: the library's state is left alone
        self.stamp = torch.empty_like(self.resident).scatter_(
            1, recency.long(), torch.arange(S, device=dev).expand(R, S).contiguous())
        self.now = S
        self.off = torch.arange(R, device=dev, dtype=torch.int64)[:, None] << 32
        self.lease = torch.arange(R, device=dev, dtype=torch.int64)[:, None]
        self.cells, self.host, self.page_table = cells, host[:, 0], page_table.long()
        self.hits = torch.zeros((), dtype=torch.int64, device=dev)
        self.misses = torch.zeros((), dtype=torch.int64, device=dev)
        self.table = None

    def state(self) -> tuple:
        return (self.resident.clone(), self.stamp.clone(), self.now)

    def restore(self, state) -> None:
        self.resident.copy_(state[0])
        self.stamp.copy_(state[1])
        self.now = state[2]
        self.hits.zero_()
        self.misses.zero_()

    def step(self, selected: torch.Tensor) -> torch.Tensor:
        S, sel = self.S, selected.long()
        key_res = torch.where(self.resident >= 0, self.resident + self.off, -1)
        key_sel = sel + self.off
        hit = torch.isin(key_sel, key_res)  # [R, K]
        held = torch.isin(key_res, key_sel)  # [R, S]: slots holding a selected unit
        sorted_res, order = key_res.sort(dim=1)
        pos = torch.searchsorted(sorted_res, key_sel).clamp_(max=S - 1)
        hit_slot = order.gather(1, pos)
        lru = self.stamp.masked_fill(held, torch.iinfo(torch.int64).max).argsort(dim=1, stable=True)
        miss = ~hit
        rank = (miss.cumsum(1) - 1).clamp_(min=0)  # the n-th miss of a row takes its n-th victim
        slot = torch.where(hit, hit_slot, lru.gather(1, rank))
        self.resident.scatter_(1, slot, sel)
        self.stamp.scatter_(1, slot, torch.where(hit, self.now + 1, self.now))  # misses, then hits
        self.now += 2
        r, j = miss.nonzero(as_tuple=True)  # host synchronisation
        unit, entry = sel[r, j], r * S + slot[r, j]
        page = self.page_table[r, unit // PAGE]
        self.cells[:, 0][entry // PAGE, entry % PAGE] = self.host[page, unit % PAGE]
        self.hits += hit.sum()
        self.misses += miss.sum()
        self.table = self.lease * S + slot
        return self.table


def bench_torch(timer, device, quick) -> Result:
    """P-TORCH: resolve + fetch on P-RES's workload, the library (graph-replayed) against
    TorchResolveFetch (eager: it synchronises); same hits/misses, correct cell bytes for both."""
    w = resolve_workload(device, quick, seed=3)
    batch, state, manager, rows, K, S, calls, new = (w.batch, w.state, w.manager, w.rows, w.K,
                                                     w.S, w.calls, w.new)
    fill_random(manager.storage.groups[0], 4)
    assert batch.lease.tolist() == list(range(rows))
    batch.resolve(0, w.sels[0])
    batch.fetch("l0")  # steady state: the first selection resident and in its cells
    saved = snapshot([state])
    cells = batch.cells("l0", "kv")
    host = manager.storage.slot_pages("l0", "kv")  # what ops see (the UVA view on CUDA)
    page_table = batch.page_tables[manager.storage.place("l0", "kv").group]
    ref = TorchResolveFetch(state.resident, state.recency, cells.clone(), host, page_table)
    ref_saved = ref.state()
    step = [0]

    def lib_reset():
        restore([state], saved)
        step[0] = 0

    def lib_body():
        batch.resolve(0, w.sels[1 + step[0] % calls])
        batch.fetch("l0")
        step[0] += 1

    def torch_reset():
        ref.restore(ref_saved)
        step[0] = 0

    def torch_body():
        ref.step(w.sels[1 + step[0] % calls])
        step[0] += 1

    lib_us = timer.graph(lib_body, calls, lib_reset)
    torch_us = timer.eager(torch_body, calls, torch_reset)
    # check both from the steady state with zeroed cells: same counts; every unit of the last
    # selection reads back its host bytes if it was fetched in these steps, zeros if it was a hit
    cells.zero_()
    ref.cells.zero_()
    lib_reset()
    for _ in range(calls):
        lib_body()
    torch_reset()
    for _ in range(calls):
        torch_body()
    want = (calls * rows * (K - new), calls * rows * new)
    hits, misses, invalid = (state.counters - saved[0][2]).tolist()
    assert (hits, misses, invalid) == (*want, 0), f"library: hits={hits} misses={misses} invalid={invalid}"
    assert (int(ref.hits), int(ref.misses)) == want, f"torch: hits={int(ref.hits)} misses={int(ref.misses)}"
    last = w.sels[calls]
    fresh = ~rows_isin(last, w.sels[0])
    check_selection(cells, host, page_table, last, state.index_table, fresh)
    check_selection(ref.cells, host, page_table, last, ref.table, fresh)
    ratio = torch_us / lib_us
    how = ("eager, timed with CUDA events: its boolean-mask fetch synchronises, so it cannot be "
           "captured" if device == "cuda" else "eager, wall clock")
    return Result("P-TORCH", f"res+fetch {rows}x{K}x{S}: torch(eager) {ratio:.1f}x", lib_us,
                  target=">= 20x vs torch", passed=None if device == "cpu" else ratio >= 20,
                  extra={"torch_us": torch_us, "library_us": lib_us, "ratio": ratio,
                         "note": f"P-RES's workload (1% misses); library resolve + fetch {lib_us:.1f} "
                                 f"us per step (graph-replayed, {calls} steps per graph) vs torch ops "
                                 f"{torch_us:.1f} us per step ({how}): {ratio:.1f}x; same hits/misses, "
                                 f"cells of both checked against the host pages"})


def step_sizes(quick: bool) -> dict:
    """P-STEP's shape. Default: 64 rows, K=2048, S=4096, U=1, 656-B rows, 2% misses, 61 sparse
    layers; history 2,560 tokens per row (enough for K + the misses; the host pool holds 41
    pages per row of all 61 layers: 6.7 GB pinned); cells 61 x 64 x 4096 x 656 B = 10.5 GB."""
    if quick:
        return {"rows": 4, "K": 64, "S": 128, "history": 128, "groups": [4, 4, 1]}
    return {"rows": 64, "K": 2048, "S": 4096, "history": 2560, "groups": [4] * 15 + [1]}


def run_step(timer, device, quick, groups, seed) -> dict:
    """A full decode step of cache ops with the given selection-group sizes: per group one
    resolve and one fetch of all its layers (``Batch.fetch(*layers)``, one launch), then one
    write_indices per group and one flush, captured as one graph and replayed from the steady
    state (the previous selection resident and fetched, one token in flight per row). Also times
    the same step with one fetch launch per layer, and without any fetch (what the step spends
    outside fetch). Checks every group's counters and index table, and on sampled layers (cells
    zeroed before a last replay) every selected unit's bytes and the flushed token."""
    sz = step_sizes(quick)
    R, K, S, H = sz["rows"], sz["K"], sz["S"], sz["history"]
    L, G, B = sum(groups), len(groups), MLA_ROW
    config = sparse_config(device, rows=R, width=K, slots=S, unit=1, page=PAGE, bytes_per_token=B,
                           layers=L, inflight=16, tokens_per_row=H + 64, groups=groups)
    manager = kv.KVCacheManager(config)
    batch = kv.Batch(manager)
    seat(manager, batch, R, H, capacity=H + 1)  # token H is in flight
    pool = manager.storage.groups[0]
    assert len(manager.storage.groups) == 1 and len(batch._flush_args) == 1
    fill_random(pool, seed)
    new = max(1, round(K * 0.02))
    gen = torch.Generator(device=device).manual_seed(seed)
    order = torch.rand((G, R, H), generator=gen, device=device).argsort(-1)
    sel0 = order[..., :K]
    pos = torch.rand((G, R, K), generator=gen, device=device).argsort(-1)[..., :new]
    sel1 = sel0.scatter(2, pos, order[..., K:K + new])  # 2% never-used units per row
    fresh = torch.zeros((G, R, K), dtype=torch.bool, device=device).scatter_(2, pos, True)
    sels0 = [sel0[g].to(torch.int32).contiguous() for g in range(G)]
    sels1 = [sel1[g].to(torch.int32).contiguous() for g in range(G)]
    del order, sel0, sel1, pos
    group_layers = [spec.layers for spec in config.selection_groups]
    assert [len(ls) for ls in group_layers] == list(groups)
    for gi, layers in enumerate(group_layers):  # steady state
        batch.resolve(gi, sels0[gi])
        for layer in layers:
            batch.fetch(layer)
        batch.write_indices(gi)
    states = batch.groups
    saved = snapshot(states)

    def reset():
        restore(states, saved)

    def step(fetch: str):  # "group": one launch per group, "layer": one per layer, "none"
        def body():
            for gi, layers in enumerate(group_layers):
                batch.resolve(gi, sels1[gi])
                if fetch == "layer":
                    for layer in layers:
                        batch.fetch(layer)
                elif fetch == "group":
                    batch.fetch(*layers)
            for gi in range(G):
                batch.write_indices(gi)
            batch.flush()
        return body

    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    per_layer_us = timer.graph(step("layer"), 1, reset) if G < L else None
    no_fetch_us = timer.graph(step("none"), 1, reset)
    us, replay = timer.graph(step("group"), 1, reset, keep=True)
    # a last replay with the sampled layers' cells zeroed, a pattern in their in-flight cell and
    # zeros in the host bytes of that token
    sample = sorted({group_layers[0][0], group_layers[G // 2][-1], group_layers[-1][-1]},
                    key=lambda name: int(name[1:]))
    page_table = batch.page_tables[0]
    host_slot = page_table[:, H // PAGE].long()
    patterns = {}
    for layer in sample:
        gi, li = config.group_of(layer).index, int(layer[1:])
        cells = batch.cells(layer, "kv")
        cells.zero_()
        write = states[gi].write_table[:, 0].long()
        assert bool((write >= 0).all()), "no cell for the in-flight token"
        pattern = ((torch.arange(R, device=device) * 3 + li * 7 + 1) % 256).to(torch.uint8)
        patterns[layer] = pattern[:, None].expand(R, B)
        cells[:, 0][write // PAGE, write % PAGE] = patterns[layer]
        manager.storage.slot_pages(layer, "kv")[:, 0][host_slot, H % PAGE] = 0
    replay()
    del replay
    for gi, st in enumerate(states):
        got = (st.counters - saved[gi][2]).tolist()
        assert got == [R * (K - new), R * new, 0], f"group {gi}: hits, misses, invalid = {got}"
        assert bool((st.index_table >= 0).all()), f"group {gi}: a selected unit has no entry"
    for layer in sample:
        gi = config.group_of(layer).index
        host = manager.storage.slot_pages(layer, "kv")
        check_selection(batch.cells(layer, "kv"), host, page_table, sels1[gi], states[gi].index_table,
                        fresh[gi])
        assert torch.equal(host[:, 0][host_slot, H % PAGE], patterns[layer]), f"{layer}: flush wrote wrong bytes"
    peak = torch.cuda.max_memory_allocated() if device == "cuda" else 0
    cells_bytes = sum(batch.cells(layer, "kv").numel() for ls in group_layers for layer in ls)
    return {"us": us, "per_layer_fetch_us": per_layer_us, "no_fetch_us": no_fetch_us,
            "rows": R, "K": K, "S": S, "history": H,
            "layers": L, "groups": G, "new": new,
            "fetch_bytes": R * new * B * L, "flush_bytes": R * B * L, "cells_bytes": cells_bytes,
            "host_bytes": pool.data.numel(), "gpu_peak_bytes": peak, "sample": sample}


def bench_step(timer, device, quick, ceil, pres_us) -> list:
    """P-STEP (selection groups) and P-STEP-HS (61 private groups: per-layer resolve + fetch, the
    HiSparse shape), built one after the other so only one set of cells and host pages lives."""
    groups = step_sizes(quick)["groups"]
    grouped = run_step(timer, device, quick, groups, seed=5)
    release(device)
    private = run_step(timer, device, quick, [1] * sum(groups), seed=6)
    release(device)
    out = []
    for rid, s in (("P-STEP", grouped), ("P-STEP-HS", private)):
        nbytes = s["fetch_bytes"] + s["flush_bytes"]
        ideal = s["fetch_bytes"] / (ceil["h2d"] * 1e3) + s["flush_bytes"] / (ceil["d2h"] * 1e3)
        limit = 1.2 * ideal + s["groups"] * pres_us
        shape = (f"{s['layers']}L/{s['groups']}G x {s['rows']}r K={s['K']} S={s['S']} "
                 f"{100 * s['new'] / s['K']:.0f}%")
        note = (f"{s['layers']} layers in {s['groups']} selection groups, {s['rows']} rows, "
                f"{s['new']} misses per row per group; bytes moved {nbytes / 1e6:.3f} MB (fetch "
                f"{s['fetch_bytes'] / 1e6:.3f} + flush {s['flush_bytes'] / 1e6:.3f}); at CE "
                f"bandwidth {ideal:.0f} us; limit 1.2 x {ideal:.0f} + {s['groups']} x P-RES "
                f"{pres_us:.1f} = {limit:.0f} us; measured {s['us']:.0f} us; GPU cells "
                f"{s['cells_bytes'] / 1e9:.2f} GB (peak allocated {s['gpu_peak_bytes'] / 1e9:.2f} GB), "
                f"pinned host pages {s['host_bytes'] / 1e9:.2f} GB; bytes checked on {s['sample']}")
        fetch_us = s["us"] - s["no_fetch_us"]
        rate = f" = {s['fetch_bytes'] / fetch_us / 1e3:.1f} GB/s" if fetch_us > 0 else ""
        note += f"; without the fetches {s['no_fetch_us']:.0f} us, so fetch takes {fetch_us:.0f} us{rate}"
        if s["per_layer_fetch_us"] is not None:
            note += (f"; one fetch per group (as timed); with one fetch launch per layer instead "
                     f"{s['per_layer_fetch_us']:.0f} us")
        if rid == "P-STEP-HS":
            note += f"; P-STEP (grouped) is {s['us'] / grouped['us']:.2f}x faster"
            target, passed = "reference for P-STEP", None
        else:
            target, passed = f"<= {limit:.0f} us", None if device == "cpu" else s["us"] <= limit
        out.append(Result(rid, shape, s["us"], nbytes, "CE H2D", ceil["h2d"], target, passed,
                          extra={k: v for k, v in s.items() if k != "sample"} |
                          {"ideal_us": ideal, "limit_us": limit, "pres_us": pres_us, "note": note}))
    return out


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
        tables = batch_memory_bytes(config, len(manager.storage.groups), 1)["gpu"] - cells
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


def scaling_point(timer, device, rows, K, S, miss, seed, full=False, net=False) -> dict:
    """One resolve + fetch step (one layer, U=1, 656-B rows) from the steady state, with
    ``miss`` of the selection replaced by never-used units; graph-replayed, then checked like
    P-STEP (counters, index table, every selected unit's bytes). ``full``: the resident set is
    full first (S = 2K: an older selection of K units, then the current one), so every miss
    evicts an LRU victim (P-FETCH-HS). ``net``: timed by ``Timer.graph_net`` (without the
    replay's launch)."""
    assert not full or S == 2 * K, "a full resident set here needs S = 2K"
    new = max(1, round(K * miss))
    H = -(-((2 * K if full else K) + new) // PAGE) * PAGE
    config = sparse_config(device, rows=rows, width=K, slots=S, unit=1, page=PAGE, bytes_per_token=MLA_ROW,
                           tokens_per_row=H + 64)
    manager = kv.KVCacheManager(config)
    batch = kv.Batch(manager)
    seat(manager, batch, rows, H)
    fill_random(manager.storage.groups[0], seed)
    gen = torch.Generator(device=device).manual_seed(seed)
    order = torch.rand((rows, H), generator=gen, device=device).argsort(-1)
    pos = torch.rand((rows, K), generator=gen, device=device).argsort(-1)[:, :new]
    sel0 = order[:, :K].to(torch.int32).contiguous()
    sel1 = order[:, :K].scatter(1, pos, order[:, K:K + new]).to(torch.int32).contiguous()
    fresh = torch.zeros((rows, K), dtype=torch.bool, device=device).scatter_(1, pos, True)
    state = batch.group(0)
    warm = [order[:, K + new:2 * K + new].to(torch.int32).contiguous()] if full else []
    for sel in warm + [sel0]:  # the steady state: sel0 the most recent selection
        batch.resolve(0, sel)
        batch.fetch("l0")
    saved = snapshot([state])

    def body():
        batch.resolve(0, sel1)
        batch.fetch("l0")

    reset = lambda: restore([state], saved)  # noqa: E731
    us, replay = (timer.graph_net(body, reset) if net else
                  timer.graph(body, 1, reset, keep=True))
    cells = batch.cells("l0", "kv")
    cells.zero_()
    replay()
    got = (state.counters - saved[0][2]).tolist()
    assert got == [rows * (K - new), rows * new, 0], f"hits, misses, invalid = {got}"
    check_selection(cells, manager.storage.slot_pages("l0", "kv"), batch.page_tables[0], sel1,
                    state.index_table, fresh)
    return {"rows": rows, "K": K, "S": S, "miss_pct": 100 * new / K, "misses": rows * new,
            "bytes": rows * new * MLA_ROW, "us": us}


def fetch_hs_point(timer, device, rows, K, S, miss, seed) -> dict:
    """P-FETCH-HS's step: ``scaling_point`` from a full resident set, timed without the graph
    replay's launch (``Timer.graph_net``), as in the side-by-side comparison its targets come
    from."""
    return scaling_point(timer, device, rows, K, S, miss, seed, full=True, net=True)


#: SGLang HiSparse's swap-in at its best block size per shape, measured side by side with ours
#: on the H200 on 2026-12-01 (rows, miss fraction) -> us; its kernel is not part of the project
PEER_HS_US = {(1, 0.01): 17.3, (64, 0.01): 33.2, (16, 0.2): 109.9, (64, 0.2): 392.1}


def bench_fetch_hs(timer, device, quick, ceil) -> list:
    """P-FETCH-HS: resolve + fetch at the four shapes of the side-by-side comparison with SGLang
    HiSparse's swap-in kernel (1 x 1%, 64 x 1%, 16 x 20%, 64 x 20% of K=2048 missed, S=4096,
    656-B rows, U=1, full resident set, graph-replayed); the peer's time at each shape is the
    target. The 64 x 20% row is the id's headline shape (PERF.md); --quick runs small shapes."""
    out = []
    for (rows, miss), peer in PEER_HS_US.items():
        r, K, S = (min(rows, 4), 256, 512) if quick else (rows, 2048, 4096)
        s = fetch_hs_point(timer, device, r, K, S, miss, seed=7)
        note = (f"{s['misses']} misses ({s['misses'] // r} a row) of {MLA_ROW} B = "
                f"{s['bytes'] / 1e6:.3f} MB per step, resolve + fetch graph-replayed; "
                + (f"a small shape (no comparison)" if quick else
                   f"the peer's swap-in (resolve + copy in one launch) measured {peer} us on this "
                   f"shape (H200, 2026-12-01): ours {peer / s['us']:.2f}x as fast"))
        out.append(Result("P-FETCH-HS", f"res+fetch {r}r x {s['misses'] // r} misses K={K} S={S}",
                          s["us"], s["bytes"], "CE H2D", ceil["h2d"], f"< {peer} us (peer)",
                          None if device == "cpu" else s["us"] < peer,
                          extra={**s, "peer_us": peer, "note": note}))
    return out


def host_config(device, rows, layers, groups, tokens_per_row, history):
    """P-HOST's model: ``layers`` layers in selection groups of ``groups`` sizes, each with a
    656-B sparse latent and a 132-B dense indexer key, ``tokens_per_row`` per row. K = 64 and
    S = 128: the host path does not depend on them (they size cells and residency only), and
    small cells keep the run within the CPU machine's memory."""
    specs = []
    for gi, size in enumerate(groups):
        sparse = kv.SparseSpec(1, 64, 128, 16, selection_id=f"g{gi}" if size > 1 else None)
        for _ in range(size):
            specs.append(kv.LayerSpec(f"l{len(specs)}", [kv.BufferSpec("kv", MLA_ROW, sparse=True),
                                                         kv.BufferSpec("indexer_k", 132)],
                                      sparse=sparse))
    assert len(specs) == layers

    def make(gpu, host):
        return kv.CacheConfig(tokens_per_page=PAGE, layers=specs, max_rows=rows,
                              max_tokens_per_row=tokens_per_row, gpu_budget_bytes=gpu,
                              host_budget_bytes=host, device=device)

    probe = make(0, 0)
    reserve = batch_memory_bytes(probe, len(Storage(probe).groups), 1)
    pages = rows * (-(-(history + 4 * PAGE) // PAGE))  # every row's pages, with room to decode
    return make(rows * reserve["gpu"] + pages * layers * PAGE * 132 + (16 << 20),
                rows * reserve["host"] + pages * layers * PAGE * MLA_ROW + (16 << 20))


def host_sizes(quick: bool) -> dict:
    if quick:
        return {"rows": 8, "layers": 9, "groups": [4, 4, 1], "history": 64, "steps": 40,
                "max_tokens": [2048, 8192]}
    return {"rows": 64, "layers": 61, "groups": [4] * 15 + [1], "history": 256, "steps": 128,
            "max_tokens": [32768, 131072]}


def tables_match(batch) -> bool:
    """The device tables equal a full restage from the members (what a publish must leave)."""
    R, P = batch.max_rows, batch.config.max_pages_per_row
    for g, table in enumerate(batch.page_tables):
        expected = torch.full((R, P), -1, dtype=torch.int32)
        for row, cache in batch.members().items():
            pages = cache.pages(g)
            expected[row, :len(pages)] = torch.tensor(pages, dtype=torch.int32)
        if not torch.equal(table.cpu(), expected):
            return False
    lengths = [[0] * R, [0] * R, [-1] * R]
    for row, cache in batch.members().items():
        lengths[0][row], lengths[1][row] = cache.history_length, cache.capacity
        lengths[2][row] = batch.lease_of(row)
    return [batch.history.tolist(), batch.capacity.tolist(), batch.lease.tolist()] == lengths


def host_run(device, quick, max_tokens, path) -> dict:
    """Host wall time per decode step of the bookkeeping, each row decoding one token per step
    (rows start at staggered lengths, so page crossings are spread over the steps). ``path``:
    "per-row" (the flush's host record, then every row's resize(history=c, capacity=c+1), then
    publish), "batched" (record, one resize_rows, publish) or "advance" (the device advances
    the lengths inside a reserve; the host per step: publish, which takes the finished
    read-back and re-takes the reserves of rows that reached them, and record_advance). The
    device ops (flush, advance) run untimed, and finish before the timed part; the tables are
    checked against a full restage afterwards."""
    sz = host_sizes(quick)
    R, H, steps = sz["rows"], sz["history"], sz["steps"]
    config = host_config(device, R, sz["layers"], sz["groups"], max_tokens, H + steps + 2 * PAGE)
    manager = kv.KVCacheManager(config)
    batch = kv.Batch(manager)
    caches = []
    for row in range(R):  # staggered: row r at history H + r % PAGE, one token in flight
        caches += seat(manager, batch, 1, H + row % PAGE, capacity=H + row % PAGE + 1)
    if path == "advance":
        for cache in caches:
            cache.set_reserve(PAGE)
            assert cache.resize()
    batch.publish()
    rows = list(range(R))
    ones = torch.ones(R, dtype=torch.int32, device=device)
    times, publish_times = [], []
    counted = 8  # steps after the timed ones, run under a torch-call counter (untimed)
    counter = TorchCalls()  # counts the timed part of the steps after the timed ones
    for step in range(steps + counted):
        if step == steps:
            counter.__enter__()
        if path == "advance":
            batch.flush(batch.history + ones)  # the device work a replayed graph does
            batch.advance(ones)
            if device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()  # the host's part of a graph loop's step, the GPU done
            counter.counting = step >= steps
            batch.publish()  # takes the read-back of the last advance, re-takes reserves
            batch.record_advance()  # what follows the next replay
        else:
            batch.flush()  # untimed; its host record (idempotent) is timed again below
            if device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            counter.counting = step >= steps
            batch.record_flush()
            if path == "per-row":
                for cache in caches:
                    assert cache.resize(history=cache.capacity, capacity=cache.capacity + 1)
            else:
                c = [cache.capacity for cache in caches]
                assert batch.resize_rows(rows, capacity=[x + 1 for x in c], history=c) == []
            middle = time.perf_counter()
            batch.publish()
            publish_times.append((time.perf_counter() - middle) * 1e6)
        counter.counting = False
        times.append((time.perf_counter() - start) * 1e6)
    counter.__exit__(None, None, None)
    times, publish_times = times[:steps], publish_times[:steps]
    lengths = [cache.history_length for cache in caches]
    assert lengths == [H + r % PAGE + steps + counted for r in range(R)], \
        "every row decoded every step"
    assert tables_match(batch), "the published tables differ from a full restage"
    return {"us": statistics.median(times), "mean_us": statistics.fmean(times),
            "publish_us": statistics.median(publish_times) if publish_times else None,
            "max_us": max(times), "rows": R, "layers": sz["layers"], "steps": steps,
            "max_tokens": max_tokens, "path": path,
            "torch_calls": counter.per_step(counted)}


class TorchCalls(torch.overrides.TorchFunctionMode):
    """Counts torch functions and tensor methods called while active and ``counting`` (each a
    dispatch, and on CUDA most of them a CUDA API call; CUDA events are not torch functions).
    Counting adds overhead, so the counted steps come after the timed ones."""

    def __init__(self):
        super().__init__()
        self.calls, self.counting = 0, False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += self.counting
        return func(*args, **(kwargs or {}))

    def per_step(self, steps: int) -> float:
        return self.calls / steps


def bench_host(device, quick) -> list:
    """P-HOST at two max_tokens_per_row: per-row resize + publish, and the batched / advance
    paths; (a) must not depend on max_tokens_per_row."""
    out = []
    for max_tokens in host_sizes(quick)["max_tokens"]:
        runs = {path: host_run(device, quick, max_tokens, path)
                for path in ("per-row", "batched", "advance")}
        release(device)
        fast = min(runs["batched"]["us"], runs["advance"]["us"])
        r = runs["per-row"]
        out.append(Result(
            "P-HOST", f"{r['rows']}r {r['layers']}L max {max_tokens // 1024}K: per-row", r["us"],
            target="(b) <= 100us, (a) flat", passed=None if device == "cpu" else fast <= 100,
            extra={**{f"{p}_us": v["us"] for p, v in runs.items()},
                   **{f"{p}_max_us": v["max_us"] for p, v in runs.items()},
                   **{f"{p}_torch_calls": v["torch_calls"] for p, v in runs.items()},
                   "max_tokens": max_tokens, "per_row_publish_us": r["publish_us"],
                   "note": f"max_tokens_per_row {max_tokens}: host wall time per decode step, "
                           f"median of {r['steps']} steps: (a) per-row resize + publish "
                           f"{runs['per-row']['us']:.0f} us (publish {r['publish_us']:.0f}), "
                           f"(b) resize_rows + publish "
                           f"{runs['batched']['us']:.0f} us, (b) advance on the device + "
                           f"record_advance + publish {runs['advance']['us']:.0f} us (mean "
                           f"{runs['advance']['mean_us']:.0f}, max {runs['advance']['max_us']:.0f}: "
                           f"it includes any host chunk commit); torch calls "
                           f"per step (a) {runs['per-row']['torch_calls']:.1f}, (b) "
                           f"{runs['batched']['torch_calls']:.1f} / "
                           f"{runs['advance']['torch_calls']:.1f}; tables checked "
                           f"against a full restage"}))
    if device != "cpu":  # (a) within 1.5x across max_tokens_per_row, (b) <= 100 us at each
        spread = max(r.median_us for r in out) / min(r.median_us for r in out)
        for r in out:
            r.passed = r.passed and spread <= 1.5
            r.extra["per_row_spread"] = spread
    return out


def wall_sizes(quick: bool) -> dict:
    """P-STEP-WALL's history: P-STEP's selections with 2% of each row's units never used in the
    last ``period`` steps, every step, for hundreds of steps. A row's selection is a fixed core
    of K - new units plus a window of ``new`` units that walks a further ``period * new`` units
    of its history; a walked unit comes back after ``period`` steps, when the LRU resident set
    (S slots, the core's always among the newest) has evicted it: period x new >= 1.25 x the
    S - (K - new) slots beside the core. The history is the core plus the walk, in whole
    pages."""
    sz = step_sizes(quick)
    K, S = sz["K"], sz["S"]
    new = max(1, round(K * 0.02))
    period = -(-5 * (S - (K - new)) // (4 * new))
    history = -(-(K - new + period * new) // PAGE) * PAGE
    return sz | {"new": new, "period": period, "history": history}


def bench_step_wall(timer, device, quick) -> list:
    """P-STEP-WALL: P-STEP's step as a user runs it (publish; per group resolve with the fetch of
    its layers in the same call; write_indices; flush; advance by one token per row), host work
    included: eagerly, and as one captured graph per step replayed with the host's
    record_advance and publish around it; both as wall time per step over many steps
    (synchronised once at the end of each run), against the GPU time of the same ops (a replay
    and the read-back copy of record_advance, timed with CUDA events).

    Two selection streams over the same batch: *P-STEP's* (every row of every group selects
    2% units it has not used for ``period`` steps, so each step fetches P-STEP's bytes: the
    target rows), then *all resident* (four selections 2% apart, rotated, all resident after
    warm-up: no fetch bytes, a step of launches only, the host-bound extreme: reported). The
    timed steps' misses, summed, are checked against the stream's count per step. Each step
    selects from ``period`` precomputed selections (about 540 MB of device memory at
    P-STEP's shape) and, on CUDA, replays that selection's graph. On the CPU there is no graph and no GPU: the
    rows compare the eager step with its ops alone."""
    sz = wall_sizes(quick)
    R, K, S, H = sz["rows"], sz["K"], sz["S"], sz["history"]
    new, period = sz["new"], sz["period"]
    groups = sz["groups"]
    G, L = len(groups), sum(groups)
    # history grows one token a step, for fewer steps than half the reserve (asserted at the
    # end), so no top-up (page work at a publish) falls in a timed loop
    reserve = 32 * PAGE
    config = sparse_config(device, rows=R, width=K, slots=S, unit=1, page=PAGE,
                           bytes_per_token=MLA_ROW, layers=L, inflight=16,
                           tokens_per_row=H + reserve + 8 * PAGE, groups=groups)
    manager = kv.KVCacheManager(config)
    batch = kv.Batch(manager)
    caches = seat(manager, batch, R, H, capacity=H + 1)
    for cache in caches:
        cache.set_reserve(reserve)
        assert cache.resize()
    batch.publish()
    fill_random(manager.storage.groups[0], 11)
    gen = torch.Generator(device=device).manual_seed(11)
    order = torch.rand((G, R, H), generator=gen, device=device).argsort(-1).to(torch.int32)
    core, walk = order[..., :K - new], order[..., K - new:K - new + period * new]
    # the selection of step i is sets[i % period]: the core and the i-th window of the walk
    sets = torch.stack([torch.cat([core, walk[..., i * new:(i + 1) * new]], -1)
                        for i in range(period)]).contiguous()  # [period, G, R, K]
    del order, core, walk
    ones = torch.ones(R, dtype=torch.int32, device=device)

    def body_of(i):
        selection = sets[i]

        def body():
            for g in range(G):
                batch.resolve(g, selection[g], fetch=True)  # and every layer's fetch
            for g in range(G):
                batch.write_indices(g)
            batch.flush(batch.history + ones)
            batch.advance(ones)
        return body

    bodies = [body_of(i) for i in range(period)]
    steps = 8 if quick else 24
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    step = [0]  # every step the batch has made: the streams index their selections by it

    def misses() -> int:
        return sum(int(st.counters[1]) for st in batch.groups)

    def wall(run, runs: int = 5) -> float:
        """Median over ``runs`` runs of ``steps`` steps of the wall time per step (each
        synchronised once at its end): the steady state, not one run's hiccup on a shared
        host."""
        times = []
        for _ in range(runs):
            sync()
            start = time.perf_counter()
            for _ in range(steps):
                run(step[0])
                step[0] += 1
            sync()
            times.append((time.perf_counter() - start) * 1e6 / steps)
        return statistics.median(times)

    for body in bodies[:4]:  # first calls (recordings, lazy state) outside any capture
        batch.publish()
        body()
        step[0] += 1
    graphs = []
    if device == "cuda":  # one graph per selection of P-STEP's stream (the resident one's too)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        batch.publish()
        for body in bodies:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                body()
            graphs.append(graph)
        batch.record_advance()

    def measure(index, per_step_misses):
        """(eager, graph, GPU) us per step of the stream whose step i selects sets[index(i)];
        checks that every timed step missed ``per_step_misses`` units."""
        def eager(i):
            batch.publish()
            bodies[index(i)]()

        def replayed(i):
            batch.publish()
            graphs[index(i)].replay()
            batch.record_advance()

        def ops_alone(i):
            bodies[index(i)]()

        for run in (eager, replayed) if graphs else (eager,):
            for _ in range(period):  # warm-up: the steady state, each graph's first replay
                run(step[0])
                step[0] += 1
        sync()
        before, first = misses(), step[0]
        eager_us = wall(eager)
        graph_us = wall(replayed) if graphs else None
        if graphs:
            times = []
            for _ in range(steps):
                batch.publish()
                sync()
                start.record()
                graphs[index(step[0])].replay()
                batch.record_advance()  # its read-back copy is device work of the step too
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) * 1e3)
                step[0] += 1
            gpu_us = statistics.median(times)
        else:
            gpu_us = wall(ops_alone)
        sync()
        got, want = misses() - before, (step[0] - first) * per_step_misses
        assert got == want, f"{got} misses in the timed steps, expected {want}"
        return eager_us, graph_us, gpu_us

    fresh = measure(lambda i: i % period, R * new * G)
    resident = measure(lambda i: i % 4, 0)
    batch.catch_up()
    del graphs
    assert batch.advance_counters.tolist() == [0, 0], "a row was refused or ran out of pages"
    assert [c.history_length for c in caches] == [H + step[0]] * R, "every step advanced every row"
    assert step[0] <= reserve // 2, f"{step[0]} steps: a top-up may have fallen in a timed loop"
    for g, st in enumerate(batch.groups):
        assert bool((st.index_table >= 0).all()), f"group {g}: a selected unit has no entry"
    out = []
    for name, (eager_us, graph_us, gpu_us), claim in (
            (f"{100 * new / K:.0f}% misses", fresh, True), ("all resident", resident, False)):
        shape = f"{L}L/{G}G x {R}r K={K} S={S} {name}"
        note = (f"{name}: wall time per step, median of 5 runs of {steps} steps: eager "
                f"{eager_us:.0f} us"
                + (f", graph replay + record_advance + publish {graph_us:.0f} us" if graph_us else "")
                + f", against {'the GPU time of its ops' if graph_us else 'its ops alone'} "
                  f"{gpu_us:.0f} us (eager {eager_us / gpu_us:.2f}x"
                + (f", graph {graph_us / gpu_us:.2f}x)" if graph_us else ")"))
        if not claim:
            note += ("; no fetch bytes: a step of launches only, the host-bound extreme "
                     "(reported, P-STEP-WALL's targets are for P-STEP's misses)")
        gpu = device != "cpu"
        out.append(Result("P-STEP-WALL", f"{shape}: eager", eager_us,
                          target="<= 1.1x GPU time" if claim else "reported",
                          passed=eager_us <= 1.1 * gpu_us if gpu and claim else None,
                          extra={"gpu_us": gpu_us, "ratio": eager_us / gpu_us}))
        if graph_us is not None:
            out.append(Result("P-STEP-WALL", f"{shape}: graph", graph_us,
                              target="<= 1.02x GPU time" if claim else "reported",
                              passed=graph_us <= 1.02 * gpu_us if claim else None,
                              extra={"gpu_us": gpu_us, "ratio": graph_us / gpu_us}))
        out[-1].extra["note"] = note
    return out


def bench_scaling(timer, device, quick) -> list:
    """Time per step (resolve + fetch of one layer) and bytes moved, one dimension varied at a
    time from 64 rows, K=2048, S=4096, 2% misses: time should follow bytes moved, not rows x S."""
    if quick:
        base = {"rows": 4, "K": 128, "S": 256, "miss": 0.02}
        sweeps = {"rows": [1, 4, 8], "K": [64, 128], "S": [128, 256, 512], "miss": [0.01, 0.1, 1.0]}
        fixed = {"S": {"K": 64}}
    else:
        base = {"rows": 64, "K": 2048, "S": 4096, "miss": 0.02}
        sweeps = {"rows": [1, 4, 16, 64, 256], "K": [512, 1024, 2048], "S": [1024, 2048, 4096, 8192],
                  "miss": [0.001, 0.01, 0.02, 0.1, 0.5, 1.0]}
        fixed = {"S": {"K": 512}}  # S = 1K needs K <= S - 17
    points = []
    for name, values in sweeps.items():
        for v in values:
            shape = {**base, **fixed.get(name, {}), name: v}
            point = scaling_point(timer, device, shape["rows"], shape["K"], shape["S"], shape["miss"],
                                  seed=len(points))
            points.append({"sweep": name, **point})
            release(device)
    return points


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

    def config(host_bytes):
        layers = [kv.LayerSpec("mla", [kv.BufferSpec("kv", MLA_ROW, sparse=True)], sparse=sp)]
        return kv.CacheConfig(tokens_per_page=PAGE, layers=layers, max_rows=4,
                              max_tokens_per_row=1 << 20, gpu_budget_bytes=1 << 26,
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
    cores, default = available_cores(), default_threads()
    counts = sorted({1, default, cores} if quick else
                    {t for t in (1, 2, 4, 8, 16, 32, 64) if t <= cores} | {default, cores})
    rates = {}
    for threads in dict.fromkeys(counts):
        manager = kv.KVCacheManager(config(grow + (64 << 20)), host_threads=threads)
        group = manager.storage.groups[0]
        begin = time.perf_counter()
        assert group.allocate(grow // group.slot_bytes) is not None, manager.storage.region.last_error
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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small CPU smoke run of the harness")
    parser.add_argument("--scaling", action="store_true",
                        help="also the scaling table: rows, K, S and miss rate swept (takes longer)")
    parser.add_argument("--json", help="write the results to this file")
    parser.add_argument("--only", help="comma-separated ids to run (P-STEP and P-STEP-HS need "
                                       "P-RES, which then runs too); default: all")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args(argv)
    cuda = not args.quick and kv.has_cuda_kernels() and torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    if not cuda and not args.quick:
        print("no CUDA kernels or GPU: running the CPU smoke run (--quick)", file=sys.stderr)
        args.quick = True
    timer = Timer(device, 3 if args.quick else args.repeats)
    ceil = ceilings(timer, device, args.quick)
    ids = ["P-RES", "P-RES-MTP", "P-FETCH-ROW", "P-FETCH-PAGE", "P-FETCH-HS", "P-FLUSH", "P-INDEX",
           "P-TORCH", "P-STEP", "P-CAP", "P-HOST", "P-STEP-WALL", "P-START", "P-PFX", "P-TP"]
    wanted = set(ids if args.only is None else args.only.split(","))
    if wanted - set(ids) - {"P-STEP-HS"}:
        parser.error(f"--only: unknown ids {sorted(wanted - set(ids) - {'P-STEP-HS'})}")
    if wanted & {"P-STEP", "P-STEP-HS"}:
        wanted |= {"P-RES", "P-STEP"}
    q = args.quick
    benches = {
        "P-RES": lambda: [bench_resolve(timer, device, q)],
        "P-RES-MTP": lambda: bench_mtp(sys.modules[__name__], timer, device, q, results),
        "P-FETCH-ROW": lambda: [bench_fetch(timer, device, q, units=64 if q else 2048,
                                            unit_tokens=1, page=64, rid="P-FETCH-ROW",
                                            target_pct=75, ceil=ceil)],
        "P-FETCH-PAGE": lambda: [bench_fetch(timer, device, q, units=16 if q else 256,
                                             unit_tokens=64, page=64, rid="P-FETCH-PAGE",
                                             target_pct=90, ceil=ceil)],
        "P-FETCH-HS": lambda: bench_fetch_hs(timer, device, q, ceil),
        "P-FLUSH": lambda: [bench_flush(timer, device, q, ceil)],
        "P-INDEX": lambda: [bench_index(timer, device, q, ceil, *((4, 128) if q else (64, 2048))),
                            bench_index(timer, device, q, ceil, *((8, 512) if q else (1024, 32768)),
                                        rid="P-INDEX-L")],
        "P-TORCH": lambda: [bench_torch(timer, device, q)],
        "P-STEP": lambda: bench_step(timer, device, q, ceil, pres_us=results[0].median_us),
        "P-CAP": lambda: [bench_capacity(device, q)],
        "P-HOST": lambda: bench_host(device, q),
        "P-STEP-WALL": lambda: bench_step_wall(timer, device, q),
        "P-START": lambda: bench_start(device, q),
        "P-PFX": lambda: bench_prefix(timer, device, q, Result),
        "P-TP": lambda: bench_tp(device, q, run_module=sys.modules[__name__]),
    }
    results = []
    for rid in ids:
        if rid in wanted:
            results += benches[rid]()
            release(device)
    scaling = bench_scaling(timer, device, args.quick) if args.scaling else []
    for r in results:
        if r.passed is None and r.ceiling_gbs and device == "cuda" and "%" in r.target:
            r.passed = r.pct >= float(r.target.split("%")[0].split()[-1])
    title = "CPU smoke run: numbers are not claims" if device == "cpu" else torch.cuda.get_device_name()
    print(f"# torch_kvcm2 benchmarks — {title}")
    print(f"# ceilings: CE H2D {ceil['h2d']:.1f} GB/s, CE D2H {ceil['d2h']:.1f} GB/s, "
          f"HBM copy {ceil['hbm']:.0f} GB/s (read + write)")
    print(f"| {'id':12} | {'shape':44} | {'median us':>9} | {'GB/s':>7} | {'% ceil':>6} | {'target':20} | pass |")
    print(f"|{'-' * 14}|{'-' * 46}|{'-' * 11}|{'-' * 9}|{'-' * 8}|{'-' * 22}|------|")
    for r in results:
        verdict = "-" if r.passed is None else ("yes" if r.passed else "NO")
        print(f"| {r.id:12} | {r.shape:44} | {r.median_us:9.2f} | {r.gbs:7.1f} | {r.pct:6.1f} | "
              f"{r.target:20} | {verdict:4} |")
    for r in results:
        if r.extra.get("note"):
            print(f"# {r.id}: {r.extra['note']}")
    if scaling:
        print("# scaling: one resolve + fetch step (1 layer, U=1, 656-B rows) from the steady state, "
              "one dimension varied at a time")
        print(f"| {'sweep':5} | {'rows':>4} | {'K':>5} | {'S':>5} | {'miss %':>6} | {'misses':>7} | "
              f"{'MB moved':>8} | {'median us':>9} | {'GB/s':>6} |")
        print(f"|{'-' * 7}|{'-' * 6}|{'-' * 7}|{'-' * 7}|{'-' * 8}|{'-' * 9}|{'-' * 10}|{'-' * 11}|{'-' * 8}|")
        for p in scaling:
            print(f"| {p['sweep']:5} | {p['rows']:4} | {p['K']:5} | {p['S']:5} | {p['miss_pct']:6.2f} | "
                  f"{p['misses']:7} | {p['bytes'] / 1e6:8.3f} | {p['us']:9.2f} | {p['bytes'] / p['us'] / 1e3:6.1f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": title, "ceilings_gbs": ceil,
                       "results": [{**r.__dict__, "gbs": r.gbs, "pct": r.pct} for r in results],
                       "scaling": scaling}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
