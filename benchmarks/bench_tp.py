"""P-TP: tensor-parallel ranks of one node sharing one host pool (docs/TP.md).

    python benchmarks/bench_tp.py [--quick] [--ranks 1,2] [--json out.json]
    python benchmarks/run.py --only P-TP

P-STEP's shape (benchmarks/harness.py: ``step_sizes``, ``sparse_config``, ``seat``) on TP = 1, 2, ...
processes of this host (gloo over a file store; on CUDA every process uses the current GPU, so
two ranks share the one GPU of a one-GPU machine). Each rank builds its manager over one host
group, seats the rows, fills the in-flight token of every layer's cells with a pattern and
resolves once (the steady state); then:

- host bytes per node: the shared file's allocated bytes (one copy, whatever TP), against TP x
  one private manager's committed host bytes (what TP private pools pin today);
- flush per rank: the median of this rank's ``Batch.flush`` (its share of the layers, split
  "layer" and "pool_group"), timed alone (the other ranks wait at a barrier, so two ranks on
  one GPU do not time-slice each other), as graph replays of ``FLUSHES`` flushes (so the
  replay's launch does not count, as in P-FLUSH) on CUDA and wall-clock on CPU;
- flush + sync per step: every rank at once, ``flush(); sync()``, eager, wall-clock.

After the timing every rank checks, from the shared host pages, that the in-flight token of
every layer holds the pattern (written by whichever rank owns the layer). Targets: host bytes
per node = 1/TP of the private pools' sum; flush time per rank <= 1/TP of TP=1's + 10%.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.multiprocessing as mp

import torch_kvcm2 as kv
from harness import (MLA_ROW, PAGE, Result, Timer, bound_launches, pick_device, release, report,
                     seat, sparse_config, step_sizes)
from torch_kvcm2.tp import HostGroup

FLUSHES = 10  # flushes per timed graph replay (P-FLUSH's count)


def build(device, quick, host_group):
    """P-STEP's manager, batch and steady state; returns (manager, batch, H, layers)."""
    sz = step_sizes(quick)
    R, K, S, H, groups = sz["rows"], sz["K"], sz["S"], sz["history"], sz["groups"]
    config = sparse_config(device, rows=R, width=K, slots=S, unit=1, page=PAGE,
                           bytes_per_token=MLA_ROW, layers=sum(groups), inflight=16,
                           tokens_per_row=H + 64, groups=groups)
    manager = kv.KVCacheManager(config, host_group=host_group)
    batch = kv.Batch(manager)
    seat(manager, batch, R, H, capacity=H + 1)  # token H in flight
    gen = torch.Generator(device=device).manual_seed(7)
    for spec in config.selection_groups:  # resident the first K units; the in-flight one pinned
        sel = torch.rand((R, H), generator=gen, device=device).argsort(-1)[:, :K]
        batch.resolve(spec.index, sel.to(torch.int32).contiguous())
        batch.write_indices(spec.index)
    return manager, batch, H, [layer.name for layer in config.layers]


def pattern(layer_index: int, rows: int, device) -> torch.Tensor:
    return ((torch.arange(rows, device=device) * 5 + layer_index * 11 + 3) % 256).to(torch.uint8)


