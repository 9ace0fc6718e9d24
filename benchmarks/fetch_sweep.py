"""Fetch tuning sweep (CUDA): the fetch kernel's development variants at the fetch shapes, and the
page fetch on differently backed host memory, each variant in its own process (the knobs are
read once per process), every result checked byte for byte and reported against the copy-engine
H2D ceiling measured in the same process. Needs a GPU and a development build of torch_kvcm2
(``TORCH_KVCM2_DEV=1 pip install -e . --no-build-isolation``): a production build reads no
knob, so every variant would measure the defaults.

    python benchmarks/fetch_sweep.py --rounds 2 --json out.json   # everything, <= ~5 min on an H200
    python benchmarks/fetch_sweep.py --list                      # the variants and shapes
    python benchmarks/fetch_sweep.py --variants 0,3 --no-host    # a subset
    python benchmarks/fetch_sweep.py --cpu-check                 # the harness on the CPU, small

Kernel variants (docs/DEVELOPMENT.md; Tuning in torch_kvcm2/csrc/cuda/launch.cuh):
KVCM2_FETCH_ILP, KVCM2_FETCH_BLOCKS_PER_SM, KVCM2_FETCH_TMA, KVCM2_FETCH_TMA_STAGE (the vector-item
sweep and the bulk copies), KVCM2_FETCH_WARP (0: the vector-item sweep; 1, the default: one warp per missed unit over contiguous chunks
of the miss list; 2: the same in host-address order), KVCM2_FETCH_WARP_MISSES, KVCM2_FETCH_LINES
(whole 128-byte line reads). Shapes: ``bench_fetch.bench_fetch`` (the fetch alone, P-FETCH-ROW /
P-FETCH-PAGE) and ``bench_fetch.fetch_hs_point`` (resolve + fetch from a full resident set, P-FETCH-HS at
20% misses, P-STEP's miss rate at 2%), both graph-replayed.

Host-memory variants (the defaults' kernel; the raw ``fetch`` op on host pools the benchmark
builds, filled with the manager's bytes): the manager's pool (a slice of its reserved host
region), a torch pinned tensor (cudaHostAlloc) at its start and 64 bytes in, a reserved host
region of the benchmark's own committed whole, sliced from its start and 64 B / 4 KiB / 2 MiB in,
and the same region advised MADV_HUGEPAGE before its commit (transparent huge pages).

A variant that fails (or fails a byte check) is reported as failed; the others still run. The
sweep stops starting processes when --budget seconds would be exceeded (those are reported as
skipped).
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
VARIANTS = [
    {},  # the defaults: one warp per missed unit, every CTA that fits, no bulk copies
    {"KVCM2_FETCH_WARP": "0", "KVCM2_FETCH_TMA": "2"},  # the vector-item sweep, TMA >= 32 KiB
    {"KVCM2_FETCH_WARP": "0"},  # the vector-item sweep, no bulk copies
    {"KVCM2_FETCH_BLOCKS_PER_SM": "1"},
    {"KVCM2_FETCH_BLOCKS_PER_SM": "1", "KVCM2_FETCH_WARP_MISSES": "1"},
    {"KVCM2_FETCH_WARP": "2", "KVCM2_FETCH_BLOCKS_PER_SM": "1"},  # host-address order
    {"KVCM2_FETCH_LINES": "1"},  # whole-line reads
]
# (label, kind, args): "fetch" = bench_fetch.bench_fetch(units, tokens per unit, bytes per token) on pages
# of 64 tokens; "step" = bench_fetch.fetch_hs_point(rows, K, S, miss rate)
SHAPES = [
    ("ROW 2048", "fetch", (2048, 1, 656)),     # P-FETCH-ROW
    ("ROW 8192", "fetch", (8192, 1, 656)),
    ("UNIT8 1024", "fetch", (1024, 8, 656)),   # 5-KB units
    ("PAGE 256", "fetch", (256, 64, 656)),     # P-FETCH-PAGE (42-KB pages)
    ("HS 64x20%", "step", (64, 2048, 4096, 0.2)),  # P-FETCH-HS: 26,240 misses, 17.2 MB
    ("STEP 64x2%", "step", (64, 2048, 4096, 0.02)),  # P-STEP's miss rate, one layer
]
HOST_SHAPES = [("PAGE 256", (256, 64, 656)), ("ROW 8192", (8192, 1, 656))]
HOST_BACKINGS = ["manager", "pinned", "pinned+64", "region+0", "region+64", "region+4K",
                 "region+2M", "thp-region+0"]
MADV_HUGEPAGE = 14  # Linux madvise advice: back the range with transparent huge pages
CHILD_TIMEOUT = 150


def variant_label(variant: dict) -> str:
    return " ".join(f"{k[12:]}={v}" for k, v in variant.items()) or "defaults"


def small(units: int, unit_tokens: int) -> int:
    """A fetch shape's units on the CPU check (fetch_setup's quick form seats 4 rows)."""
    return 64 if unit_tokens == 1 else 16


def kernel_child(device: str = "cuda") -> dict:
    """The kernel variant of this process's environment at every shape (``device="cpu"``: the
    CPU check of the harness at small sizes, no numbers claimed)."""
    sys.path.insert(0, HERE)
    import bench_fetch
    import harness

    quick = device == "cpu"
    timer = harness.Timer(device, 3 if quick else 20)
    ceil = harness.ceilings(timer, device, quick=quick)
    out = []
    for label, kind, args in SHAPES:
        if kind == "fetch":
            units, unit_tokens, row_bytes = args
            units = small(units, unit_tokens) if quick else units
            r = bench_fetch.bench_fetch(timer, device, quick, units=units, unit_tokens=unit_tokens,
                                        page=64, rid="sweep", target_pct=0, ceil=ceil, row_bytes=row_bytes)
            us, nbytes = r.median_us, r.nbytes
        else:
            rows, K, S, miss = (4, 256, 512, args[3]) if quick else args
            s = bench_fetch.fetch_hs_point(timer, device, rows, K, S, miss, seed=7)
            us, nbytes = s["us"], s["bytes"]
        out.append({"shape": label, "us": us, "bytes": nbytes})
        harness.release(device)
    return {"h2d": ceil["h2d"], "results": out}


def host_buffers(nbytes: int, device: str):
    """(label, cpu tensor, view ops see, base address) for each of HOST_BACKINGS but the
    manager's: ``nbytes`` of committed, device-mapped host memory each (on CPU: plain host
    memory, the tensor itself), yielded one at a time (each freed before the next is made)."""
    import torch

    from torch_kvcm2 import ops
    from torch_kvcm2.host_region import HostRegion

    cuda = device == "cuda"
    for label in HOST_BACKINGS[1:]:
        kind, _, off = label.partition("+")
        huge_kb = 0
        offset = {"": 0, "0": 0, "64": 64, "4K": 4096, "2M": 2 << 20}[off]
        if kind == "pinned":
            base = torch.empty(nbytes + offset, dtype=torch.uint8, pin_memory=cuda)
            view = ops.uva_view(base) if cuda else base
            region = None
        else:
            region = HostRegion(nbytes + offset, device=torch.cuda.current_device() if cuda else None)
            if kind == "thp-region":  # huge pages where the kernel has them (THP "madvise" mode)
                libc = ctypes.CDLL(None, use_errno=True)
                libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
                if libc.madvise(region.address, region.nbytes, MADV_HUGEPAGE) != 0:
                    print(f"madvise(MADV_HUGEPAGE) failed: errno {ctypes.get_errno()}", file=sys.stderr)
            assert region.commit([(0, region.nbytes)]), region.last_error
            huge_kb = anon_huge_kb(region.address, region.nbytes)
            base = region.tensor
            view = ops.uva_view(base, register=False) if cuda else base
        cpu = base[offset:offset + nbytes]
        yield label, cpu, view[offset:offset + nbytes], cpu.data_ptr(), huge_kb
        del cpu, view, base
        if region is not None:
            region.close()


def anon_huge_kb(address: int, nbytes: int) -> int:
    """Anonymous huge-page KiB of this process's mappings overlapping ``[address, address +
    nbytes)`` (0 where /proc does not say)."""
    total, inside = 0, False
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                head = line.split(maxsplit=1)[0]
                if "-" in head and not head.endswith(":"):  # a mapping's first line: start-end
                    lo, hi = (int(x, 16) for x in head.split("-"))
                    inside = lo < address + nbytes and address < hi
                elif inside and head == "AnonHugePages:":
                    total += int(line.split()[1])
    except (OSError, ValueError):
        return 0
    return total


def check_fetched(cells, host, misses, tables, S, U, page):
    """Every fetched unit's bytes in ``cells`` (CPU copy) equal its host page's in ``host`` (CPU,
    [slots, scale, page_bytes] view of one buffer at position 0)."""
    import torch

    E = page // U
    entry = misses[:, 0] * S + misses[:, 1]
    slot = tables[misses[:, 2], misses[:, 3] // E]
    src = host[:, 0].reshape(host.shape[0], E, -1)[slot, misses[:, 3] % E]
    dst = cells.reshape(cells.shape[0], E, -1)[entry // E, entry % E]
    assert torch.equal(src, dst), "fetch copied wrong bytes"


def host_child(device: str = "cuda") -> dict:
    """The default kernel's fetch at HOST_SHAPES on each of HOST_BACKINGS (``device="cpu"``:
    the CPU check of the harness at small sizes, the CPU op on plain host memory)."""
    sys.path.insert(0, HERE)
    import torch

    import bench_fetch
    import harness
    from torch_kvcm2 import ops

    quick = device == "cpu"
    timer = harness.Timer(device, 3 if quick else 20)
    ceil = harness.ceilings(timer, device, quick=quick)
    out = []
    for label, (units, unit_tokens, row_bytes) in HOST_SHAPES:
        units = small(units, unit_tokens) if quick else units
        manager, batch, state, _ = bench_fetch.fetch_setup(device, quick, units=units,
                                                           unit_tokens=unit_tokens, page=64,
                                                           row_bytes=row_bytes)
        info = manager.buffer("l0", "kv")  # the fetch op's arguments for layer l0, as bound
        assert (info.pool_group, info.pos, info.chunks) == (0, 0, 1), \
            "one buffer of one chunk at position 0 of pool group 0 expected"
        cells, positions = [batch.cells("l0", "kv")], [info.pos]
        table = batch.page_table("l0", "kv")
        tables = [table]
        pool = manager.pool(0)  # the committed slots, as ops see them
        slots = int(table.max()) + 1
        assert slots <= pool.shape[0], "the page table names an uncommitted slot"
        shape = (slots,) + tuple(pool.shape[1:])
        nbytes = slots * pool.shape[1] * pool.shape[2]
        S, U = state.spec.sparse.slots, unit_tokens
        misses = state.miss_list[: int(state.miss_count[0])].cpu().long()
        table_cpu = table.cpu().long()
        calls = 10

        def measure(name, host_cpu, host_dev, address, huge_kb=0):
            dev_pool = host_dev.view(shape)

            def body():
                ops.fetch(cells, [dev_pool], positions, tables, state.miss_list, state.miss_count,
                          S, U)

            us = timer.graph(body, calls)
            cells[0].zero_()
            body()
            if device == "cuda":
                torch.cuda.synchronize()
            check_fetched(cells[0].cpu(), host_cpu.view(shape), misses, table_cpu, S, U, 64)
            out.append({"shape": label, "backing": name, "us": us, "bytes": len(misses) * U * row_bytes,
                        "address_mod_2M": address % (2 << 20), "huge_page_kb": huge_kb})

        manager_cpu = manager.pool(0, device_side=False).view(-1)[:nbytes]
        measure("manager", manager_cpu, pool.view(-1)[:nbytes], manager_cpu.data_ptr(),
                anon_huge_kb(manager_cpu.data_ptr(), nbytes))
        for name, host_cpu, host_dev, address, huge_kb in host_buffers(nbytes, device):
            host_cpu.copy_(manager_cpu)
            measure(name, host_cpu, host_dev, address, huge_kb)
            del host_cpu, host_dev
            harness.release(device)
        del manager, batch, state, cells, tables, table, manager_cpu, pool
        harness.release(device)
    return {"h2d": ceil["h2d"], "results": out}


def unusable() -> str | None:
    """Why this machine cannot run the sweep, or None."""
    import torch

    if not torch.cuda.is_available():
        return "no GPU visible"
    import torch_kvcm2

    if not torch_kvcm2.has_cuda_kernels():
        return "torch_kvcm2 was built without CUDA kernels"
    # The knobs' names are in the library only when the development switch built their readers.
    with open(torch_kvcm2._C.__file__, "rb") as f:
        if b"KVCM2_FETCH_WARP" not in f.read():
            return "torch_kvcm2 is a production build (it reads no knob), or predates KVCM2_FETCH_WARP"
    return None


def cell(r: dict, h2d: float) -> str:
    gbs = r["bytes"] / r["us"] / 1e3
    return f"{r['us']:.1f} / {gbs:.1f} / {100 * gbs / h2d:.0f}%"


def print_tables(kernel_rows: list, host_rows: list, failed: list, skipped: list) -> None:
    print("# fetch sweep: each cell is us / GB/s / % of the CE H2D ceiling of the same process; "
          "one row per process (rounds interleaved); HS and STEP are resolve + fetch")
    labels = [s[0] for s in SHAPES]
    print("| variant | CE H2D GB/s | " + " | ".join(labels) + " |")
    print("|---|---|" + "---|" * len(labels))
    for row in sorted(kernel_rows, key=lambda r: r["index"]):
        by = {r["shape"]: r for r in row["results"]}
        cells = [cell(by[s], row["h2d"]) if s in by else "-" for s in labels]
        print(f"| {row['index']}: {row['variant']} | {row['h2d']:.1f} | " + " | ".join(cells) + " |")
    if host_rows:
        print("\n# page fetch by host memory backing (the defaults' kernel, raw fetch op): "
              "us / GB/s / % CE; [address mod 2 MiB, huge-page KiB the commit got]")
        print("| backing | " + " | ".join(f"{s} (round {i + 1})" for i in range(len(host_rows))
                                          for s, _ in HOST_SHAPES) + " |")
        print("|---|" + "---|" * (len(host_rows) * len(HOST_SHAPES)))
        for name in HOST_BACKINGS:
            cells = []
            for row in host_rows:
                for s, _ in HOST_SHAPES:
                    r = next((x for x in row["results"] if x["shape"] == s and x["backing"] == name), None)
                    cells.append("-" if r is None else f"{cell(r, row['h2d'])} [{r['address_mod_2M']}, {r['huge_page_kb']}]")
            print(f"| {name} | " + " | ".join(cells) + " |")
    for label in failed:
        print(f"# failed: {label}")
    for label in skipped:
        print(f"# skipped (budget): {label}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="write the sweep to this file")
    parser.add_argument("--variants", help="comma-separated indices into the variants (default: all)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run the variants this many times, interleaved (a noisy machine)")
    parser.add_argument("--no-host", action="store_true", help="skip the host-memory variants")
    parser.add_argument("--budget", type=float, default=290,
                        help="seconds: start no process that could end past this (default 290)")
    parser.add_argument("--list", action="store_true", help="print the variants and shapes, run nothing")
    parser.add_argument("--cpu-check", action="store_true",
                        help="run the harness (setups, byte checks, host backings, tables) on the CPU "
                             "at small sizes, in this process; no numbers claimed")
    parser.add_argument("--child", choices=["kernel", "host"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(kernel_child() if args.child == "kernel" else host_child()))
        return 0
    try:
        picks = [int(i) for i in args.variants.split(",")] if args.variants else None
    except ValueError:
        parser.error(f"--variants: comma-separated integers expected, got {args.variants!r}")
    if picks is not None and not all(0 <= i < len(VARIANTS) for i in picks):
        parser.error(f"--variants: indices must lie in [0, {len(VARIANTS)}), got {args.variants!r}")
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")
    if args.budget <= 0:
        parser.error(f"--budget must be positive, got {args.budget}")
    if args.list:
        for i, v in enumerate(VARIANTS):
            print(f"variant {i}: {variant_label(v)}")
        for label, kind, a in SHAPES:
            print(f"shape {label}: {kind} {a}")
        print("host backings: " + ", ".join(HOST_BACKINGS) + " at " + ", ".join(s for s, _ in HOST_SHAPES))
        return 0
    if args.cpu_check:
        kernel = {"index": 0, "variant": "cpu check", "env": {}, **kernel_child("cpu")}
        host = host_child("cpu")
        print_tables([kernel], [host], [], [])
        return 0
    reason = unusable()
    if reason is not None:
        print(f"fetch_sweep.py needs a GPU and a development build of torch_kvcm2 "
              f"(TORCH_KVCM2_DEV=1 pip install -e . --no-build-isolation): {reason}", file=sys.stderr)
        return 2
    indices = picks if picks is not None else list(range(len(VARIANTS)))
    jobs = []  # (kind, index, variant) per process, rounds interleaved
    for _ in range(args.rounds):
        jobs += [("kernel", i, VARIANTS[i]) for i in indices]
        if not args.no_host:
            jobs.append(("host", -1, {}))
    start = time.monotonic()
    longest = 30.0  # the longest process so far (a guess before the first)
    kernel_rows, host_rows, failed, skipped = [], [], [], []
    for kind, index, variant in jobs:
        label = variant_label(variant) if kind == "kernel" else "host memory backings"
        if time.monotonic() - start + longest > args.budget:
            skipped.append(label)
            continue
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVCM2_FETCH_")} | variant
        began = time.monotonic()
        try:
            done = subprocess.run([sys.executable, __file__, "--child", kind], env=env,
                                  capture_output=True, text=True, timeout=CHILD_TIMEOUT)
        except subprocess.TimeoutExpired:
            failed.append(f"{label}: timed out after {CHILD_TIMEOUT} s")
            continue
        finally:
            longest = max(longest, time.monotonic() - began)
        if done.returncode != 0:
            failed.append(f"{label}: exit {done.returncode}: {done.stderr.strip()[-1500:]}")
            continue
        result = json.loads(done.stdout.strip().splitlines()[-1])
        if kind == "kernel":
            kernel_rows.append({"index": index, "variant": label, "env": variant, **result})
        else:
            host_rows.append(result)
        print(f"# done: {label} ({time.monotonic() - began:.0f} s)", file=sys.stderr, flush=True)
    print_tables(kernel_rows, host_rows, failed, skipped)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"kernel": kernel_rows, "host": host_rows, "failed": failed,
                       "skipped": skipped, "seconds": time.monotonic() - start}, f, indent=1)
    return 0 if kernel_rows or host_rows else 1


if __name__ == "__main__":
    sys.exit(main())
