"""The benchmarks' shared harness: what several benchmark files use, and nothing that imports one
of them (run.py drives the per-area files; each area file and each stand-alone script imports
this module only, besides the library).

* timing: ``Timer`` (CUDA-graph replays timed with CUDA events, eager CUDA-event loops, copies;
  wall-clock loops on the CPU), ``median_call_us`` (host time of one call), ``graph_step_gpu_us``
  (the GPU time of a captured decode step);
* the ceilings of the same run (``ceilings``: copy-engine H2D / D2H, HBM copy);
* shared builders: ``sparse_config``, ``seat``, ``fill_random``, ``step_sizes`` (P-STEP's shape)
  and the residency snapshot / restore between replays;
* output checks: ``check_selection`` (every selected unit's bytes through the index table);
* output: ``Result`` (one table row), ``print_table`` / ``print_scaling`` / ``write_json`` (run.py's
  table and JSON), ``report`` (a stand-alone script's rows), ``machine_title``, ``pick_device``;
* ``bound_launches``: the one place that reads a batch's bound flush launches (a private of
  ``Batch``: no public call lists them).
"""
from __future__ import annotations

import gc
import json
import statistics
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

import torch_kvcm2 as kv
from torch_kvcm2.memory import batch_reserve_bytes

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

    @property
    def verdict(self) -> str:
        """The table's pass column: "-" where the row claims nothing."""
        return "-" if self.passed is None else ("yes" if self.passed else "NO")


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
                  inflight=16, tokens_per_row, host_bytes=None, groups=None, query_tokens=1):
    """Layers ``l0..`` with one sparse buffer ``kv`` each, all in one host pool group.
    ``groups`` lists the selection-group sizes in layer order (default: one group of all
    layers; a group of one layer is private). The GPU budget is the batch's exact reserve (there
    are no dense pools) plus 64 MiB; ``host_bytes`` defaults to pages for ``tokens_per_row``
    tokens of every row. ``query_tokens``: every layer's ``max_query_tokens`` (MTP)."""
    groups = [layers] if groups is None else list(groups)
    assert sum(groups) == layers, (groups, layers)
    buf = kv.BufferSpec("kv", bytes_per_token, sparse=True)
    specs = []
    for gi, size in enumerate(groups):
        sparse = kv.SparseSpec(unit, width, slots, inflight, selection_id=f"g{gi}" if size > 1 else None,
                               max_query_tokens=query_tokens)
        for _ in range(size):
            specs.append(kv.LayerSpec(f"l{len(specs)}", [buf], sparse=sparse))

    def make(gpu, host):
        return kv.CacheConfig(tokens_per_page=page, layers=specs, max_rows=rows,
                              max_tokens_per_row=tokens_per_row, gpu_budget_bytes=gpu,
                              host_budget_bytes=host, device=device)

    probe = make(0, 0)
    reserve = batch_reserve_bytes(probe)  # max_rows one-row batches: rows x one row's memory
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


def fill_random(pool: torch.Tensor, seed: int) -> None:
    """Random bytes in ``pool``, a pool group's committed slots as ops see them
    (``manager.pool(g)``: the UVA view of a host group on CUDA, which reaches every registered
    range, where one copy-engine transfer may not span two registrations), written in place by a
    kernel. Only the committed prefix is real memory; the rest of the reservation is left
    alone."""
    flat = pool.view(-1)
    gen = torch.Generator(device=flat.device).manual_seed(seed)
    chunk = 1 << 28
    for i in range(0, flat.numel(), chunk):
        flat[i:i + chunk].random_(0, 256, generator=gen)


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


def step_sizes(quick: bool) -> dict:
    """P-STEP's shape. Default: 64 rows, K=2048, S=4096, U=1, 656-B rows, 2% misses, 61 sparse
    layers; history 2,560 tokens per row (enough for K + the misses; the host pool holds 41
    pages per row of all 61 layers: 6.7 GB pinned); cells 61 x 64 x 4096 x 656 B = 10.5 GB."""
    if quick:
        return {"rows": 4, "K": 64, "S": 128, "history": 128, "groups": [4, 4, 1]}
    return {"rows": 64, "K": 2048, "S": 4096, "history": 2560, "groups": [4] * 15 + [1]}


def reserved_step_batch(device, sz: dict, reserve: int):
    """P-STEP's layers and rows (``sz``: ``step_sizes`` or a superset) as P-STEP-WALL runs
    them: every row seated at ``sz["history"]`` with one token in flight and a reserve of
    ``reserve`` tokens that ``advance`` moves through, published. Returns ``(manager, batch,
    caches)``."""
    R, H, groups = sz["rows"], sz["history"], sz["groups"]
    config = sparse_config(device, rows=R, width=sz["K"], slots=sz["S"], unit=1, page=PAGE,
                           bytes_per_token=MLA_ROW, layers=sum(groups), inflight=16,
                           tokens_per_row=H + reserve + 8 * PAGE, groups=groups)
    manager = kv.KVCacheManager(config)
    batch = kv.Batch(manager)
    caches = seat(manager, batch, R, H, capacity=H + 1)
    for cache in caches:
        cache.set_reserve(reserve)
        assert cache.resize()
    batch.publish()
    return manager, batch, caches


