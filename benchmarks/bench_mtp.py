"""P-RES-MTP: one multi-token resolve against T single-token resolves (docs/MTP.md).

    python benchmarks/bench_mtp.py [--quick] [--json out.json]   # or: run.py --only P-RES-MTP

Workload (P-RES-MTP): T = 2 and T = 4 query tokens per row, 64 rows, K = 2048, U = 1,
S = T·K + 1024 rounded to whole pages, history 8·K tokens per row. Query token 0's selection
replaces 1% of the previous step's with never-used units (P-RES's rule); token t is token t-1
with 10% of its columns redrawn from a per-row pool of draft units that a warm-up resolve made
resident, so a row's tokens overlap by ~90% and the union's misses stay ~1% of K. Timed as
CUDA-graph replays (harness.py's Timer; state restored before each replay): the [rows, T, K]
resolve, and the same step as T resolves of [rows, K]; next to P-RES from the same run. Every
output is checked before its time counts: on CUDA one replay's state, index table, miss list
and counters against the CPU kernel run on copies; on both, that every selected column has an
entry and that a unit has one entry across a row's tokens.

On an H200, T = 2 runs with the resolve's table in shared memory and T = 4 with it in global
scratch (docs/MTP.md: T·K > 4096 at S = T·K + 1024). A shape whose resolve does not fit at all
is reported as not fitting, with the kernel's message; if T = 4 does not, T = 3 and T = 4 at
K / 2 are measured too.
"""
from __future__ import annotations

import argparse
import sys
from types import SimpleNamespace

import torch

from bench_residency import bench_resolve, resolve_batch, resolve_only
from harness import PAGE, Result, Timer, pick_device, release, report, restore, snapshot
from torch_kvcm2 import ops


