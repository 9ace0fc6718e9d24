"""Decode-step benchmarks: P-STEP / P-STEP-HS (a whole step of cache ops, 61 sparse layers in 16
selection groups or 61 private ones, as one graph replay) and P-STEP-WALL (the same step as a
user runs it, host work included: eager and replayed, wall time against the GPU time of its
ops)."""
from __future__ import annotations

import statistics
import time

import torch

import torch_kvcm2 as kv
from harness import (MLA_ROW, PAGE, Result, bound_launches, check_selection, eager_step,
                     fill_random, graph_step_gpu_us, release, reserved_step_batch, restore, seat,
                     snapshot, sparse_config, step_sizes)


def run_step(timer, device, quick, groups, seed, rows=None, modes=("layer", "none", "group"),
             checked=("group",)) -> dict:
    """A full decode step of cache ops with the given selection-group sizes (``rows`` rows, or
    P-STEP's): per group one resolve and one fetch of all its layers (``Batch.fetch(*layers)``,
    one launch; mode "group"), then one write_indices per group and one flush, captured as one
    graph and replayed from the steady state (the previous selection resident and fetched, one
    token in flight per row). The other modes time the same step with one fetch launch per layer
    ("layer"), without any fetch ("none": what the step spends outside fetch), and with every
    group resolved and fetched in one call ("all": ``Batch.resolve_groups``, every group's
    resolve launched side by side on side streams, then one fetch launch for all groups). For each mode in ``checked`` (cells zeroed before a
    last replay): every group's counters and index table, and on sampled layers every selected
    unit's bytes and the flushed token. Returns ``us`` (the first checked mode) and
    ``<mode>_us`` per mode."""
    sz = step_sizes(quick)
    R, K, S, H = rows or sz["rows"], sz["K"], sz["S"], sz["history"]
    L, G, B = sum(groups), len(groups), MLA_ROW
    config = sparse_config(device, rows=R, width=K, slots=S, unit=1, page=PAGE, bytes_per_token=B,
                           layers=L, inflight=16, tokens_per_row=H + 64, groups=groups)
    manager = kv.KVCacheManager(config)
    batch = kv.Batch(manager)
    seat(manager, batch, R, H, capacity=H + 1)  # token H is in flight
    assert manager.pool_groups == 1 and len(bound_launches(batch).flush) == 1
    fill_random(manager.pool(0), seed)
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

    def step(fetch: str):  # "group", "layer", "none", "all": the modes above
        def body():
            if fetch == "all":
                batch.resolve_groups(sels1, fetch=True)
            for gi, layers in enumerate(group_layers):
                if fetch == "all":
                    break
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
    times, replays = {}, {}
    for mode in modes:
        if mode == "layer" and G == L:
            times[mode] = None  # one layer per group: the same as "group"
        elif mode in checked:
            times[mode], replays[mode] = timer.graph(step(mode), 1, reset, keep=True)
        else:
            times[mode] = timer.graph(step(mode), 1, reset)
    # a last replay with the sampled layers' cells zeroed, a pattern in their in-flight cell and
    # zeros in the host bytes of that token
    sample = sorted({group_layers[0][0], group_layers[G // 2][-1], group_layers[-1][-1]},
                    key=lambda name: int(name[1:]))
    page_table = batch.page_tables[0]
    host_slot = page_table[:, H // PAGE].long()
    for mode in checked:
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
            manager.slot_pages(layer, "kv")[:, 0][host_slot, H % PAGE] = 0
        replays.pop(mode)()
        for gi, st in enumerate(states):
            got = (st.counters - saved[gi][2]).tolist()
            assert got == [R * (K - new), R * new, 0], \
                f"{mode}: group {gi}: hits, misses, invalid = {got}"
            assert bool((st.index_table >= 0).all()), f"{mode}: group {gi}: a selected unit has no entry"
        for layer in sample:
            gi = config.group_of(layer).index
            host = manager.slot_pages(layer, "kv")
            check_selection(batch.cells(layer, "kv"), host, page_table, sels1[gi],
                            states[gi].index_table, fresh[gi])
            assert torch.equal(host[:, 0][host_slot, H % PAGE], patterns[layer]), \
                f"{mode}: {layer}: flush wrote wrong bytes"
    peak = torch.cuda.max_memory_allocated() if device == "cuda" else 0
    pool = manager.stats()["pool_groups"][0]  # the host pool's reservation, committed or not
    host_bytes = pool["slots"] * pool["scale"] * pool["page_bytes"]
    cells_bytes = sum(batch.cells(layer, "kv").numel() for ls in group_layers for layer in ls)
    return {"us": times[checked[0]], **{f"{mode}_us": t for mode, t in times.items()},
            "rows": R, "K": K, "S": S, "history": H,
            "layers": L, "groups": G, "new": new,
            "fetch_bytes": R * new * B * L, "flush_bytes": R * B * L, "cells_bytes": cells_bytes,
            "host_bytes": host_bytes, "gpu_peak_bytes": peak, "sample": sample}


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
        fetch_us = s["us"] - s["none_us"]
        rate = f" = {s['fetch_bytes'] / fetch_us / 1e3:.1f} GB/s" if fetch_us > 0 else ""
        note += f"; without the fetches {s['none_us']:.0f} us, so fetch takes {fetch_us:.0f} us{rate}"
        if s["layer_us"] is not None:
            note += (f"; one fetch per group (as timed); with one fetch launch per layer instead "
                     f"{s['layer_us']:.0f} us")
        if rid == "P-STEP-HS":
            note += f"; P-STEP (grouped) is {s['us'] / grouped['us']:.2f}x faster"
            target, passed = "reference for P-STEP", None
        else:
            target, passed = f"<= {limit:.0f} us", None if device == "cpu" else s["us"] <= limit
        out.append(Result(rid, shape, s["us"], nbytes, "CE H2D", ceil["h2d"], target, passed,
                          extra={k: v for k, v in s.items() if k != "sample"} |
                          {"ideal_us": ideal, "limit_us": limit, "pres_us": pres_us, "note": note}))
    return out


#: P-STEP's step with one resolve and one fetch launch per group, graph-replayed, on the H200
#: (2026-12-02): µs per step by rows, P-STEP-1's baseline.
STEP_1_BASELINE = {1: 247, 8: 500, 32: 1446, 64: 2741, 128: 5550}


def bench_step_1(timer, device, quick, ceil, pres_us) -> list:
    """P-STEP-1: P-STEP's step (61 layers in 16 groups, 2% misses, graph-replayed) at 1, 8, 32,
    64 and 128 rows with every group resolved and fetched in one call (``resolve_groups``: one
    resolve and one fetch launch), against the same step with one resolve and one fetch per
    group measured in the same run; both checked (counters, index tables, sampled cells and the
    flushed token). Targets: <= 100 µs at 1 row; <= 1.5 x (bytes ÷ copy engine) + 2 x P-RES
    from 8 to 128 rows. Then P-STEP-WALL's eager step at 1 and 8 rows, per group and all groups
    in one call, against its GPU time (target <= 1.1x)."""
    groups = step_sizes(quick)["groups"]
    out = []
    for R in (1, 2) if quick else (1, 8, 32, 64, 128):
        s = run_step(timer, device, quick, groups, seed=7, rows=R, modes=("group", "all"),
                     checked=("all", "group"))
        release(device)
        nbytes = s["fetch_bytes"] + s["flush_bytes"]
        ideal = s["fetch_bytes"] / (ceil["h2d"] * 1e3) + s["flush_bytes"] / (ceil["d2h"] * 1e3)
        limit = 100.0 if R == 1 else 1.5 * ideal + 2 * pres_us
        shape = f"{s['layers']}L/{s['groups']}G x {R}r K={s['K']} S={s['S']} 2%: all groups"
        base = STEP_1_BASELINE.get(R)
        note = (f"{R} rows: all groups in one call {s['all_us']:.0f} us, one resolve + fetch per "
                f"group {s['group_us']:.0f} us in the same run ({s['group_us'] / s['all_us']:.2f}x"
                f"{f'; 2026-12-02 baseline {base} us' if base and device == 'cuda' else ''}); "
                f"bytes {nbytes / 1e6:.2f} MB (fetch {s['fetch_bytes'] / 1e6:.2f} + flush "
                f"{s['flush_bytes'] / 1e6:.2f}), at CE bandwidth {ideal:.0f} us; "
                + ("target 100 us" if R == 1 else
                   f"target 1.5 x {ideal:.0f} + 2 x P-RES {pres_us:.1f} = {limit:.0f} us"))
        out.append(Result("P-STEP-1", shape, s["all_us"], nbytes, "CE H2D", ceil["h2d"],
                          f"<= {limit:.0f} us", None if device == "cpu" else s["all_us"] <= limit,
                          extra={k: v for k, v in s.items() if k != "sample"} |
                          {"ideal_us": ideal, "limit_us": limit, "baseline_us": base,
                           "note": note}))
    for R in (1,) if quick else (1, 8):
        for all_groups in (False, True):
            out += bench_step_wall(timer, device, quick, rows=R, all_groups=all_groups)
            release(device)
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


def bench_step_wall(timer, device, quick, rows=None, all_groups=False) -> list:
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
    rows compare the eager step with its ops alone.

    With ``rows`` (P-STEP-1's small batches) the batch has that many rows, only P-STEP's stream
    runs and P-OBS is not measured; ``all_groups`` resolves every group in one call."""
    sz = wall_sizes(quick) | ({"rows": rows} if rows else {})
    default = rows is None and not all_groups
    R, K, S, H = sz["rows"], sz["K"], sz["S"], sz["history"]
    new, period = sz["new"], sz["period"]
    groups = sz["groups"]
    G, L = len(groups), sum(groups)
    # history grows one token a step, for fewer steps than half the reserve (asserted at the
    # end), so no top-up (page work at a publish) falls in a timed loop
    reserve = 40 * PAGE
    manager, batch, caches = reserved_step_batch(device, sz, reserve)
    fill_random(manager.pool(0), 11)
    gen = torch.Generator(device=device).manual_seed(11)
    order = torch.rand((G, R, H), generator=gen, device=device).argsort(-1).to(torch.int32)
    core, walk = order[..., :K - new], order[..., K - new:K - new + period * new]
    # the selection of step i is sets[i % period]: the core and the i-th window of the walk
    sets = torch.stack([torch.cat([core, walk[..., i * new:(i + 1) * new]], -1)
                        for i in range(period)]).contiguous()  # [period, G, R, K]
    del order, core, walk
    ones = torch.ones(R, dtype=torch.int32, device=device)

    bodies = [eager_step(batch, sets[i], ones, all_groups) for i in range(period)]
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

    for body in bodies[:4]:  # first calls (lazy state) outside any capture
        batch.publish()
        body()
        step[0] += 1
    graphs = []
    if device == "cuda":  # one graph per selection of P-STEP's stream (the resident one's too)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        batch.publish()
        for body in bodies:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                body()
            graphs.append(graph)
        batch.record_advance()

    scrape = metrics_scraper(manager)
    observed_reads = [0, 0]  # metrics() calls, scrapes

    def observe():
        """P-OBS: ``metrics()`` every step, a Prometheus scrape (or, without prometheus_client,
        the same metrics() walk the collector makes) every 100 steps."""
        snapshot = manager.metrics()
        observed_reads[0] += 1
        if observed_reads[0] % 100 == 1:  # the first observed step, then every 100th
            scrape()
            observed_reads[1] += 1
        return snapshot

    def measure(index, per_step_misses, obs=False):
        """(eager, graph, GPU, observed) us per step of the stream whose step i selects
        sets[index(i)]; checks that every timed step missed ``per_step_misses`` units. With
        ``obs``, ``observed`` is (plain, with observation) us per step of the graph (eager on
        the CPU) over interleaved runs, for P-OBS; else None."""
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
            def replay():
                graphs[index(step[0])].replay()
                step[0] += 1

            gpu_us = graph_step_gpu_us(batch, replay, steps)
        else:
            gpu_us = wall(ops_alone)
        observed = None
        if obs:
            plain = replayed if graphs else eager

            def watched(i):
                plain(i)
                observe()

            # interleaved pairs, so drift on a shared machine hits both sides alike
            pairs = [(wall(plain, 1), wall(watched, 1)) for _ in range(6)]
            observed = (statistics.median(p for p, _ in pairs),
                        statistics.median(w for _, w in pairs))

            def guarded():  # untimed: CUDA raises on any synchronising call in these steps
                for _ in range(steps):
                    watched(step[0])
                    step[0] += 1

            sync_checked(device, guarded)
        sync()
        got, want = misses() - before, (step[0] - first) * per_step_misses
        assert got == want, f"{got} misses in the timed steps, expected {want}"
        return eager_us, graph_us, gpu_us, observed

    fresh = measure(lambda i: i % period, R * new * G, obs=default)
    resident = measure(lambda i: i % 4, 0) if default else None
    batch.poll()
    del graphs
    assert batch.advance_counters.tolist() == [0, 0], "a row was refused or ran out of pages"
    assert [c.history_length for c in caches] == [H + step[0]] * R, "every step advanced every row"
    assert step[0] <= reserve // 2, f"{step[0]} steps: a top-up may have fallen in a timed loop"
    for g, st in enumerate(batch.groups):
        assert bool((st.index_table >= 0).all()), f"group {g}: a selected unit has no entry"
    out = []
    streams = [(f"{100 * new / K:.0f}% misses", fresh, True)]
    if resident is not None:
        streams.append(("all resident", resident, False))
    how = ", all groups in one call" if all_groups else ""
    for name, (eager_us, graph_us, gpu_us, _), claim in streams:
        shape = f"{L}L/{G}G x {R}r K={K} S={S} {name}{how}"
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
    if not default:
        return out
    plain_us, watched_us = fresh[3]
    metrics = manager.metrics()
    hits = sum(g["hits"] for g in metrics["selection_groups"].values())
    assert observed_reads[0] >= 7 * steps and observed_reads[1] >= 1, observed_reads
    assert hits > 0, "metrics() saw no device counters"
    ratio = watched_us / plain_us
    out.append(Result(
        "P-OBS", f"{L}L/{G}G x {R}r K={K}: {'graph' if device == 'cuda' else 'eager'} step "
        f"+ metrics() every step, a scrape every 100", watched_us, target="<= 1.01x without",
        passed=ratio <= 1.01 if device == "cuda" else None,
        extra={"without_us": plain_us, "ratio": ratio, "metrics_calls": observed_reads[0],
               "scrapes": observed_reads[1],
               "note": f"{watched_us:.0f} us per step with metrics() every step and "
                       f"{observed_reads[1]} scrape(s) every 100 steps, against {plain_us:.0f} us "
                       f"without ({ratio:.3f}x; medians of 6 interleaved runs of {steps} steps); "
                       f"no synchronising CUDA call"
                       + (" (torch.cuda.set_sync_debug_mode('error') around them)"
                          if device == "cuda" else "")}))
    return out


def metrics_scraper(manager):
    """A Prometheus scrape of ``manager`` (text exposition of a registry holding the library's
    collector) when prometheus_client is installed; else the collector's own walk of
    ``metrics()``, which is most of a scrape's cost."""
    try:
        import prometheus_client
    except ImportError:
        return manager.metrics
    from torch_kvcm2.metrics import register
    registry = prometheus_client.CollectorRegistry()
    register(manager, registry)
    return lambda: prometheus_client.generate_latest(registry)


def sync_checked(device, run):
    """``run()`` with CUDA's sync debug mode raising on any synchronising call (CUDA only)."""
    if device != "cuda":
        return run()
    torch.cuda.set_sync_debug_mode("error")
    try:
        return run()
    finally:
        torch.cuda.set_sync_debug_mode("default")
