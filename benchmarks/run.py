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
P-STEP-1 times that step at 1 to 128 rows with every group resolved and fetched in one call,
against one resolve and fetch per group in the same run, and P-STEP-WALL's eager step at 1 and
8 rows both ways;
P-CAP reads the GPU bytes per request off the batch's cell tensors at two context lengths;
P-STEP-WALL's run also gives P-OBS (its captured step with ``metrics()`` every step and a
Prometheus scrape every 100, interleaved with runs without).

Memory on the GPU machine (default run): P-STEP's 61 layers x 64 rows x 4096 slots x 656 B are
10.5 GB of GPU cells and 64 rows x 2,560 tokens of history x 61 layers are 6.7 GB of pinned
host pages; P-STEP and P-STEP-HS are built one after the other (peak ~10.6 GB GPU, ~6.7 GB
pinned). P-STEP-1's largest batch, 128 rows, doubles both (21 GB of cells, 13.4 GB pinned),
one batch at a time. P-PREEMPT builds the same cells again, with 63 rows of 5,120 tokens and one of 32K:
14.2 GB of pinned host pages, 2.9 GB of GPU dense pages and a 258 MB host tier. Everything
else is below 1 GB on either side.

This file is the driver (the flags, the order of the ids, the table and the JSON); the
benchmarks live in one file per area, each importing harness.py (timing, ceilings, shared
builders, output): bench_residency.py (P-RES, P-TORCH, P-INDEX), bench_mtp.py (P-RES-MTP),
bench_fetch.py (P-FETCH-*, P-FLUSH, the scaling table), bench_step.py (P-STEP, P-STEP-HS,
P-STEP-WALL), bench_host.py (P-HOST), bench_memory.py (P-CAP, P-START), bench_prefix.py
(P-PFX), bench_tp.py (P-TP), bench_preempt.py (P-PREEMPT), bench_gpu_history.py
(P-DEMOTE) and serve.py (P-SERVE: also a script of its own, with its table, JSON and plot).
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_fetch import bench_fetch, bench_fetch_hs, bench_flush, bench_scaling  # noqa: E402
from bench_host import bench_host  # noqa: E402
from bench_memory import bench_capacity, bench_start  # noqa: E402
from bench_gpu_history import bench_demote  # noqa: E402
from bench_mtp import bench_mtp  # noqa: E402
from bench_preempt import bench_preempt  # noqa: E402
from bench_prefix import bench_prefix  # noqa: E402
from bench_residency import bench_index, bench_resolve, bench_torch  # noqa: E402
from bench_step import bench_step, bench_step_1, bench_step_wall  # noqa: E402
from bench_tp import bench_tp  # noqa: E402
from serve import bench_serve  # noqa: E402
from harness import (Timer, ceilings, machine_title, pick_device, print_scaling,  # noqa: E402
                     print_table, release, write_json)


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
    device, quick = pick_device(args.quick)
    if quick and not args.quick:
        print("no CUDA kernels or GPU: running the CPU smoke run (--quick)", file=sys.stderr)
        args.quick = True
    timer = Timer(device, 3 if args.quick else args.repeats)
    ceil = ceilings(timer, device, args.quick)
    ids = ["P-RES", "P-RES-MTP", "P-FETCH-ROW", "P-FETCH-PAGE", "P-FETCH-HS", "P-FLUSH", "P-INDEX",
           "P-TORCH", "P-STEP", "P-STEP-1", "P-CAP", "P-HOST", "P-STEP-WALL", "P-START", "P-PFX", "P-TP", "P-PREEMPT",
           "P-DEMOTE", "P-SERVE"]
    wanted = set(ids if args.only is None else args.only.split(","))
    riders = {"P-STEP-HS", "P-OBS"}  # measured by P-STEP and P-STEP-WALL
    if wanted - set(ids) - riders:
        parser.error(f"--only: unknown ids {sorted(wanted - set(ids) - riders)}")
    if wanted & {"P-STEP", "P-STEP-HS"}:
        wanted |= {"P-RES", "P-STEP"}
    if "P-STEP-1" in wanted:
        wanted.add("P-RES")
    if "P-OBS" in wanted:
        wanted.add("P-STEP-WALL")
    q = args.quick
    benches = {
        "P-RES": lambda: [bench_resolve(timer, device, q)],
        "P-RES-MTP": lambda: bench_mtp(timer, device, q, results),
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
        "P-STEP-1": lambda: bench_step_1(timer, device, q, ceil, pres_us=results[0].median_us),
        "P-CAP": lambda: [bench_capacity(device, q)],
        "P-HOST": lambda: bench_host(device, q),
        "P-STEP-WALL": lambda: bench_step_wall(timer, device, q),
        "P-START": lambda: bench_start(device, q),
        "P-PFX": lambda: bench_prefix(timer, device, q),
        "P-TP": lambda: bench_tp(device, q),
        "P-PREEMPT": lambda: bench_preempt(device, q, ceil),
        "P-DEMOTE": lambda: bench_demote(device, q),
        "P-SERVE": lambda: bench_serve(device, q),
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
    title = machine_title(device)
    print_table(results, ceil, title)
    if scaling:
        print_scaling(scaling)
    if args.json:
        write_json(args.json, {"device": title, "ceilings_gbs": ceil,
                               "results": [{**r.__dict__, "gbs": r.gbs, "pct": r.pct} for r in results],
                               "scaling": scaling})
    return 0


if __name__ == "__main__":
    sys.exit(main())