def mtp_workload(device, quick, T, K=None, seed=0):
    """The batch, its group state and ``sels[0..calls]`` int32[rows, T, K] (``sels[0]`` the
    warm-up: token 0 the first selection, later tokens the draft pool, padded)."""
    rows = 4 if quick else 64
    K = K or (256 if quick else 2048)
    S = -(-(T * K + 1024) // PAGE) * PAGE
    history = 8 * K
    config, manager, batch = resolve_batch(device, rows, K, S, history, query_tokens=T)
    g = torch.Generator().manual_seed(seed)
    calls = 4 if quick else 16
    new = max(1, K // 100)
    redraw = max(1, K // 10)
    pool_size = min((T - 1) * K, 2 * redraw * (T - 1))
    order = [torch.randperm(history, generator=g) for _ in range(rows)]
    # per row: K base units, then the draft pool, then never-used units in order
    pool = torch.stack([o[K:K + pool_size] for o in order])
    fresh_at = K + pool_size
    warm = torch.full((rows, T, K), -1, dtype=torch.int64)
    current = torch.stack([o[:K] for o in order])
    warm[:, 0] = current
    flat_pool = torch.full((rows, (T - 1) * K), -1, dtype=torch.int64)
    flat_pool[:, :pool_size] = pool
    warm[:, 1:] = flat_pool.view(rows, T - 1, K)
    sels = [warm.to(torch.int32).to(device).contiguous()]
    for step in range(calls):
        current = current.clone()
        for r in range(rows):
            lo = fresh_at + step * new
            current[r, torch.randperm(K, generator=g)[:new]] = order[r][lo:lo + new]
        sel = current[:, None, :].repeat(1, T, 1)
        for t in range(1, T):
            sel[:, t] = sel[:, t - 1]
            for r in range(rows):
                cols = torch.randperm(K, generator=g)[:redraw]
                sel[r, t, cols] = pool[r, torch.randint(0, pool_size, (redraw,), generator=g)]
        sels.append(sel.to(torch.int32).to(device).contiguous())
    return SimpleNamespace(manager=manager, batch=batch, state=batch.group(0), sels=sels,
                           rows=rows, K=K, S=S, T=T, calls=calls, config=config)


def check_structure(sel: torch.Tensor, table: torch.Tensor) -> None:
    """Every selected column has an entry, and equal units of a row have equal entries."""
    assert bool((table >= 0).all()), "a selected unit has no entry"
    rows = sel.shape[0]
    s, t = sel.reshape(rows, -1).long().cpu(), table.reshape(rows, -1).long().cpu()
    order = torch.argsort(s * (1 << 32) + t, dim=1)
    s, t = s.gather(1, order), t.gather(1, order)
    same = s[:, 1:] == s[:, :-1]
    assert bool((t[:, 1:][same] == t[:, :-1][same]).all()), "a unit has two entries in one row"


def check_against_cpu(w, before, sel, table) -> None:
    """One multi-token resolve from ``before`` (resident, recency, counters copies) on the CPU
    kernel equals what the device wrote (index table, state, counters, miss list up to order)."""
    st, batch, sp = w.state, w.batch, w.state.spec.sparse
    res, rec, cnt = (t.cpu().clone() for t in before)
    out = torch.empty(sel.shape, dtype=torch.int32)
    miss = torch.empty(st.miss_list.shape, dtype=torch.int32)
    count = torch.zeros(ops.MISS_COUNT_WORDS, dtype=torch.int32)
    slots = torch.empty(st.inflight_slots.shape, dtype=torch.int32)
    ops.resolve(res, rec, out, miss, count, cnt, slots, sel.cpu(), batch.history.cpu(),
                batch.capacity.cpu(), batch.lease.cpu(), sp.tokens_per_unit,
                w.config.tokens_per_page, sp.max_inflight_tokens, 0)
    assert torch.equal(out, table.cpu()), "index table differs from the CPU kernel's"
    assert torch.equal(res, st.resident.cpu()) and torch.equal(rec, st.recency.cpu())
    assert torch.equal(cnt, st.counters.cpu()), "counters differ from the CPU kernel's"
    n = int(count[0])
    assert n == int(st.miss_count[0]), "miss counts differ"
    assert sorted(map(tuple, miss[:n].tolist())) == \
        sorted(map(tuple, st.miss_list[:n].cpu().tolist())), "miss lists differ"


def measure(timer, device, quick, T, K=None):
    """Times one shape; returns a dict (``error`` set when the resolve does not fit)."""
    w = mtp_workload(device, quick, T, K)
    batch, state, calls = w.batch, w.state, w.calls
    try:
        batch.resolve(0, w.sels[0])  # warm-up: token 0's selection and the draft pool resident
        if device == "cuda":
            torch.cuda.synchronize()
    except RuntimeError as error:
        return {"T": T, "K": w.K, "S": w.S, "rows": w.rows, "error": str(error).split("\n")[0]}
    saved = snapshot([state])
    singles = [[s[:, t].contiguous() for t in range(T)] for s in w.sels]
    step = [0]

    def reset():
        restore([state], saved)
        step[0] = 0

    def union():
        resolve_only(batch, 0, w.sels[1 + step[0] % calls])
        step[0] += 1

    def separate():
        for sel in singles[1 + step[0] % calls]:
            resolve_only(batch, 0, sel)
        step[0] += 1

    # checks first: every step of one run of the union resolves (against the CPU kernel on
    # CUDA), and the step's hits and misses
    reset()
    distinct = misses = 0
    for i in range(calls):
        before = [t.clone() for t in (state.resident, state.recency, state.counters)]
        old = state.counters.clone()
        sel = w.sels[1 + i]
        table = batch.resolve(0, sel)
        check_structure(sel, table)
        if device == "cuda":
            check_against_cpu(w, before, sel, table)
        hit, miss, invalid = (state.counters - old).tolist()
        units = sum(len(set(r) - {-1}) for r in sel.reshape(w.rows, -1).tolist())
        assert invalid == 0 and hit + miss == units, \
            f"hits {hit} + misses {miss} != {units} distinct units (invalid {invalid})"
        distinct += units
        misses += miss
    us_union = timer.graph(union, calls, reset)
    us_separate = timer.graph(separate, calls, reset)
    overlap = []
    for s in w.sels[1:]:
        for t in range(1, T):
            same = (s[:, t] == s[:, t - 1]).float().mean().item()
            overlap.append(same)
    return {"T": T, "K": w.K, "S": w.S, "rows": w.rows, "union_us": us_union,
            "separate_us": us_separate, "miss_pct": 100 * misses / (calls * w.rows * w.K),
            "distinct_per_row": distinct / (calls * w.rows),
            "overlap_pct": 100 * sum(overlap) / len(overlap)}


def bench_mtp(timer, device, quick, results=()) -> list:
    """P-RES-MTP rows: T = 2 and T = 4 at K = 2048 (quick: 4 rows, K = 256), each against T
    single-token resolves and P-RES. ``results`` the run's earlier results (P-RES is measured
    here when absent)."""
    pres = next((r for r in results if r.id == "P-RES"), None)
    pres_us = (pres or bench_resolve(timer, device, quick)).median_us
    out = []
    points = [measure(timer, device, quick, T) for T in (2, 4)]
    release(device)
    if "error" in points[1]:  # T = 4 does not fit at K: T = 3 at K, and T = 4 at K / 2
        K = points[0]["K"]
        points += [measure(timer, device, quick, 3), measure(timer, device, quick, 4, K // 2)]
        release(device)
    for p in points:
        shape = f"T={p['T']}, {p['rows']} x K={p['K']}, S={p['S']}"
        if "error" in p:
            out.append(Result("P-RES-MTP", shape + ": does not fit", 0.0,
                              target="runs", passed=False if device == "cuda" else None,
                              extra={**p, "note": f"T={p['T']} K={p['K']}: {p['error']}"}))
            continue
        ratio = p["union_us"] / pres_us
        target = "T=2: <= 1.5 x P-RES" if p["T"] == 2 else f"< {p['T']} resolves"
        ok = p["union_us"] < p["separate_us"] and (p["T"] != 2 or ratio <= 1.5)
        note = (f"T={p['T']} K={p['K']}: {p['union_us']:.2f} us vs {p['T']} single-token "
                f"resolves {p['separate_us']:.2f} us ({p['separate_us'] / p['union_us']:.2f}x); "
                f"{ratio:.2f} x P-RES ({pres_us:.2f} us); misses {p['miss_pct']:.2f}% of K, "
                f"overlap {p['overlap_pct']:.1f}%, {p['distinct_per_row']:.0f} distinct units "
                f"per row")
        out.append(Result("P-RES-MTP", shape + ", 1% miss, 90% ovl", p["union_us"],
                          target=target, passed=None if device == "cpu" else ok,
                          extra={**p, "pres_us": pres_us, "ratio_pres": ratio, "note": note}))
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small CPU smoke run")
    parser.add_argument("--json", help="write the results to this file")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args(argv)
    device, args.quick = pick_device(args.quick)
    timer = Timer(device, 3 if args.quick else args.repeats)
    results = bench_mtp(timer, device, args.quick)
    report(results, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
