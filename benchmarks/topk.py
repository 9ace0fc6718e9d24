"""A radix-select top-k for the serving benchmark's indexer: the K largest of each row's int32
or float32 scores, one or a few Triton programs per row.

    indices = topk_indices(scores, K)   # int64[R, K]: the K largest of each row of scores

Engines take the DSA indexer's top-k with a fused radix select, not a sort; this is one, written
to see how close a simple one gets. It does not beat ``torch.topk`` yet: on an H100
(2026-12-08, ``bench_indexer.py --sweep topk``, float32 logits, K = 2,048) its best launch took
80 µs for one 32K-position row, 135 µs for 116 of them, 141 µs for one 128K row and 157 µs for
30, where ``torch.topk`` took 45, 100, 55 and 99 µs. ``benchmarks/serve.py`` therefore uses
``torch.topk`` over those logits (``--attention mla``) and this one over its stand-in's int32
scores, where ``torch.topk`` was the slow one (``--topk`` chooses).

The method:
each row's keys (the scores plus 2^31, so they are non-negative 32-bit values in the scores'
order; a float32 score's bits are first made an int32 in the floats' order,
``bits ^ ((bits >> 31) & 0x7FFFFFFF)`` after -0.0 is made +0.0, so ``-inf`` is the lowest key and
NaN is not allowed) are histogrammed ``bits`` at a time from the top (6 by default: bits 26-31,
20-25, ..., 0-1), each pass over the elements whose higher bits equal the prefix found so far,
which narrows the K-th largest key to one value T; a last pass writes the positions of the keys
above T in position order, then the lowest positions holding T until there are K. Ties at T
therefore go to the lowest positions, deterministically (``torch.topk`` leaves them unspecified;
``reference`` is the same rule in torch). The output is the set, in that order: callers that need
the selection sorted by score sort it themselves (attention does not).

Why narrow digits: Triton's ``tl.histogram`` counts with one warp ballot per bit of the bin
index and then, in every lane, a popcount for each of its ``bins / 32`` bins, so its cost per
element grows with the bins, not their logarithm. On an H100 (2026-12-07, bench_indexer.py):
2,048 bins (11-bit digits, 3 passes) took 1,499 µs per 34,816-position row, 64 bins (6-bit, 6
passes, re-reading a row that sits in L2) 142 µs; 5 to 7 bits are within 5% of each other.
``DEFAULT_CONFIG`` is the digit width, the block, the warps and ``split``; ``bench_indexer.py
--sweep topk`` measures the others.

One program per row leaves most SMs idle at a few rows (142 µs for one 32K row where the logits
of its keys take 18). ``split`` = C cuts each row into C chunks: a program per chunk takes the
chunk's top-K in position order (all of it when shorter than K) into a candidate list, then a
program per row takes the top-K of the C × K candidates, reading their scores through the
list. The row's top-K is the candidates' (each chunk's own top-K holds every position of the
row's that falls in it, as the rule orders by value, then position), and the candidates being
in position order keeps the output the one-program kernel's, position for position. It pays
where rows are few: C times the programs, plus a pass over C × K candidates. ``split`` = 0 (the
default) picks C by shape (``auto_split``).

``compact`` = d makes the pass over digit d also list the positions still matching the prefix
(in a scratch list of the row's length), and the later passes read only those, through the
list. A float's top 12 bits are its sign, exponent and 3 mantissa bits, so after two 6-bit
digits the K-th value's bucket is an eighth of a binade: a small part of the row. The row is
then read d + 2 times (the last pass writes the output from the whole row) instead of once per
digit and once more. With d = 2 (the default), at the split ``auto_split`` picks, every shape of
the sweep ran 2-13% faster than without (slower only at splits too wide for its rows).

Triton runs it on CUDA tensors (CPU tensors under ``TRITON_INTERPRET=1``, as the tests do);
``topk_indices`` falls back to ``reference`` where there is no triton (the CPU runs of the
benchmark). With ``--topk radix`` both sides of P-SERVE use it.
"""
from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU runs without the [bench] extra
    triton = None

DEFAULT_CONFIG = {"bits": 6, "block": 4096, "num_warps": 16, "split": 0, "compact": 2}


