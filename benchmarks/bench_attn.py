"""P-ATTN: the sparse MLA decode kernel reading the cells through resolve's index table, against
the same kernel over a dense GPU cache, and its TFLOP/s against the GPU's bf16 GEMM rate.

    python benchmarks/bench_attn.py                    # rows 1..128, 128 heads, K 2048 (GPU)
    python benchmarks/bench_attn.py --sweep            # also every candidate config at 1..128 rows
    python benchmarks/bench_attn.py --fp8              # also the 656-byte FP8 rows over the cells
    python benchmarks/bench_attn.py --quick            # 1, 4 and 16 rows, fewer repeats
    python benchmarks/bench_attn.py --json out.json    # the table (and sweep) as JSON

DeepSeek-V3.2's attention: 128 query heads, latent 512 + rope 64 (bf16 rows of 1152 bytes),
top-k 2048, page 64. A pool of 128 requests (16 with ``--quick``) is seated in a
``torch_kvcm2.Batch`` of one sparse layer (S = 4096 slots a row, 5,120 tokens of history in
host pages); eight resolve + fetch steps, each replacing 30% of every row's 2048 selected
tokens (``--table resolve``, the default), leave each row's index table as resolve returns
it: entries scattered over the row's 4096 cells, in selection order. The cells
(``uint8[rows*S/64, 1, 64, 1152]``) are then filled with random bf16 and read as
``rows = cells.view(bf16).view(-1, 576)``, the index table passed as it is.
``--table synthetic`` skips the library: entries ``r*S + randperm(S)[:K]``.
The dense baseline holds the same selected rows in a contiguous GPU cache, request r's 2048 in
rows ``r*2048 ..`` (indices contiguous per request), in the same order: the kernel does the
same arithmetic on the same values, so the two outputs must be bit-identical.

For B rows, the pool is cut into 128/B sets of B requests (inputs rotate: a B = 1 replay
touches 128 requests' rows, 302 MB, more than L2), one kernel call per set captured in one CUDA
graph; the median over replays (CUDA events) per call is the time. Every set's output is
checked against the fp32 reference (``tolerance(bf16)``) before timing, and again after the
timed replays (outputs zeroed, one more replay). FLOPs = 2·B·H·K·(576 + 512); the GEMM rate is
an 8192³ bf16 ``torch.matmul`` in the same run. Target: cells / dense ≤ 1.05× at every row
count; the exit status is 1 when a row misses it, 2 when nothing could be measured.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch_kvcm2 as kv  # noqa: E402
from harness import Timer, sparse_config, seat, write_json  # noqa: E402
from torch_kvcm2.models import sparse_mla as mla  # noqa: E402

HEADS, K, ROW, LATENT = 128, 2048, mla.ROW, mla.LATENT
SLOTS = 2 * K  # cells a row: the hot buffer at twice top-k (the engines' default)
HISTORY = SLOTS + 1024  # tokens of history a request has in host pages
PAGE = 64
SCALE = 192 ** -0.5  # DeepSeek-V3.2's (qk_nope 128 + rope 64) ** -0.5
TARGET = 1.05


def flops(batch: int) -> float:
    return 2.0 * batch * HEADS * K * (ROW + LATENT)


def gemm_tflops(n: int, repeats: int) -> float:
    """The GPU's bf16 GEMM rate: median of ``repeats`` timed ``n x n x n`` matmuls."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    c = torch.empty(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        torch.matmul(a, b, out=c)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(repeats):
        start.record()
        torch.matmul(a, b, out=c)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3)
    return 2.0 * n ** 3 / statistics.median(times) / 1e12


# ---------------------------------------------------------------------------------------------
# the pool: cells + index tables (resolve's or synthetic), queries, the dense copy, references
# ---------------------------------------------------------------------------------------------

