"""Where host-pool growth time goes (STO-7, P-START's growth rate): populate (first touch) and
registration (cudaHostRegister) of the same fresh anonymous memory timed apart, against the
piece size and the thread count, plus the one-call paths (one registration of a whole range, a
pinned torch allocation). Each case maps fresh memory, so no case is flattered by an earlier one.

    python benchmarks/host_growth.py [--gib 8] [--json out.json]

Prints GB/s per case. Registration needs a CUDA device (cases without one print populate only).
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import torch_kvcm2  # noqa: E402,F401  (loads the host_register op)
from torch_kvcm2 import host_region as hr  # noqa: E402

MiB, GiB = 1 << 20, 1 << 30
# the mappings are this script's own (the library's host region maps its memory the same way)
PROT_READ, PROT_WRITE = 1, 2
MAP_PRIVATE, MAP_ANONYMOUS, MAP_NORESERVE = 0x02, 0x20, 0x4000
MAP_FAILED = ctypes.c_void_p(-1).value
MADV_DONTNEED, MADV_HUGEPAGE = 4, 14
LIBC = ctypes.CDLL(None, use_errno=True)
LIBC.mmap.restype = ctypes.c_void_p
LIBC.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                      ctypes.c_long]
LIBC.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
LIBC.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def fresh(nbytes: int) -> int:
    """A fresh anonymous mapping, 2 MiB aligned (so huge pages can back all of it)."""
    flags = MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE
    address = LIBC.mmap(None, nbytes + 2 * MiB, PROT_READ | PROT_WRITE, flags, -1, 0)
    assert address not in (None, MAP_FAILED)
    return hr.round_up(address, 2 * MiB)


def timed(fn, pieces, threads) -> float:
    begin = time.perf_counter()
    results = hr.run_parallel(fn, pieces, threads)  # how the host region runs its pieces
    elapsed = time.perf_counter() - begin
    failed = [r for r in results if isinstance(r, BaseException)]
    assert not failed, failed[0]
    return elapsed


def case(nbytes, piece, threads, device, what, huge=False):
    """GB/s of populate and of register (of the populated memory), or of both in one pass;
    ``huge``: the range asks for transparent huge pages first (MADV_HUGEPAGE)."""
    ops = hr.HostMemoryOps()
    address = fresh(nbytes)
    if huge:
        assert LIBC.madvise(address, nbytes, MADV_HUGEPAGE) == 0
    out = {"what": what + (" (THP)" if huge else ""), "piece_mib": piece // MiB, "threads": threads}
    pieces = [(address + o, min(piece, nbytes - o)) for o in range(0, nbytes, piece)]
    try:
        if what == "populate+register":
            def both(p):
                ops.populate(*p)
                if device is not None:
                    ops.register(p[0], p[1], device)
            out["s"] = timed(both, pieces, threads)
        else:
            out["populate_s"] = timed(lambda p: ops.populate(*p), pieces, threads)
            if device is not None and what == "populate, then register":
                out["register_s"] = timed(lambda p: ops.register(p[0], p[1], device), pieces,
                                          threads)
            elif device is not None and what == "register only":  # registration faults pages in
                LIBC.madvise(address, nbytes, MADV_DONTNEED)
                out["register_s"] = timed(lambda p: ops.register(p[0], p[1], device), pieces,
                                          threads)
        # check: the memory is real and writable
        ctypes.memset(address + nbytes - 1, 7, 1)
        assert ctypes.c_uint8.from_address(address + nbytes - 1).value == 7
    finally:
        if device is not None and ("register_s" in out or what == "populate+register"):
            for a, n in pieces:
                ops.unregister(a, n, device)
        LIBC.munmap(address, nbytes)  # the unaligned head/tail (< 2 MiB) stays mapped
    for key, name in (("s", "all_gbs"), ("populate_s", "populate_gbs"), ("register_s", "register_gbs")):
        if key in out:
            out[name] = nbytes / out[key] / 1e9
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=8)
    parser.add_argument("--json")
    args = parser.parse_args()
    nbytes = int(args.gib * GiB) // hr.PAGE_SIZE * hr.PAGE_SIZE
    device = 0 if torch.cuda.is_available() and torch_kvcm2.has_cuda_kernels() else None
    if device is not None:
        torch.cuda.init()
    cores = hr.available_cores()
    rows = []
    for threads in sorted({1, 4, min(16, cores), cores}):
        for piece in (32 * MiB, 256 * MiB, 1024 * MiB):
            for what in ("populate, then register", "register only", "populate+register"):
                for huge in (False, True):
                    if device is None and what != "populate, then register":
                        continue
                    rows.append(case(nbytes, piece, threads, device, what, huge))
                    print(json.dumps(rows[-1]), flush=True)
    if device is not None:  # the one-call paths
        begin = time.perf_counter()
        t = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        t[-1] = 1
        rows.append({"what": "torch pinned empty (cudaHostAlloc)", "all_gbs":
                     nbytes / (time.perf_counter() - begin) / 1e9})
        del t
        print(json.dumps(rows[-1]), flush=True)
        begin = time.perf_counter()
        t = torch.zeros(nbytes, dtype=torch.uint8)
        middle = time.perf_counter()
        hr.HostMemoryOps().register(t.data_ptr(), nbytes, device)
        end = time.perf_counter()
        hr.HostMemoryOps().unregister(t.data_ptr(), nbytes, device)
        rows.append({"what": "torch zeros + one register", "populate_gbs": nbytes / (middle - begin) / 1e9,
                     "register_gbs": nbytes / (end - middle) / 1e9, "all_gbs": nbytes / (end - begin) / 1e9})
        print(json.dumps(rows[-1]), flush=True)
    print(f"| case | piece MiB | threads | populate GB/s | register GB/s | both GB/s |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        f = lambda k: f"{r[k]:.1f}" if k in r else "-"  # noqa: E731
        print(f"| {r['what']} | {r.get('piece_mib', '-')} | {r.get('threads', '-')} | "
              f"{f('populate_gbs')} | {f('register_gbs')} | {f('all_gbs')} |")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
