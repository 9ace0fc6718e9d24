"""Compile the project's Triton kernels for sm_90 (H100/H200) on a machine without a GPU.

    python scripts/triton_sm90.py      # needs triton (pip install triton); no GPU, no driver

Triton's interpreter (TRITON_INTERPRET=1) runs a kernel's logic on the CPU but skips the
compiler's rules (a reassigned constexpr, an unsupported conversion, a layout that cannot
lower), so a kernel that passes there can still fail to build on the device. This compiles each
kernel ahead of time for the H100's target, at the shapes the benchmarks launch, through PTX to
a cubin with the wheel's ptxas, and prints its shared memory, whether its products use wgmma
and the widths of its global loads (16 B is the widest; a gather narrower than that is the
first thing to look at in a bandwidth-bound kernel): compile errors cost no device time. As
the JIT does at run time, pointers and the integer arguments that are multiples of 16 at those
shapes are compiled as 16-divisible. It does not run anything: numbers and results still need the GPU.
Exit status 1 when a kernel fails to compile.
"""
from __future__ import annotations

import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
sys.path.insert(0, ROOT)


def kernels():
    """(name, jit function, signature, constexpr values, options, the integer arguments that
    are multiples of 16 at that shape) for each kernel and shape."""
    import topk
    from torch_kvcm2.models import indexer_logits as il
    logits = il._triton_kernel()
    sig = {"q": "*bf16", "w": "*fp32", "keys": "*u8", "page_table": "*i64", "lengths": "*i32",
           "out": "*fp32", "npages": "i32", "Q_R": "i32", "Q_H": "i32", "W_R": "i32",
           "K_PAGE": "i64", "PT_R": "i32", "O_R": "i32", "H": "constexpr", "H_PAD": "constexpr",
           "P": "constexpr", "D": "constexpr", "PAGES": "constexpr", "PAGE_LAYOUT": "constexpr"}
    launch = {k: il.DEFAULT_CONFIG[k] for k in ("num_warps", "num_stages")}
    for layout in il.LAYOUTS:
        yield (f"indexer_logits ({layout} layout, 64 heads, pages of 64: P-SERVE)", logits, sig,
               {"H": 64, "H_PAD": 64, "P": 64, "D": il.INDEX_DIM,
                "PAGES": il.DEFAULT_CONFIG["pages"], "PAGE_LAYOUT": layout == "page"}, launch,
               ("Q_R", "Q_H", "W_R", "K_PAGE", "O_R"))
    yield ("indexer_logits (4 heads padded to 16, pages of 16: --quick)", logits, sig,
           {"H": 4, "H_PAD": 16, "P": 16, "D": il.INDEX_DIM, "PAGES": il.DEFAULT_CONFIG["pages"],
            "PAGE_LAYOUT": True}, launch, ("Q_R", "Q_H", "W_R", "K_PAGE", "O_R"))
    from torch_kvcm2.models import sparse_mla as mla
    split, combine = mla._triton_kernels()
    cfg = mla.CANDIDATE_CONFIGS["h128-n32-dv2-w8-s3"]  # the default at 128 heads
    for direct in (False, True):
        yield (f"sparse MLA decode (FP8 rows, 128 heads, {'one split' if direct else 'splits'})",
               split, {"q_ptr": "*bf16", "rows_ptr": "*fp8e4nv", "idx_ptr": "*i32",
                       "out_ptr": "*bf16", "part_o_ptr": "*fp32", "part_lse_ptr": "*fp32",
                       "scale_log2": "fp32", "H": "i32", "K": "i32", "tiles_per_split": "i32",
                       **{n: "i32" for n in ("stride_qb", "stride_qh", "stride_row", "stride_ib",
                                              "stride_ob", "stride_oh", "stride_pb", "stride_ps",
                                              "stride_ph")},
                       **{n: "constexpr" for n in ("D_V", "D_R", "BLOCK_H", "BLOCK_N", "DV_SPLIT",
                                                   "PREFETCH", "DIRECT", "FP8", "IEEE")}},
               {"D_V": mla.LATENT, "D_R": mla.ROPE, "BLOCK_H": cfg["block_h"],
                "BLOCK_N": cfg["block_n"], "DV_SPLIT": cfg["dv_split"], "PREFETCH": False,
                "DIRECT": direct, "FP8": True, "IEEE": False},
               {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]},
               ("K", "stride_qb", "stride_qh", "stride_row", "stride_ib", "stride_ob",
                "stride_oh", "stride_pb", "stride_ps", "stride_ph"))
    yield ("sparse MLA decode: the splits' combine", combine,
           {"part_o_ptr": "*fp32", "part_lse_ptr": "*fp32", "out_ptr": "*bf16", "H": "i32",
            "num_splits": "i32", **{n: "i32" for n in ("stride_pb", "stride_ps", "stride_ph",
                                                       "stride_ob", "stride_oh")},
            "D_V": "constexpr", "BLOCK_H": "constexpr", "BLOCK_D": "constexpr",
            "SPLITS": "constexpr"},
           {"D_V": mla.LATENT, "BLOCK_H": 4, "BLOCK_D": 128, "SPLITS": 32},
           {"num_warps": 4, "num_stages": 1},
           ("H", "stride_pb", "stride_ps", "stride_ph", "stride_ob", "stride_oh"))
    if topk.triton is not None:
        cfg = topk.DEFAULT_CONFIG
        warps = {"num_warps": cfg["num_warps"]}
        consts = {"BITS": "constexpr", "BLOCK": "constexpr", "FLOAT": "constexpr",
                  "COMPACT": "constexpr"}
        for name, dtype, flt, compact in (("int32 scores", "*i32", False, 0),
                                          ("float32 scores", "*fp32", True, 0),
                                          ("float32 scores, compact 2", "*fp32", True, 2)):
            yield (f"radix top-k ({name})", topk._topk_kernel,
                   {"scores": dtype, "out": "*i64", "scratch": "*i64", "n": "i32", "k": "i32",
                    "S_STRIDE": "i32", "O_STRIDE": "i32", **consts},
                   {"BITS": cfg["bits"], "BLOCK": cfg["block"], "FLOAT": flt, "COMPACT": compact},
                   warps, ("n", "S_STRIDE", "O_STRIDE"))
        launch = {"BITS": cfg["bits"], "BLOCK": cfg["block"], "FLOAT": True, "COMPACT": 0}
        yield ("radix top-k split: each chunk's top-K (float32 scores)", topk._topk_chunks_kernel,
               {"scores": "*fp32", "cand": "*i64", "scratch": "*i64", "n": "i32", "k": "i32",
                "L": "i32", "S_STRIDE": "i32", "C_STRIDE": "i32", **consts}, launch, warps,
               ("n", "L", "S_STRIDE", "C_STRIDE"))
        yield ("radix top-k split: the candidates' top-K (float32 scores)", topk._topk_merge_kernel,
               {"scores": "*fp32", "cand": "*i64", "out": "*i64", "scratch": "*i64", "m": "i32",
                "k": "i32", "S_STRIDE": "i32", "C_STRIDE": "i32", "O_STRIDE": "i32", **consts},
               launch, warps, ("m", "S_STRIDE", "C_STRIDE", "O_STRIDE"))