def resolve_pool(pool: int, steps: int = 8, turnover: float = 0.3, seed: int = 0):
    """Cells and index tables as the library leaves them: a batch of ``pool`` requests with one
    sparse layer of 1152-byte tokens (chunks 1, U = 1), ``steps`` resolve + fetch steps with
    ``turnover`` of each row's selection replaced by unselected tokens each step. Returns
    ``(cells, table, batch, hit_rate)``; ``batch`` owns the cells (keep it alive)."""
    config = sparse_config("cuda", rows=pool, width=K, slots=SLOTS, unit=1, page=PAGE,
                           bytes_per_token=ROW * 2, tokens_per_row=HISTORY + PAGE,
                           host_bytes=pool * (HISTORY + 2 * PAGE) * ROW * 2 + (16 << 20))
    manager = kv.KVCacheManager(config)
    batch = kv.Batch(manager)
    seat(manager, batch, pool, HISTORY)
    gen = torch.Generator().manual_seed(seed)
    selected = torch.rand(pool, HISTORY, generator=gen).argsort(dim=1)[:, :K]  # random order
    fresh = int(K * turnover)
    for _ in range(steps):
        table = batch.resolve(0, selected.to(torch.int32).cuda(), fetch=True)
        score = torch.rand(pool, HISTORY, generator=gen)
        score.scatter_(1, selected, -1.0)  # only tokens not selected now come in
        incoming = score.topk(fresh, dim=1).indices
        slots = torch.rand(pool, K, generator=gen).argsort(dim=1)[:, :fresh]
        selected = selected.scatter(1, slots, incoming)
    table = batch.resolve(0, selected.to(torch.int32).cuda(), fetch=True).clone()
    torch.cuda.synchronize()
    counts = batch.hit_rate(0)
    cells = batch.cells("l0", "kv")
    assert cells.shape[1] == 1 and cells.shape[3] == ROW * 2 and cells.is_contiguous(), \
        f"cells {tuple(cells.shape)} are not one contiguous run of 1152-byte rows"
    return cells, table, batch, counts["hit_rate"]


