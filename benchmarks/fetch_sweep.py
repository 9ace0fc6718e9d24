"""Fetch tuning sweep (CUDA): P-FETCH-ROW and P-FETCH-PAGE at several sizes, for each setting of
the fetch kernel's development knobs, each in its own process (the knobs are read once per
process), every result checked byte for byte by ``run.bench_fetch`` and reported against the
copy-engine ceiling measured in the same process. Needs a GPU and a development build of
torch_kvcm2 (``TORCH_KVCM2_DEV=1 pip install -e . --no-build-isolation``): a production build
reads no knob, so every variant would measure the defaults.

    python benchmarks/fetch_sweep.py [--json out.json] [--variants 0,6] [--rounds 2]

Knobs (docs/DEVELOPMENT.md; Tuning in torch_kvcm2/csrc/cuda/launch.cuh): KVCM2_FETCH_ILP (loads
in flight per thread: 1, 2, 4, 8), KVCM2_FETCH_BLOCKS_PER_SM (grid size; default: every CTA that
fits) and KVCM2_FETCH_TMA (0: vector loads for every piece; 1: bulk copies through shared memory
for every 16-byte aligned launch; default: bulk copies for pieces of >= 32 KiB),
KVCM2_FETCH_TMA_STAGE (bytes per bulk-copy stage, default 8192).
A variant that fails (or fails its byte check) is reported as failed; the others still run.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
VARIANTS = [
    {},  # the defaults (ILP 2, every CTA that fits, bulk copies for pieces of >= 32 KiB)
    {"KVCM2_FETCH_ILP": "1"},
    {"KVCM2_FETCH_ILP": "4"},
    {"KVCM2_FETCH_ILP": "8"},
    {"KVCM2_FETCH_BLOCKS_PER_SM": "4"},
    {"KVCM2_FETCH_BLOCKS_PER_SM": "2"},
    {"KVCM2_FETCH_TMA": "0"},  # vector loads for every piece
    {"KVCM2_FETCH_TMA": "1"},  # bulk copies for every 16-byte aligned launch
]
# (id, missed units, tokens per unit, bytes per token) on pages of 64 tokens: rows of 656 B (the
# FP8 MLA row: 16-byte aligned, so 7 rows in 8 start inside a 128-byte line and touch 6 or 7
# lines), of 640 B (5 whole lines) and of 768 B (6 whole lines), units of 5 KB (8 rows of 656 B)
# and 21 KB (32), whole pages of 42 KB
SHAPES = [("ROW", 2048, 1, 656), ("ROW", 8192, 1, 656), ("ROW640", 8192, 1, 640),
          ("ROW768", 8192, 1, 768), ("UNIT8", 1024, 8, 656), ("UNIT32", 256, 32, 656),
          ("PAGE", 256, 64, 656), ("PAGE", 1024, 64, 656)]


def child() -> None:
    sys.path.insert(0, HERE)
    import run

    timer = run.Timer("cuda", 20)
    ceil = run.ceilings(timer, "cuda", quick=False)
    out = []
    for name, units, unit_tokens, row_bytes in SHAPES:
        r = run.bench_fetch(timer, "cuda", False, units=units, unit_tokens=unit_tokens, page=64,
                            rid=f"P-FETCH-{name}", target_pct=0, ceil=ceil, row_bytes=row_bytes)
        out.append({"shape": f"{name} {units}", "us": r.median_us, "gbs": r.gbs, "pct": r.pct})
        run.release("cuda")
    print(json.dumps({"h2d": ceil["h2d"], "results": out}))


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
        if b"KVCM2_FETCH_ILP" not in f.read():
            return "torch_kvcm2 is a production build (it reads no knob)"
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="write the sweep to this file")
    parser.add_argument("--variants", help="comma-separated indices into VARIANTS (default: all)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run the variants this many times, interleaved (a noisy machine)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child()
        return 0
    try:
        picks = [int(i) for i in args.variants.split(",")] if args.variants else None
    except ValueError:
        parser.error(f"--variants: comma-separated integers expected, got {args.variants!r}")
    if picks is not None and not all(0 <= i < len(VARIANTS) for i in picks):
        parser.error(f"--variants: indices must lie in [0, {len(VARIANTS)}), got {args.variants!r}")
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")
    reason = unusable()
    if reason is not None:
        print(f"fetch_sweep.py needs a GPU and a development build of torch_kvcm2 "
              f"(TORCH_KVCM2_DEV=1 pip install -e . --no-build-isolation): {reason}", file=sys.stderr)
        return 2
    chosen = [VARIANTS[i] for i in picks] if picks is not None else VARIANTS
    rows, failed = [], []
    for variant in chosen * args.rounds:
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVCM2_FETCH_")} | variant
        label = " ".join(f"{k[12:]}={v}" for k, v in variant.items()) or "defaults"
        try:
            done = subprocess.run([sys.executable, __file__, "--child"], env=env,
                                  capture_output=True, text=True, timeout=180)
        except subprocess.TimeoutExpired:
            failed.append(label)
            print(f"{label}: timed out", file=sys.stderr)
            continue
        if done.returncode != 0:
            failed.append(label)
            print(f"{label}: failed\n{done.stderr[-2000:]}", file=sys.stderr)
            continue
        rows.append({"variant": label, **json.loads(done.stdout.strip().splitlines()[-1])})
    if not rows:
        return 1
    shapes = [r["shape"] for r in rows[0]["results"]]
    print("| variant | CE H2D GB/s | " + " | ".join(f"{s} (us, % CE)" for s in shapes) + " |")
    print("|---|---|" + "---|" * len(shapes))
    for row in rows:
        cells = [f"{r['us']:.1f}, {r['pct']:.1f}%" for r in row["results"]]
        print(f"| {row['variant']} | {row['h2d']:.1f} | " + " | ".join(cells) + " |")
    for label in failed:
        print(f"| {label} | failed | " + " | ".join("-" for _ in shapes) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