def load_widths(ptx: str) -> str:
    """The global loads of a kernel's PTX by width: ``ld.global`` and ``cp.async`` (to shared
    memory) instructions, e.g. ``16 B x 8, 4 B x 19``."""
    widths: dict = {}
    for vec, bits in re.findall(r"ld\.global(?:\.[a-z]+[0-9:]*)*?(?:\.v(\d))?\.[bsuf](\d+)", ptx):
        size = int(vec or 1) * int(bits) // 8
        widths[size] = widths.get(size, 0) + 1
    for size in re.findall(r"cp\.async\.c[ag]\.shared\.global[^,]*,[^,]*, (0x[0-9a-f]+|\d+)", ptx):
        size = int(size, 0)
        widths[size] = widths.get(size, 0) + 1
    return ", ".join(f"{w} B x {n}" for w, n in sorted(widths.items(), reverse=True)) or "none"


def main() -> int:
    try:
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError:
        print("triton is not installed: pip install triton", file=sys.stderr)
        return 2
    target = GPUTarget("cuda", 90, 32)
    failed = 0
    for name, fn, signature, constants, options, multiples in kernels():
        names = list(signature)
        aligned = [n for n, t in signature.items() if t.startswith("*")] + list(multiples)
        source = ASTSource(fn=fn, signature=signature,
                           constexprs={(names.index(k),): v for k, v in constants.items()},
                           attrs={(names.index(n),): [["tt.divisibility", 16]] for n in aligned})
        try:
            compiled = triton.compile(source, target=target, options=options)
        except Exception as error:  # noqa: BLE001 - every compile error is reported, then the next
            failed += 1
            print(f"FAILED {name}: {type(error).__name__}: {str(error).strip().splitlines()[-1]}")
            continue
        meta = compiled.metadata
        ptx = compiled.asm["ptx"]
        print(f"ok     {name}: cubin {len(compiled.asm['cubin'])} B, shared {meta.shared} B, "
              f"{'wgmma' if 'wgmma' in ptx else 'mma.sync' if 'mma.sync' in ptx else 'no tensor-core'}"
              f" products, global loads {load_widths(ptx)} (triton {triton.__version__}, sm_90)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