def auto_split(rows: int, n: int, sms: int) -> int:
    """``split`` = 0's choice: the most programs per row, a power of two up to 8, that keep
    ``rows`` x split within the GPU's ``sms`` and each chunk at least 8,192 positions -- the
    sweep's best split at each shape it measured (H100, 2026-12-08: 4 at one 32K row, 8 at one
    128K row, 4 at 30 128K rows, 1 at 116 32K rows)."""
    split = 1
    while split < 8 and rows * split * 2 <= sms and n // (split * 2) >= 8192:
        split *= 2
    return split


def reference(scores: torch.Tensor, k: int) -> torch.Tensor:
    """The same selection in torch: the K largest per row, ties at the K-th value to the lowest
    positions, positions above the K-th value first, each part in position order."""
    kth = scores.topk(k, dim=1).values[:, -1:]  # the K-th largest value per row
    above = scores > kth
    ties = (scores == kth) & ((scores == kth).cumsum(1) <= k - above.sum(1, keepdim=True))
    order = torch.where(above, 0, 1) * scores.shape[1] + torch.arange(scores.shape[1],
                                                                     device=scores.device)
    order = torch.where(above | ties, order, 2 * scores.shape[1])
    return order.sort(1).indices[:, :k]


if triton is not None:
    @triton.jit
    def _elements(scores, cand, offs, n, FLOAT: tl.constexpr, INDIRECT: tl.constexpr):
        """Elements ``offs`` of a row of ``n``: (their positions in the row, which exist, their
        order-preserving keys in [0, 2^32) as int64). The elements are the row's positions, or
        with INDIRECT the positions listed in ``cand`` (-1: none)."""
        if INDIRECT:
            pos = tl.load(cand + offs, mask=offs < n, other=-1)
            valid = pos >= 0
        else:
            pos = offs
            valid = offs < n
        s = tl.load(scores + pos, mask=valid, other=0)
        if FLOAT:
            bits = tl.where(s == 0, 0.0, s).to(tl.int32, bitcast=True)  # -0.0 is +0.0
            s = bits ^ ((bits >> 31) & 0x7FFFFFFF)
        return pos, valid, s.to(tl.int64) + 2147483648

    @triton.jit
    def _threshold(scores, cand, n, k, scratch, BITS: tl.constexpr, BLOCK: tl.constexpr,
                   FLOAT: tl.constexpr, INDIRECT: tl.constexpr, COMPACT: tl.constexpr):
        """(T, above): the k-th largest key of the n elements, and how many keys exceed it.
        COMPACT > 0: the pass over digit COMPACT also lists the positions of the elements that
        still match the prefix in ``scratch`` (n int64 entries), and the later passes read only
        those."""
        BINS: tl.constexpr = 1 << BITS
        bins = tl.arange(0, BINS)
        above = 0  # keys above the prefix found so far
        prefix = tl.zeros((), dtype=tl.int64)
        listed = 0  # elements in scratch
        for p in tl.static_range((32 + BITS - 1) // BITS):  # the digits from the top
            # p is a constexpr, so are the digit's shift and width (the last one may be narrower)
            shift = max(32 - BITS * (p + 1), 0)
            width = 32 - BITS * p - shift
            hist = tl.zeros((BINS,), dtype=tl.int32)
            if COMPACT > 0 and p > COMPACT:  # the listed elements only
                for start in range(0, listed, BLOCK):
                    _, match, key = _elements(scores, scratch, start + tl.arange(0, BLOCK),
                                              listed, FLOAT, True)
                    match = match & ((key >> (shift + width)) == prefix)
                    digit = ((key >> shift) & ((1 << width) - 1)).to(tl.int32)
                    hist += tl.histogram(digit, BINS, mask=match)
            else:
                for start in range(0, n, BLOCK):
                    pos, match, key = _elements(scores, cand, start + tl.arange(0, BLOCK), n,
                                                FLOAT, INDIRECT)
                    if p > 0:
                        match = match & ((key >> (shift + width)) == prefix)
                    digit = ((key >> shift) & ((1 << width) - 1)).to(tl.int32)
                    hist += tl.histogram(digit, BINS, mask=match)
                    if COMPACT > 0 and p == COMPACT:
                        rank = listed + tl.cumsum(match.to(tl.int32), 0) - 1
                        tl.store(scratch + rank, pos.to(tl.int64), mask=match)
                        listed += tl.sum(match.to(tl.int32), 0)
            # the digit of the k-th largest key: the largest d with above + #(digit >= d) >= k
            at_least = tl.sum(hist, 0) - tl.cumsum(hist, 0) + hist
            d = tl.sum((above + at_least >= k).to(tl.int32), 0) - 1
            above += tl.sum(tl.where(bins == d, at_least - hist, 0), 0)
            prefix = (prefix << width) | d.to(tl.int64)
        return prefix, above

    @triton.jit
    def _write(scores, cand, n, k, T, above, dst, base, BLOCK: tl.constexpr, FLOAT: tl.constexpr,
               INDIRECT: tl.constexpr, ORDERED: tl.constexpr):
        """Writes the k selected elements' positions (plus ``base``) to ``dst``: the keys above T,
        then the first elements holding T until there are k. ORDERED: the keys above T first,
        each part in element order (the output's order); otherwise all in element order."""
        need = k - above
        gt_at = 0
        eq_at = 0
        for start in range(0, n, BLOCK):
            pos, valid, key = _elements(scores, cand, start + tl.arange(0, BLOCK), n, FLOAT,
                                        INDIRECT)
            gt = valid & (key > T)
            eq = valid & (key == T)
            eq_rank = eq_at + tl.cumsum(eq.to(tl.int32), 0) - 1
            taken = eq & (eq_rank < need)
            if ORDERED:
                gt_rank = gt_at + tl.cumsum(gt.to(tl.int32), 0) - 1
                tl.store(dst + gt_rank, pos.to(tl.int64) + base, mask=gt)
                tl.store(dst + above + eq_rank, pos.to(tl.int64) + base, mask=taken)
                gt_at += tl.sum(gt.to(tl.int32), 0)
            else:
                rank = gt_at + tl.cumsum((gt | taken).to(tl.int32), 0) - 1
                tl.store(dst + rank, pos.to(tl.int64) + base, mask=gt | taken)
                gt_at += tl.sum((gt | taken).to(tl.int32), 0)
            eq_at += tl.sum(eq.to(tl.int32), 0)

    @triton.jit
    def _topk_kernel(scores, out, scratch, n, k, S_STRIDE, O_STRIDE, BITS: tl.constexpr,
                     BLOCK: tl.constexpr, FLOAT: tl.constexpr, COMPACT: tl.constexpr):
        """One program per row: the row's top-k (``scratch``: n int64 a row with COMPACT)."""
        row = tl.program_id(0)
        keys = scores + row * S_STRIDE
        T, above = _threshold(keys, keys, n, k, scratch + row * n, BITS, BLOCK, FLOAT, False,
                              COMPACT)
        _write(keys, keys, n, k, T, above, out + row * O_STRIDE, 0, BLOCK, FLOAT, False, True)

    @triton.jit
    def _topk_chunks_kernel(scores, cand, scratch, n, k, L, S_STRIDE, C_STRIDE,
                            BITS: tl.constexpr, BLOCK: tl.constexpr, FLOAT: tl.constexpr,
                            COMPACT: tl.constexpr):
        """Program (row, c): the top-min(k, m) of the row's chunk c (positions [c L, c L + m)),
        in position order, into the row's k candidate entries of chunk c; the rest -1."""
        row = tl.program_id(0)
        c = tl.program_id(1)
        base = c * L
        m = tl.minimum(L, n - base)
        kc = tl.minimum(k, m)
        keys = scores + row * S_STRIDE + base
        dst = cand + row * C_STRIDE + c * k
        mine = scratch + (row * tl.num_programs(1) + c) * L  # L int64 a chunk with COMPACT
        T, above = _threshold(keys, keys, m, kc, mine, BITS, BLOCK, FLOAT, False, COMPACT)
        _write(keys, keys, m, kc, T, above, dst, base, BLOCK, FLOAT, False, False)
        for start in range(kc, k, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            tl.store(dst + offs, tl.full((BLOCK,), -1, tl.int64), mask=offs < k)

    @triton.jit
    def _topk_merge_kernel(scores, cand, out, scratch, m, k, S_STRIDE, C_STRIDE, O_STRIDE,
                           BITS: tl.constexpr, BLOCK: tl.constexpr, FLOAT: tl.constexpr,
                           COMPACT: tl.constexpr):
        """One program per row: the top-k of the row's m candidates (positions in position
        order, -1: none), written as ``_topk_kernel`` writes."""
        row = tl.program_id(0)
        keys = scores + row * S_STRIDE
        mine = cand + row * C_STRIDE
        T, above = _threshold(keys, mine, m, k, scratch + row * m, BITS, BLOCK, FLOAT, True,
                              COMPACT)
        _write(keys, mine, m, k, T, above, out + row * O_STRIDE, 0, BLOCK, FLOAT, True, True)


def topk_indices(scores: torch.Tensor, k: int, out: torch.Tensor | None = None,
                 config: dict | None = None) -> torch.Tensor:
    """int64[R, K]: the positions of the K largest of each row of ``scores`` (int32 or
    float32 [R, N] without NaN, rows contiguous, 1 <= K <= N), as the module docstring says;
    ``out`` (int64[R, K]) is written when given (fixed outputs for a captured graph);
    ``config`` overrides ``DEFAULT_CONFIG`` (bits: 5 to 11 per digit, block: a power of two,
    num_warps, split: programs per row (0: ``auto_split``), compact: the digit pass that also
    lists the positions still matching the prefix, after which the passes read only those; 0:
    none) and changes only the speed."""
    if scores.dtype not in (torch.int32, torch.float32) or scores.dim() != 2 or scores.stride(1) != 1:
        raise ValueError(f"topk_indices: scores must be int32 or float32 [R, N] with contiguous rows, got "
                         f"{scores.dtype}{list(scores.shape)}")
    R, n = scores.shape
    if not 1 <= k <= n:
        raise ValueError(f"topk_indices: K = {k} must be in [1, {n}]")
    if out is None:
        out = torch.empty(R, k, dtype=torch.int64, device=scores.device)
    if triton is None or (scores.device.type != "cuda" and not _interpreting()):
        out.copy_(reference(scores, k))
        return out
    cfg = {**DEFAULT_CONFIG, **(config or {})}
    if not 5 <= cfg["bits"] <= 11:  # at least one bin per lane (a warp has 32), at most 2,048
        raise ValueError(f"topk_indices: bits = {cfg['bits']} must be in [5, 11]")
    if cfg["split"] < 0:
        raise ValueError(f"topk_indices: split = {cfg['split']} must be 0 (by shape) or more")
    if cfg["split"] == 0:
        sms = (torch.cuda.get_device_properties(scores.device).multi_processor_count
               if scores.device.type == "cuda" else 132)  # the interpreter: an H100's
        cfg["split"] = auto_split(R, n, sms)
    passes = -(-32 // cfg["bits"])
    if not 0 <= cfg["compact"] < passes - 1:
        raise ValueError(f"topk_indices: compact = {cfg['compact']} must be in [0, {passes - 1}) "
                         f"with {cfg['bits']}-bit digits")
    launch = dict(BITS=cfg["bits"], BLOCK=cfg["block"], FLOAT=scores.dtype == torch.float32,
                  COMPACT=cfg["compact"], num_warps=cfg["num_warps"])
    L = -(-n // cfg["split"])  # positions per chunk
    chunks = -(-n // L)
    if not R:
        return out

    def scratch(entries: int) -> torch.Tensor:  # the compacted positions' lists
        if not cfg["compact"]:  # never read: any int64 pointer, no allocation per call
            return out
        return torch.empty(entries, dtype=torch.int64, device=scores.device)

    if chunks == 1:
        _topk_kernel[(R,)](scores, out, scratch(R * n), n, k, scores.stride(0), out.stride(0),
                           **launch)
        return out
    # each chunk's own top-K (in position order) holds every position of the row's top-K that
    # falls in it, so the top-K of the candidates is the row's, ties included
    cand = torch.empty(R, chunks * k, dtype=torch.int64, device=scores.device)
    _topk_chunks_kernel[(R, chunks)](scores, cand, scratch(R * chunks * L), n, k, L,
                                     scores.stride(0), cand.stride(0), **launch)
    _topk_merge_kernel[(R,)](scores, cand, out, scratch(R * chunks * k), chunks * k, k,
                             scores.stride(0), cand.stride(0), out.stride(0), **launch)
    return out


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"
