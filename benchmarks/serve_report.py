"""P-SERVE's report (benchmarks/serve.py): each level's physical bound from the ceilings
measured in the same run, the summary of the four target figures, the table and the plot."""
from __future__ import annotations

import sys

import torch

import torch_kvcm2 as kv
from harness import Timer, ceilings
from locality import PUBLISHED


def measure_ceilings(device: str, shape: Shape, quick: bool) -> dict:
    """The ceilings the bounds use, measured in this run: ``hbm`` (a device copy, read + write
    GB/s), ``h2d`` (the copy engine), ``gather`` (GB/s of ``latent_bytes`` rows gathered from
    pinned host memory by the GPU's own loads, through the UVA view: how a fetch moves misses,
    which on some hosts runs well below the copy engine) and ``gemm`` (TFLOP/s of a bf16
    ``torch.mm``, the stand-in weights' product)."""
    timer = Timer(device, 5 if quick else 20)
    out = ceilings(timer, device, quick)
    rows = (1 << 14) if quick else (1 << 20)
    host = torch.zeros(rows, shape.latent_bytes, dtype=torch.uint8)
    if device == "cuda":
        host = host.pin_memory()
        source = kv.ops.uva_view(host)
    else:
        source = host
    index = torch.randint(0, rows, (rows // 4,), device=device)
    target = torch.empty(rows // 4, shape.latent_bytes, dtype=torch.uint8, device=device)
    us = timer.graph(lambda: torch.index_select(source, 0, index, out=target), 4)
    out["gather"] = target.numel() / us / 1e3
    n = 512 if quick else 8192
    a = torch.ones(n, n, dtype=torch.bfloat16, device=device)
    c = torch.empty_like(a)
    us = timer.graph(lambda: torch.mm(a, a, out=c), 2)
    out["gemm"] = 2 * n ** 3 / us / 1e6
    return out


def step_bound(shape: Shape, level: "Level", ceiling: dict) -> tuple:
    """The fastest the level's step could run with every part overlapped (ENG-5): the slowest
    of its HBM bytes at the copy rate (the layers' weights, the attention modules' with
    ``--attention mla``, every indexer key of the rows' pages, the K selected rows read per
    layer), its FLOPs at the GEMM rate (the weights' product; with the modules their
    projections', the indexer's 2 * 64 * 128 per key scored and the sparse MLA kernel's
    2 H K (576 + 512) per row) and its misses over
    PCIe at the slower of the copy engine and the GPU's gather. Returns (ms, the term, every
    term's ms)."""
    wrows = shape.weight_bytes(level.rows) // 2 // shape.hidden
    span = -(-(level.context + shape.output) // shape.page) * shape.page
    per_layer = (wrows * shape.hidden * 2 + level.rows * span * shape.key_bytes
                 + level.rows * shape.top_k * shape.latent_bytes + level.attention_bytes)
    flops = 2 * wrows * shape.hidden * level.rows + level.attention_flops
    terms = {
        "HBM": level.layers * per_layer / (ceiling["hbm"] * 1e9) * 1e3,
        "GEMM": level.layers * flops / (ceiling["gemm"] * 1e12) * 1e3,
        "PCIe": level.fetched_bytes_per_step / (min(ceiling["h2d"], ceiling["gather"]) * 1e9)
        * 1e3,
    }
    by = max(terms, key=terms.get)
    return terms[by], by, terms


def summarize(levels: list, shape: Shape) -> dict:
    """The four P-SERVE figures per context: concurrency, throughput and TPOT from the sweep at
    ``shape.layers``; the low-concurrency ratio from the most layers run at 1-2 requests."""
    out = {}
    for context in sorted({lv.context for lv in levels}):
        overlapped = {(lv.rows, lv.layers): lv for lv in levels if lv.context == context and lv.overlap}
        here = [lv for lv in levels if lv.context == context and not lv.overlap]
        low_layers = max(lv.layers for lv in here)
        lows = {s: [lv for lv in here if lv.side == s and lv.layers == low_layers] for s in ("dense", "kvcm2")}
        by = {s: [lv for lv in here if lv.side == s and lv.layers == shape.layers] for s in ("dense", "kvcm2")}
        dense_max = max(lv.rows for lv in by["dense"])
        ours_max = max(lv.rows for lv in by["kvcm2"])
        best = {s: max(lv.tokens_per_s for lv in by[s]) for s in by}
        small = {}
        for rows in (1, 2):
            d = [lv for lv in lows["dense"] if lv.rows == rows]
            o = [lv for lv in lows["kvcm2"] if lv.rows == rows]
            if d and o:
                small[rows] = o[0].tokens_per_s / d[0].tokens_per_s
        tpot = max(lv.tpot_p99 / lv.tpot_p50 for lv in by["kvcm2"])
        top = {s: max(by[s], key=lambda lv: lv.tokens_per_s) for s in by}
        out[context] = {
            "max_concurrency": {"dense": dense_max, "kvcm2": ours_max, "ratio": ours_max / dense_max},
            "best_tokens_per_s": {**best, "ratio": best["kvcm2"] / best["dense"]},
            "low_concurrency_ratio": small,
            "low_concurrency_layers": low_layers,
            "tpot_p99_over_p50": tpot,
            "binding": {s: by[s][-1].binding for s in by},
            # each side's best level against its physical bound (step_bound)
            "of_bound_at_best": {s: {"rows": top[s].rows, "of_bound": top[s].of_bound,
                                     "bound_by": top[s].bound_by} for s in top},
            # torch_kvcm2's TPOT p50 with the fetches on a side stream over without, per level
            "overlap_tpot_ratio": {f"{lv.rows}@{lv.layers}L": overlapped[lv.rows, lv.layers].tpot_p50
                                   / lv.tpot_p50 for lv in here
                                   if lv.side == "kvcm2" and (lv.rows, lv.layers) in overlapped},
        }
    return out


def print_table(levels: list, summary: dict, shape: Shape, title: str) -> None:
    print(f"# P-SERVE — {title}")
    published = PUBLISHED.get(shape.slots) if shape.top_k == 2048 else None
    print(f"# {shape.layers} of {shape.model_layers} layers, K={shape.top_k}, S={shape.slots}, "
          f"latent {shape.latent_bytes} B + key {shape.key_bytes} B per token per layer; locality "
          f"(benchmarks/locality.py): turnover {shape.turnover}, returning {shape.returning}, "
          f"mean age {shape.reuse_age} steps; top-k {shape.topk_kind}"
          + (f" (published LRU miss rate at S = {shape.slots * 2048 // shape.top_k} of K = 2048: "
             f"{published:.1%})" if published else "") + f"; budgets GPU {shape.gpu_kv_gb * shape.scale:.2f} GB / host "
          f"{shape.host_gb * shape.scale:.2f} GB (x{shape.scale:.3f} of {shape.gpu_kv_gb} / {shape.host_gb})")
    print("| context | layers | side  | conc. | tokens/s | TPOT p50 ms | p99 ms | host ms | hit rate (model) | PCIe MB/step | eager parts ms (weights/indexer/cache/attention) | bound ms (by) | of bound | binds |")
    print("|---------|--------|-------|-------|----------|-------------|--------|---------|------------------|--------------|--------------------------------------------------|---------------|----------|-------|")
    for lv in levels:
        parts = "/".join(f"{lv.parts_ms.get(p, 0):.2f}" for p in ("weights", "indexer", "cache", "attention"))
        bound = lv.binding if lv.maximum else ""
        hit = (f"{lv.hit_rate:.3f} ({lv.model_hit_rate:.3f})" if lv.side == "kvcm2"
               else "-").rjust(16)
        label = "kv+ov" if lv.overlap else lv.side  # kv+ov: kvcm2 with FetchStream
        print(f"| {lv.context:7} | {lv.layers:6} | {label:5} | {lv.rows:5} | {lv.tokens_per_s:8.0f} | "
              f"{lv.tpot_p50:11.3f} | {lv.tpot_p99:6.3f} | {lv.host_p50:7.3f} | {hit} | "
              f"{lv.fetched_bytes_per_step / 1e6:12.2f} | {parts:48} | "
              f"{lv.bound_ms:7.3f} ({lv.bound_by:4}) | {lv.of_bound:8.2f} | {bound} |")
    for context, s in summary.items():
        mc, bt = s["max_concurrency"], s["best_tokens_per_s"]
        low = ", ".join(f"c={c}: {r:.2f}x" for c, r in s["low_concurrency_ratio"].items())
        print(f"# {context} tokens: max concurrency {mc['kvcm2']} vs {mc['dense']} ({mc['ratio']:.2f}x; "
              f"target >= 3x); best tokens/s {bt['kvcm2']:.0f} vs {bt['dense']:.0f} ({bt['ratio']:.2f}x; "
              f">= 3x); at low concurrency ({s['low_concurrency_layers']} layers) {low} (>= 1.0x); TPOT p99/p50 {s['tpot_p99_over_p50']:.2f} "
              f"(<= 1.2); bound: kvcm2 by {s['binding']['kvcm2']}, dense by {s['binding']['dense']}")
        ob = s["of_bound_at_best"]
        print(f"# {context} tokens: at each side's best, the step at "
              + ", ".join(f"{side} {v['of_bound']:.2f} of its bound ({v['rows']} requests, "
                          f"{v['bound_by']})" for side, v in ob.items()))
        if s["overlap_tpot_ratio"]:
            print(f"# {context} tokens: TPOT p50 with the fetches overlapped (kv+ov) over without: "
                  + ", ".join(f"{k}: {r:.3f}x" for k, r in s["overlap_tpot_ratio"].items()))


def print_slots(levels: list, shape: Shape) -> None:
    """The slots sweep (``slots_sweep``): per context and S, torch_kvcm2's hit rate measured by
    ``metrics()``, the locality model's under a plain LRU, the published one where S is one of
    its points (scaled by K / 2048), and the step."""
    print(f"# slots sweep: torch_kvcm2 at each S (cells per row and layer), K={shape.top_k}")
    print("| context | S | conc. | tokens/s | TPOT p50 ms | hit rate | model | published | PCIe MB/step | of bound | most requests at S |")
    print("|---------|---|-------|----------|-------------|----------|-------|-----------|--------------|----------|--------------------|")
    for lv in levels:
        # the published hot buffer of N slots is S = N + a page here (the decoded token's cell)
        published = (PUBLISHED.get(lv.slots, PUBLISHED.get(lv.slots - shape.page))
                     if shape.top_k == 2048 else None)
        pub = f"{1 - published:.3f}" if published is not None else "-"
        print(f"| {lv.context:7} | {lv.slots} | {lv.rows:5} | {lv.tokens_per_s:8.0f} | "
              f"{lv.tpot_p50:11.3f} | {lv.hit_rate:8.3f} | {lv.model_hit_rate:.3f} | {pub:>9} | "
              f"{lv.fetched_bytes_per_step / 1e6:12.2f} | {lv.of_bound:8.2f} | {lv.binding} |")


def plot(levels: list, path: str, title: str) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("# no plot: pip install -e .[bench] (matplotlib)", file=sys.stderr)
        return False
    contexts = sorted({lv.context for lv in levels})
    fig, axes = plt.subplots(1, len(contexts), figsize=(6 * len(contexts), 4.2), squeeze=False)
    for ax, context in zip(axes[0], contexts):
        for side, label in (("dense", "dense KV in HBM"), ("kvcm2", "torch_kvcm2")):
            mine = sorted((lv for lv in levels
                           if lv.context == context and lv.side == side and not lv.overlap),
                          key=lambda lv: lv.rows)
            line, = ax.plot([lv.rows for lv in mine], [lv.tokens_per_s for lv in mine],
                            marker="o", label=label)
            bound = [(lv.rows, lv.rows * 1e3 / lv.bound_ms) for lv in mine if lv.bound_ms]
            if bound:  # the physical bound of each level's step, in the side's colour
                ax.plot([b[0] for b in bound], [b[1] for b in bound], linestyle="--",
                        color=line.get_color(), alpha=0.6, label=f"{label}: bound")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel("decode tokens/s")
        ax.set_title(f"{context:,}-token context")
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