def eager_step(batch, selection, accepted, all_groups: bool = False):
    """The device part of a decode step as a user writes it (P-STEP-WALL's body): per selection
    group ``resolve`` with the fetch of its layers in the same call (``selection[g]``; with
    ``all_groups`` every group in one ``resolve_groups`` call), every group's
    ``write_indices``, ``flush`` of the in-flight token and ``advance`` by ``accepted``. The
    host's ``publish`` comes before it (or ``record_advance`` after a replay). Returns the step
    as a function of no arguments."""
    groups = range(len(batch.groups))
    selections = [selection[g] for g in groups]

    def body():
        if all_groups:
            batch.resolve_groups(selections, fetch=True)
        else:
            for g in groups:
                batch.resolve(g, selections[g], fetch=True)  # and every layer's fetch
        for g in groups:
            batch.write_indices(g)
        batch.flush(batch.history + accepted)
        batch.advance(accepted)
    return body


def pick_device(quick: bool) -> tuple[str, bool]:
    """``(device, quick)``: CUDA when the kernels were built, a GPU is visible and ``quick`` is
    off; otherwise the CPU, always quick."""
    cuda = not quick and kv.has_cuda_kernels() and torch.cuda.is_available()
    return ("cuda", quick) if cuda else ("cpu", True)


def machine_title(device: str) -> str:
    return "CPU smoke run: numbers are not claims" if device == "cpu" else torch.cuda.get_device_name()


def bound_launches(batch) -> SimpleNamespace:
    """A batch's bound flush launches, read here only (a private of ``Batch``: no public call
    lists them): ``flush``, one tuple per launch, ``(pool, positions, cells, resident,
    inflight_slots, page_table)``."""
    step = batch._step  # device_step.DeviceStep
    return SimpleNamespace(flush=[before for before, _ in step.flush_args])


def graph_step_gpu_us(batch, replay, steps: int) -> float:
    """The median GPU time (CUDA events) of one decode step replayed as a captured graph:
    ``replay()`` replays the step's graph; the host's ``publish`` runs before the timed part and
    ``record_advance`` (its read-back copy is device work of the step too) inside it."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(steps):
        batch.publish()
        torch.cuda.synchronize()
        start.record()
        replay()
        batch.record_advance()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def print_table(results: list, ceil: dict, title: str) -> None:
    """run.py's table: the ceilings, one row per result, then each result's note."""
    print(f"# torch_kvcm2 benchmarks — {title}")
    print(f"# ceilings: CE H2D {ceil['h2d']:.1f} GB/s, CE D2H {ceil['d2h']:.1f} GB/s, "
          f"HBM copy {ceil['hbm']:.0f} GB/s (read + write)")
    print(f"| {'id':12} | {'shape':44} | {'median us':>9} | {'GB/s':>7} | {'% ceil':>6} | {'target':20} | pass |")
    print(f"|{'-' * 14}|{'-' * 46}|{'-' * 11}|{'-' * 9}|{'-' * 8}|{'-' * 22}|------|")
    for r in results:
        print(f"| {r.id:12} | {r.shape:44} | {r.median_us:9.2f} | {r.gbs:7.1f} | {r.pct:6.1f} | "
              f"{r.target:20} | {r.verdict:4} |")
    for r in results:
        if r.extra.get("note"):
            print(f"# {r.id}: {r.extra['note']}")


def print_scaling(points: list) -> None:
    """The scaling table (``bench_fetch.bench_scaling``'s points)."""
    print("# scaling: one resolve + fetch step (1 layer, U=1, 656-B rows) from the steady state, "
          "one dimension varied at a time")
    print(f"| {'sweep':5} | {'rows':>4} | {'K':>5} | {'S':>5} | {'miss %':>6} | {'misses':>7} | "
          f"{'MB moved':>8} | {'median us':>9} | {'GB/s':>6} |")
    print(f"|{'-' * 7}|{'-' * 6}|{'-' * 7}|{'-' * 7}|{'-' * 8}|{'-' * 9}|{'-' * 10}|{'-' * 11}|{'-' * 8}|")
    for p in points:
        print(f"| {p['sweep']:5} | {p['rows']:4} | {p['K']:5} | {p['S']:5} | {p['miss_pct']:6.2f} | "
              f"{p['misses']:7} | {p['bytes'] / 1e6:8.3f} | {p['us']:9.2f} | {p['bytes'] / p['us'] / 1e3:6.1f} |")


def write_json(path: str, data) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=1)


def report(results: list, json_path: str | None, *, target: bool = True, note_indent: str = " ") -> None:
    """A stand-alone benchmark script's output: a line per result (id, shape, median, the target
    when ``target``, the verdict) with its note under it; the results' fields as JSON."""
    for r in results:
        columns = [r.id, r.shape, f"{r.median_us:.2f} us"] + ([r.target] if target else []) + [r.verdict]
        print("| " + " | ".join(columns) + " |")
        print(f"#{note_indent}{r.extra['note']}")
    if json_path:
        write_json(json_path, [dict(r.__dict__) for r in results])
