"""The DSA indexer of P-SERVE's ``--attention mla`` alone: its logits over a paged pool of FP8
keys (``torch_kvcm2.models.indexer_logits``) and the radix top-k of them (benchmarks/topk.py),
against the bytes and FLOPs ceilings measured in the same run.

    python benchmarks/bench_indexer.py               # 32K and 128K contexts, 1 .. max rows (GPU)
    python benchmarks/bench_indexer.py --sweep       # also every launch config (--sweep topk: the top-k's)
    python benchmarks/bench_indexer.py --quick       # fewer rows and repeats
    python benchmarks/bench_indexer.py --json out.json

DeepSeek-V3.2's indexer: 64 heads of 128, 132-byte FP8 keys (128 float8_e4m3fn values and an
fp32 scale) in pages of 64 tokens in the engines' page layout (a page's values, then its
scales; P-SERVE's), top-k 2048. Per context (32,768 or 131,072 prompt tokens
plus P-SERVE's 2,048 of output: 34,816 or 133,120 positions scored) a pool of requests (116 at
32K and 30 at 128K: about P-SERVE's most rows on an H200) has its pages scattered over one key
pool, each request's length a little below the span. For B rows the pool is cut into sets of
B, one call per set captured in one CUDA graph (a replay reads every request's keys once, more
than L2), the median per call is the time. Each set's logits are checked against the
definition (``indexer_logits_reference``) on three rows before timing and again after the
timed replays (outputs poisoned, one more replay); the top-k's output against its rule
(``topk.reference``) likewise.

Columns: the logits' µs, the keys' GB/s and that as a fraction of the HBM bound (the bytes read
at the device copy's rate, read + write, measured in the run: how P-SERVE's bound counts
them), their TFLOP/s (2 * 64 * 128 per key) against a bf16 GEMM's; the top-k's µs, and
``torch.topk``'s on the same rows. No target
of its own: it shows how near P-SERVE's indexer term is to its part of the bound, and
``--sweep`` which launch to make the default (``DEFAULT_CONFIG``), in both layouts (the
token-by-token one gathers 132-byte rows with 4-byte loads), and which digit width, block and
warps for the top-k's and over how many programs a row is split (``topk.DEFAULT_CONFIG``, at 1
row and at the most rows). Exit status 2 when there is
no CUDA GPU or no triton (nothing is measured on the CPU).
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import Timer, ceilings, machine_title, write_json  # noqa: E402
import topk  # noqa: E402
from torch_kvcm2.models import indexer_logits as il  # noqa: E402

HEADS, K, PAGE, OUTPUT = 64, 2048, 64, 2048
POOLS = {32768: 116, 131072: 30}  # context -> requests in the pool
SWEEP = [{"pages": p, "num_warps": w, "num_stages": s}
         for p, w, s in itertools.product((1, 2, 4, 8), (4, 8), (1, 2, 3))]
LAYOUT = "page"  # P-SERVE's
# the digit width from 5 to 8 bits was swept on an H100 (2026-12-07: within 5% from 5 to 7);
# now a row over several programs (``split``), in the two launches fastest at 32K and at 128K,
# and the passes after the second digit over the positions still matching (``compact``)
TOPK_SWEEP = [{"bits": 6, "block": blk, "num_warps": w, "split": split, "compact": compact}
              for (blk, w, compact), split in itertools.product(
                  ((4096, 16, 0), (2048, 8, 0), (4096, 16, 2)), (1, 2, 4, 8, 16))]


def build(context: int, pool: int, seed: int = 0, device: str = "cuda") -> dict:
    """The pool's inputs: queries, weights, keys (valid FP8 values, scale 1/64, in both layouts),
    each request's pages scattered over the key pool, lengths within the last 2048 positions."""
    g = torch.Generator(device=device).manual_seed(seed)
    npages = -(-(context + OUTPUT) // PAGE)
    keys = torch.randint(0, 256, (pool * npages, PAGE, il.KEY_BYTES), dtype=torch.uint8,
                         device=device, generator=g)
    keys[..., :il.INDEX_DIM] &= 0x77  # never NaN
    keys[..., il.INDEX_DIM:] = torch.tensor([1 / 64], device=device).view(torch.uint8)
    table = torch.randperm(pool * npages, device=device, generator=g).view(pool, npages)
    span = npages * PAGE
    lengths = (span - torch.randint(1, OUTPUT, (pool,), device=device, generator=g)).to(torch.int32)
    q = torch.randn(pool, HEADS, il.INDEX_DIM, device=device, generator=g).to(torch.bfloat16)
    w = torch.randn(pool, HEADS, device=device, generator=g) * HEADS ** -0.5 * il.INDEX_DIM ** -0.5
    return {"q": q, "w": w, "keys": {"token": keys, "page": il.to_page_layout(keys)},
            "table": table, "lengths": lengths, "span": span}


def check(work: dict, rows: slice, out: torch.Tensor, picked: torch.Tensor, what: str,
          layout: str = LAYOUT) -> None:
    """Three rows of a set's logits against the definition, every row's top-k against its rule."""
    sample = sorted({0, (out.shape[0] - 1) // 2, out.shape[0] - 1})
    idx = torch.arange(rows.start, rows.stop, device=out.device)[sample]
    want = il.indexer_logits_reference(work["q"][idx], work["w"][idx], work["keys"][layout],
                                       work["table"][idx], work["lengths"][idx], layout=layout)
    scale = float(want[want.isfinite()].abs().max())
    got = out[sample]
    if not (torch.equal(got.isinf(), want.isinf())
            and torch.allclose(got, want, rtol=1e-5, atol=1e-5 * scale)):
        raise AssertionError(f"{what}: the logits differ from the definition")
    if not torch.equal(picked, topk.reference(out, K)):
        raise AssertionError(f"{what}: the top-k differs from its rule")


def measure(work: dict, batch: int, repeats: int, config: dict | None, with_topk: bool,
            layout: str = LAYOUT) -> dict:
    pool = work["q"].shape[0]
    sets = [slice(i, i + batch) for i in range(0, pool - batch + 1, batch)]
    outs = [torch.empty(batch, work["span"], device="cuda") for _ in sets]
    picks = [torch.empty(batch, K, dtype=torch.int64, device="cuda") for _ in sets]

    def logits(j):
        s = sets[j]
        il.indexer_logits(work["q"][s], work["w"][s], work["keys"][layout], work["table"][s],
                          work["lengths"][s], out=outs[j], config=config, layout=layout)

    def select(j):
        topk.topk_indices(outs[j], K, out=picks[j])

    for j in range(len(sets)):  # compile and check outside the capture
        logits(j)
        select(j)
        check(work, sets[j], outs[j], picks[j], f"{batch} rows, set {j}", layout)
    timer = Timer("cuda", repeats)
    us, replay = timer.graph(lambda: [logits(j) for j in range(len(sets))], 1, keep=True)
    for o in outs:
        o.fill_(float("nan"))
    replay()
    for j in range(len(sets)):
        select(j)
        check(work, sets[j], outs[j], picks[j], f"{batch} rows, set {j}, after the replays", layout)
    result = {"logits_us": us / len(sets)}
    if with_topk:
        result["topk_us"] = timer.graph(lambda: [select(j) for j in range(len(sets))], 1) / len(sets)
        # torch.topk on the same rows, for comparison (its positions differ only within ties)
        result["torch_topk_us"] = timer.graph(
            lambda: [outs[j].topk(K, dim=1, sorted=False) for j in range(len(sets))], 1) / len(sets)
    lengths = work["lengths"][:batch * len(sets)].double().sum() / len(sets)
    result["key_bytes"] = float(lengths) * il.KEY_BYTES
    result["flops"] = float(lengths) * 2 * HEADS * il.INDEX_DIM
    return result


def measure_topk(scores: torch.Tensor, batch: int, repeats: int, config: dict) -> float:
    """The top-k's µs per call of ``batch`` rows of ``scores`` (up to 8 sets of them, one graph),
    with ``config``; every set's output checked against the rule first."""
    sets = [slice(i, i + batch) for i in range(0, scores.shape[0] - batch + 1, batch)][:8]
    picks = [torch.empty(batch, K, dtype=torch.int64, device="cuda") for _ in sets]
    for s, pick in zip(sets, picks):
        topk.topk_indices(scores[s], K, out=pick, config=config)
        if not torch.equal(pick, topk.reference(scores[s], K)):
            raise AssertionError(f"top-k {config}, {batch} rows: not the rule's selection")
    return Timer("cuda", repeats).graph(
        lambda: [topk.topk_indices(scores[s], K, out=p, config=config)
                 for s, p in zip(sets, picks)], 1) / len(sets)


def gemm_tflops(repeats: int) -> float:
    a = torch.randn(8192, 8192, device="cuda").to(torch.bfloat16)
    c = torch.empty_like(a)
    return 2 * 8192 ** 3 / Timer("cuda", repeats).graph(lambda: torch.mm(a, a, out=c), 2) / 1e6


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer rows and repeats")
    parser.add_argument("--sweep", nargs="?", const="both", choices=("both", "logits", "topk"),
                        help="every launch config of the logits (at the most rows), the top-k's "
                             "(at 1 and the most rows), or both (the default)")
    parser.add_argument("--json", help="write the rows (and the sweep) to this file")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() or topk.triton is None:
        print("bench_indexer.py: needs a CUDA GPU and triton; nothing was measured",
              file=sys.stderr)
        return 2
    repeats = 5 if args.quick else 20
    timer = Timer("cuda", repeats)
    ceiling = ceilings(timer, "cuda", args.quick)
    ceiling["gemm"] = gemm_tflops(repeats)
    title = machine_title("cuda")
    print(f"# the DSA indexer's logits and top-k — {title}")
    print(f"# ceilings: HBM copy {ceiling['hbm']:.0f} GB/s (read + write), bf16 GEMM "
          f"{ceiling['gemm']:.0f} TFLOP/s; logits {il.DEFAULT_CONFIG}, {LAYOUT} layout; "
          f"top-k {topk.DEFAULT_CONFIG}")
    print("| context | rows | logits us | keys GB/s | of HBM bound | TFLOP/s | of GEMM | top-k us | torch.topk us |")
    print("|---------|------|-----------|-----------|--------------|---------|---------|----------|---------------|")
    rows_out, sweep_out, topk_out = [], [], []
    for context, pool in POOLS.items():
        work = build(context, pool)
        batches = [b for b in ((1, 8, pool) if args.quick else (1, 2, 8, 32, pool)) if b <= pool]
        for b in batches:
            r = measure(work, b, repeats, None, True)
            gbs = r["key_bytes"] / r["logits_us"] / 1e3
            row = {"context": context, "rows": b, **r, "key_gb_s": gbs,
                   "of_hbm_bound": gbs / ceiling["hbm"],
                   "tflops": r["flops"] / r["logits_us"] / 1e6}
            row["of_gemm"] = row["tflops"] / ceiling["gemm"]
            rows_out.append(row)
            print(f"| {context:7d} | {b:4d} | {r['logits_us']:9.1f} | {gbs:9.0f} | "
                  f"{row['of_hbm_bound']:12.2f} | {row['tflops']:7.1f} | {row['of_gemm']:7.2f} | "
                  f"{r['topk_us']:8.1f} | {r['torch_topk_us']:13.1f} |")
        if args.sweep in ("both", "logits"):
            for layout, cfg in itertools.product(il.LAYOUTS, SWEEP):
                try:
                    r = measure(work, pool, repeats, cfg, False, layout)
                except Exception as error:  # noqa: BLE001 - a launch that cannot build is reported
                    print(f"#   sweep {context} {layout} {cfg}: failed ({type(error).__name__})")
                    continue
                gbs = r["key_bytes"] / r["logits_us"] / 1e3
                sweep_out.append({"context": context, "rows": pool, "layout": layout, **cfg, **r,
                                  "key_gb_s": gbs, "of_hbm_bound": gbs / ceiling["hbm"]})
                print(f"#   sweep {context} x {pool}, {layout} layout: {cfg}: {r['logits_us']:.1f} us, "
                      f"{gbs / ceiling['hbm']:.2f} of the HBM bound")
        if args.sweep in ("both", "topk"):
            scores = torch.empty(pool, work["span"], device="cuda")
            il.indexer_logits(work["q"], work["w"], work["keys"][LAYOUT], work["table"],
                              work["lengths"], out=scores, layout=LAYOUT)
            for cfg, b in itertools.product(TOPK_SWEEP, (1, pool)):
                try:
                    us = measure_topk(scores, b, repeats, cfg)
                except Exception as error:  # noqa: BLE001 - a launch that cannot build is reported
                    print(f"#   top-k sweep {context} x {b} {cfg}: failed ({type(error).__name__}: {error})")
                    continue
                topk_out.append({"context": context, "rows": b, **cfg, "topk_us": us})
                print(f"#   top-k sweep {context} x {b} rows: {cfg}: {us:.1f} us")
        del work
        torch.cuda.empty_cache()
    if args.json:
        write_json(args.json, {"ceilings": ceiling, "config": il.DEFAULT_CONFIG, "layout": LAYOUT,
                               "topk_config": topk.DEFAULT_CONFIG, "rows": rows_out,
                               "sweep": sweep_out, "topk_sweep": topk_out})
    return 0


if __name__ == "__main__":
    sys.exit(main())