def write_patterns(batch, layers, device) -> None:
    """The in-flight token of every layer's cells: a per-(layer, row) byte pattern."""
    for li, layer in enumerate(layers):
        gi = batch.config.group_of(layer).index
        write = batch.groups[gi].write_table[:, 0].long()
        cells = batch.cells(layer, "kv")
        cells[:, 0][write // PAGE, write % PAGE] = \
            pattern(li, batch.max_rows, device)[:, None].expand(-1, cells.shape[-1])


def check_patterns(manager, batch, layers, H, device) -> None:
    host_slot = batch.page_tables[0][:, H // PAGE].long()
    for li, layer in enumerate(layers):
        pages = manager.slot_pages(layer, "kv")
        got = pages[:, 0][host_slot, H % PAGE]
        want = pattern(li, batch.max_rows, device)[:, None].expand_as(got)
        assert torch.equal(got, want), f"P-TP: layer {layer}: the flushed token is wrong"


def private_host_bytes(device, quick) -> int:
    """One rank's committed host-pool bytes without a host group (what each rank pins today)."""
    manager, batch, _, _ = build(device, quick, None)
    nbytes = manager.stats()["host_region"]["committed_bytes"]
    batch.close(discard=True)
    manager.close()
    return nbytes


def worker(rank, world, init, device, quick, repeats, out_dir):
    import torch.distributed as dist

    torch.set_num_threads(1 if quick else max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    result = {"rank": rank}
    try:
        timer = Timer(device, repeats)
        for split in ("layer", "pool_group"):
            manager, batch, H, layers = build(device, quick, HostGroup(timeout_s=120, split=split))
            write_patterns(batch, layers, device)
            group = manager.host_group
            own = sum(len(args[1]) for args in bound_launches(batch).flush)
            times = {}
            for r in range(world):  # each rank's flush timed alone
                group.barrier()
                if r == rank:
                    times = timer.graph(batch.flush, FLUSHES)
                if device == "cuda":
                    torch.cuda.synchronize()
            group.barrier()
            steps = []
            for _ in range(repeats):  # every rank at once, with the ordering point
                start = time.perf_counter()
                batch.flush()
                batch.sync()
                if device == "cuda":
                    torch.cuda.synchronize()
                steps.append((time.perf_counter() - start) * 1e6)
            check_patterns(manager, batch, layers, H, device)
            stats = manager.stats()["host_region"]
            result[split] = {"flush_us": times, "step_us": statistics.median(steps),
                             "buffers_flushed": own, "node_bytes": stats["node_bytes"],
                             "committed_bytes": stats["committed_bytes"]}
            group.barrier()
            batch.close(discard=True)
            manager.close()
            release(device)
        result["ok"] = True
    except BaseException as exc:  # noqa: BLE001 -- reported to the parent
        result = {"rank": rank, "ok": False, "error": f"{type(exc).__name__}: {exc}"}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    os._exit(0)


def run_world(world, device, quick, repeats, timeout=1200) -> list:
    out = tempfile.mkdtemp(prefix="bench_tp")
    ctx = mp.get_context("spawn")
    init = f"file://{out}/store"
    procs = [ctx.Process(target=worker, args=(r, world, init, device, quick, repeats, out))
             for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
    results = []
    for r in range(world):
        path = os.path.join(out, f"rank{r}.json")
        if not os.path.exists(path):
            raise RuntimeError(f"P-TP: rank {r} of {world} reported nothing (exit code "
                               f"{procs[r].exitcode})")
        with open(path) as f:
            res = json.load(f)
        if not res["ok"]:
            raise RuntimeError(f"P-TP: rank {r} of {world} failed: {res['error']}")
        results.append(res)
    return results


def bench_tp(device, quick, ranks=(1, 2), repeats=None) -> list:
    """P-TP rows: per TP, host bytes per node and the slowest rank's flush, for each split."""
    repeats = repeats or (3 if quick else 20)
    sz = step_sizes(quick)
    shape = f"{sz['rows']} rows x {sum(sz['groups'])} layers, h={sz['history']}"
    private = private_host_bytes(device, quick)
    release(device)
    out, base = [], None
    for world in ranks:
        res = run_world(world, device, quick, repeats)
        node = res[0]["layer"]["node_bytes"]
        for split in ("layer", "pool_group"):
            flush = max(r[split]["flush_us"] for r in res)
            step = max(r[split]["step_us"] for r in res)
            if world == 1 and split == "layer":
                base = flush
            bytes_ok = node <= private + (64 << 10)  # one copy (+ the header page)
            ratio = flush / base if base else 0.0
            passed = bytes_ok and (world == 1 or ratio <= 1.1 / world) if not quick else None
            note = (f"TP={world} split={split}: host bytes per node {node / 1e6:.1f} MB vs "
                    f"{world * private / 1e6:.1f} MB for {world} private pools "
                    f"({node / (world * private):.2f}x); flush per rank {flush:.1f} us "
                    f"({ratio:.2f}x TP=1, target <= {1.1 / world:.2f}x); flush + sync per "
                    f"step {step:.1f} us; buffers flushed by rank: "
                    f"{[r[split]['buffers_flushed'] for r in res]}")
            by = "layer" if split == "layer" else "pool"
            out.append(Result("P-TP", f"TP={world} by {by}: {shape}", flush,
                              target="1/TP bytes, <=1/TP+10%", passed=passed,
                              extra={"note": note, "node_bytes": node,
                                     "private_bytes": private, "step_us": step,
                                     "world": world, "split": split}))
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small CPU run that checks the data")
    parser.add_argument("--ranks", default="1,2", help="comma-separated TP sizes (default 1,2)")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--json", help="write the results to this file")
    args = parser.parse_args(argv)
    device, args.quick = pick_device(args.quick)
    results = bench_tp(device, args.quick, [int(x) for x in args.ranks.split(",")], args.repeats)
    report(results, args.json, target=False, note_indent="   ")
    return 0


if __name__ == "__main__":
    sys.exit(main())