def synthetic_pool(pool: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    cells = torch.empty(pool * SLOTS // PAGE, 1, PAGE, ROW * 2, dtype=torch.uint8, device="cuda")
    table = torch.stack([r * SLOTS + torch.randperm(SLOTS, generator=gen)[:K]
                         for r in range(pool)]).to(torch.int32).cuda()
    return cells, table, None, None


def build(pool: int, kind: str, fp8: bool):
    """The workload of ``pool`` requests. Returns a dict: ``rows`` (the cells' bf16 rows),
    ``table``, ``q``, ``dense`` / ``dense_table`` (the same rows, contiguous per request),
    ``ref`` (fp32 reference per request), ``scatter`` (fraction of a table's neighbours that
    are consecutive rows), ``hit_rate``, and with ``fp8`` the FP8 rows and their reference."""
    cells, table, owner, hit_rate = resolve_pool(pool) if kind == "resolve" else \
        synthetic_pool(pool)
    assert bool((table >= 0).all()), "a selected token has no cell entry"
    rows = cells.view(torch.bfloat16).view(-1, ROW)  # entry i's token is rows[i]
    gen = torch.Generator(device="cuda").manual_seed(1)
    rows.normal_(generator=gen)
    q = torch.randn(pool, HEADS, ROW, device="cuda", dtype=torch.bfloat16, generator=gen)
    dense = rows[table.long().flatten()].contiguous()
    dense_table = torch.arange(pool * K, device="cuda", dtype=torch.int32).view(pool, K)
    work = {"rows": rows, "table": table, "q": q, "dense": dense, "dense_table": dense_table,
            "owner": owner, "hit_rate": hit_rate,
            "scatter": float(((table[:, 1:] - table[:, :-1]) == 1).float().mean())}
    work["ref"] = reference(q, lambda r: dense[r * K:(r + 1) * K])
    if fp8:
        work["rows_fp8"] = mla.quantize_fp8_rows(rows)
        work["ref_fp8"] = reference(q, lambda r: mla.dequantize_fp8_rows(
            work["rows_fp8"][table[r].long()]))
    return work


def reference(q, selected_rows) -> torch.Tensor:
    """fp32 reference per request: ``selected_rows(r)`` its K rows in table order."""
    arange = torch.arange(K, device="cuda", dtype=torch.int32)[None]
    return torch.cat([mla.sparse_mla_decode_reference(q[r:r + 1].float(),
                                                      selected_rows(r).float(), arange, SCALE)
                      for r in range(q.shape[0])])


# ---------------------------------------------------------------------------------------------
# timing
# ---------------------------------------------------------------------------------------------

def check(out: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    atol, rtol = mla.tolerance(torch.bfloat16)
    err = (out.float() - ref).abs()
    bad = err > atol + rtol * ref.abs()
    if bool(bad.any()):
        raise AssertionError(f"{what}: {int(bad.sum())} outputs outside the tolerance "
                             f"(largest error {float(err.max()):.3g})")


def time_rows(work: dict, batch: int, rows_key: str, table_key: str, ref_key: str,
              config: dict, repeats: int, what: str) -> float:
    """Median µs of one call over ``batch`` requests, the pool's sets rotating in one graph;
    outputs checked before the timed replays and after them."""
    pool = work["q"].shape[0]
    sets = pool // batch
    rows, table, q, ref = work[rows_key], work[table_key], work["q"], work[ref_key]
    out = torch.zeros(sets * batch, HEADS, LATENT, device="cuda", dtype=torch.bfloat16)
    args = [(q[j * batch:(j + 1) * batch], table[j * batch:(j + 1) * batch],
             out[j * batch:(j + 1) * batch]) for j in range(sets)]

    def call(j):
        qj, tj, oj = args[j]
        mla.sparse_mla_decode_triton(qj, rows, tj, SCALE, out=oj, config=config)

    for j in range(sets):
        call(j)
    torch.cuda.synchronize()
    check(out, ref[:sets * batch], f"{what}, {batch} rows, before timing")
    step = [0]

    def body():
        call(step[0] % sets)
        step[0] += 1

    us, replay = Timer("cuda", repeats).graph(body, sets, keep=True)
    out.zero_()
    replay()
    check(out, ref[:sets * batch], f"{what}, {batch} rows, the timed graph's outputs")
    work["last_out"] = out
    return us


def config_for(batch: int, name: str | None, splits: int | None = None) -> dict:
    cfg = mla.default_config(batch, HEADS, K, torch.device("cuda"))
    if name is not None:
        cfg.update(mla.CANDIDATE_CONFIGS[name])
        cfg["splits"] = mla._default_splits(batch, HEADS, K, cfg, torch.device("cuda"))
    if splits is not None:
        cfg["splits"] = splits
    return cfg


def config_label(cfg: dict) -> str:
    stages = "pf" if cfg.get("prefetch") else f"s{cfg['num_stages']}"
    return (f"h{cfg['block_h']}-n{cfg['block_n']}-dv{cfg['dv_split']}-w{cfg['num_warps']}"
            f"-{stages} x{cfg['splits']}")


def bench(work: dict, rows_list, config_name, repeats, gemm, fp8) -> list:
    results = []
    for batch in rows_list:
        cfg = config_for(batch, config_name)
        cells_us = time_rows(work, batch, "rows", "table", "ref", cfg, repeats, "cells")
        cells_out = work["last_out"]
        dense_us = time_rows(work, batch, "dense", "dense_table", "ref", cfg, repeats, "dense")
        identical = torch.equal(cells_out, work["last_out"])
        assert identical, f"{batch} rows: cells and dense outputs differ (same rows, same order)"
        row = {"rows": batch, "config": config_label(cfg), "cells_us": cells_us,
               "dense_us": dense_us, "ratio": cells_us / dense_us,
               "tflops": flops(batch) / cells_us / 1e6,
               "dense_tflops": flops(batch) / dense_us / 1e6}
        row["pct_gemm"] = 100 * row["tflops"] / gemm
        row["passed"] = row["ratio"] <= TARGET
        if fp8:
            fp8_us = time_rows(work, batch, "rows_fp8", "table", "ref_fp8", cfg, repeats,
                               "FP8 cells")
            row["fp8_us"] = fp8_us
            row["fp8_tflops"] = flops(batch) / fp8_us / 1e6
        results.append(row)
        print_row(row, fp8)
    return results


def sweep(work: dict, rows_list, repeats) -> list:
    """Every candidate configuration at its default split count, and at half and twice it
    where those differ (twice: up to one tile a split)."""
    points = []
    for batch in rows_list:
        variants = []
        for name in mla.CANDIDATE_CONFIGS:
            cfg = config_for(batch, name)
            tiles = -(-K // cfg["block_n"])
            counts = {cfg["splits"], max(1, cfg["splits"] // 2), min(tiles, 2 * cfg["splits"])}
            variants += [config_for(batch, name, n) for n in sorted(counts)]
        best = None
        for cfg in variants:
            try:
                us = time_rows(work, batch, "rows", "table", "ref", cfg, repeats, "sweep")
            except Exception as exc:  # a config that does not build here: say so, go on
                print(f"| {batch:4} | {config_label(cfg):28} | failed: {type(exc).__name__}: "
                      f"{str(exc)[:80]}")
                continue
            point = {"rows": batch, "config": config_label(cfg), "us": us,
                     "tflops": flops(batch) / us / 1e6}
            points.append(point)
            best = point if best is None or us < best["us"] else best
            print(f"| {batch:4} | {point['config']:28} | {us:9.2f} | {point['tflops']:7.1f} |")
        if best:
            best["best"] = True
            print(f"# best at {batch} rows: {best['config']} ({best['us']:.2f} us)")
    return points


def print_header(fp8: bool) -> None:
    extra = f" {'FP8 us':>8} | {'FP8 TF/s':>8} |" if fp8 else ""
    print(f"| {'rows':>4} | {'config':28} | {'cells us':>9} | {'dense us':>9} | "
          f"{'cells/dense':>11} | {'TFLOP/s':>7} | {'% GEMM':>6} | {'dense TF/s':>10} |{extra}"
          f" pass |")
    print("|" + "|".join("-" * w for w in (6, 30, 11, 11, 13, 9, 8, 12)) + "|"
          + ("----------|----------|" if fp8 else "") + "------|")


def print_row(row: dict, fp8: bool) -> None:
    extra = f" {row['fp8_us']:8.2f} | {row['fp8_tflops']:8.1f} |" if fp8 else ""
    print(f"| {row['rows']:4} | {row['config']:28} | {row['cells_us']:9.2f} | "
          f"{row['dense_us']:9.2f} | {row['ratio']:10.3f}x | {row['tflops']:7.1f} | "
          f"{row['pct_gemm']:6.1f} | {row['dense_tflops']:10.1f} |{extra} "
          f"{'yes' if row['passed'] else 'NO':4} |", flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="1, 4, 16 rows; fewer repeats")
    parser.add_argument("--rows", help="comma-separated row counts (default 1,2,...,128)")
    parser.add_argument("--table", choices=("resolve", "synthetic"), default="resolve",
                        help="index tables from the library's resolve (default) or random")
    parser.add_argument("--config", choices=sorted(mla.CANDIDATE_CONFIGS),
                        help="time this candidate instead of the default configuration")
    parser.add_argument("--sweep", action="store_true",
                        help="also time every candidate configuration (1, 4, 16, 64, 128 rows)")
    parser.add_argument("--fp8", action="store_true", help="also the FP8 656-byte rows")
    parser.add_argument("--repeats", type=int, help="graph replays per time (default 20)")
    parser.add_argument("--json", help="write the table (and the sweep) as JSON here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_attn.py: P-ATTN times a Triton kernel on a CUDA GPU and none is visible "
              "here; nothing was measured.", file=sys.stderr)
        return 2
    if not mla.triton_available():
        print("bench_attn.py: triton does not import; the sparse MLA kernel needs it.",
              file=sys.stderr)
        return 2
    if args.table == "resolve" and not kv.has_cuda_kernels():
        print("bench_attn.py: torch_kvcm2 was built without its CUDA kernels, so resolve "
              "cannot run here; build them or pass --table synthetic.", file=sys.stderr)
        return 2
    rows_list = ([int(r) for r in args.rows.split(",")] if args.rows else
                 [1, 4, 16] if args.quick else [1, 2, 4, 8, 16, 32, 64, 128])
    pool = max(16 if args.quick else 128, max(rows_list))
    if any(pool % r for r in rows_list):
        parser.error(f"every row count must divide the pool of {pool} requests")
    repeats = args.repeats or (5 if args.quick else 20)

    gemm = gemm_tflops(4096 if args.quick else 8192, repeats)
    work = build(pool, args.table, args.fp8)
    print(f"# P-ATTN on {torch.cuda.get_device_name()}: sparse MLA decode, {HEADS} heads, "
          f"K {K}, 576-wide bf16 rows; torch {torch.__version__}, triton "
          f"{mla.triton.__version__}")
    table_note = (f"resolve's tables after 8 steps of 30% turnover (hit rate "
                  f"{work['hit_rate']:.2f})" if args.table == "resolve" else "synthetic tables")
    print(f"# bf16 GEMM {gemm:.0f} TFLOP/s (torch.matmul, same run); pool {pool} requests, "
          f"{table_note}; {100 * work['scatter']:.1f}% of neighbouring entries are consecutive "
          f"rows (dense: 100%); target cells/dense <= {TARGET}x")
    print_header(args.fp8)
    results = bench(work, rows_list, args.config, repeats, gemm, args.fp8)
    points = []
    if args.sweep:
        print("# sweep: cells, each candidate configuration at its default split count, half "
              "and twice it")
        print(f"| {'rows':>4} | {'config':28} | {'us':>9} | {'TFLOP/s':>7} |")
        sweep_rows = [r for r in ([1, 4, 16] if args.quick else [1, 4, 16, 64, 128])
                      if pool % r == 0]
        points = sweep(work, sweep_rows, repeats)
    if args.json:
        write_json(args.json, {"id": "P-ATTN", "device": torch.cuda.get_device_name(),
                                "gemm_tflops": gemm, "table": args.table,
                                "scatter": work["scatter"], "hit_rate": work["hit_rate"],
                                "heads": HEADS, "k": K, "target": TARGET, "rows": results,
                                "sweep": points})
    return 0 if all(r["passed"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
