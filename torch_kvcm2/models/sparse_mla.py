"""Sparse MLA decode attention over the K selected latent rows of each request (MOD-4, P-ATTN).

The computation a FlashMLA-style sparse decode kernel does, for one query token per request::

    out[b, h] = softmax(q[b, h] . rows[indices[b]]^T * scale) . rows[indices[b]][:, :512]

* ``q`` ``[B, H, 576]``: the absorbed query, ``q_nope @ W_UK`` (512) then ``q_rope`` (64);
* ``rows`` ``[N, 576]``: the flat latent rows (512 latent, then 64 rope), bf16 (fp16 and fp32
  are accepted too; fp32 for exactness tests), or the FP8 rows described below;
* ``indices`` int32 ``[B, K]``: flat row numbers below N (not checked: values stay on the
  device); a negative entry (``-1``, the library's ``BAD``) is padding and skipped; a request
  with no valid entry gets an output of zeros;
* ``scale``: the softmax scale (a Python float);
* the result ``[B, H, 512]`` in ``q``'s dtype; scores, softmax and sums accumulate in fp32.

Reading the cache manager's cells. A sparse buffer's cells are ``uint8[cells, chunks, P,
B/chunks]`` (``Batch.cells(layer, role)``); the token with index ``i`` of the index table
(``resolve``'s entries; with U = 1 an entry is that index) is ``cells[i // P, :, i % P]``. With
``chunks == 1`` and ``B = 576 * 2`` bytes (a bf16 latent row) the cells are one contiguous run of
rows, so ``rows = cells.view(torch.bfloat16).view(-1, 576)`` and entry ``i``'s token is
``rows[i]``: the index table ``resolve`` returns is ``indices`` as it is, with no conversion.
For 656-byte FP8 rows, ``cells.view(-1, 656)`` is ``rows`` in the same way.

FP8 rows (DeepSeek-V3.2's cache format, 656 bytes a token): 512 float8_e4m3fn latent values,
4 float32 scales (one per 128 latent values), 64 bf16 rope values. Supported: pass ``rows`` as
uint8 ``[N, 656]`` with a bf16 ``q``; the kernel dequantises each gathered row in registers
(``(fp8 -> fp32) * scale``, rounded once to bf16: exactly what ``dequantize_fp8_rows`` does)
and then runs the bf16 path. ``quantize_fp8_rows`` writes that format from bf16 rows.

Dispatch: ``sparse_mla_decode`` runs the Triton kernel when ``q`` is on a CUDA device and
``triton`` imports; otherwise the torch implementation (``sparse_mla_decode_torch``: vectorised
and without host synchronisation, so it also runs on a GPU without triton).
``sparse_mla_decode_reference`` is the plain definition, one request at a time. Triton is
imported only when the Triton path is first used; ``import torch_kvcm2`` never needs it.

The Triton kernel (flash-decoding with split K):

* grid (head tile x latent part, K split, request), the first axis moving fastest, so the
  programs that read the same selected rows run side by side and a row's second read comes
  from L2;
* a program walks its split in tiles of ``block_n`` selected rows: it loads the tile's entries,
  gathers the rows by entry (masked: padding reads nothing and scores ``-inf``), computes the
  scores ``[block_h, block_n]`` with ``tl.dot`` over the latent and the rope part (bf16 in, fp32
  accumulate; wgmma on sm_90 from 64 heads a tile), an online softmax in fp32 (base 2, the
  scale folded into the exponent), and ``P . V`` with ``tl.dot`` on the same gathered latent
  tile (each row is read once for both products);
* the default at 128 heads, ``CANDIDATE_CONFIGS["h128-n32-dv2-w8-s3"]``: all 128 heads in one
  program on 8 warps (each warpgroup owns 64 heads), 32 rows a tile, and two programs a head
  tile, each writing 256 of the 512 latent columns (``dv_split`` 2). Why: an fp32
  ``[heads, 512]`` accumulator for 64 heads needs 256 registers a thread on 4 warps, and on 8
  warps Triton has both warpgroups compute the same 64 heads' scores; the split accumulator
  fits in 128 registers, at the price of the two programs both computing the scores (the score
  product is 576 of the 1088 multiply-adds a (head, row)). Shared memory bounds the tile: the
  queries (147 KB) and two 37 KB row buffers, which Triton fills with cp.async one tile ahead;
* other configurations (``CANDIDATE_CONFIGS``; ``benchmarks/bench_attn.py --sweep`` times them
  all) trade these differently: 64 heads with both warpgroups computing the scores, a single
  warpgroup with rows two tiles ahead, or the next tile's rows prefetched into registers;
* with one split the program normalises and writes ``out``; with several it writes a
  normalised fp32 partial and its log-sum-exp and a second kernel combines the splits. Splits
  fill the SMs once (at most 32: each split's partial is 256 KB a request at 128 heads).
"""
from __future__ import annotations

from typing import Optional

import torch

LATENT = 512  # latent (value) width of a row
ROPE = 64  # rope width of a row
ROW = LATENT + ROPE  # 576: the score width
FP8_ROW_BYTES = 656  # 512 float8_e4m3fn + 4 float32 scales + 64 bf16 rope
FP8_GROUP = 128  # latent values per FP8 scale
_FP8_SCALES = LATENT // FP8_GROUP  # 4

__all__ = [
    "FP8_ROW_BYTES",
    "dequantize_fp8_rows",
    "quantize_fp8_rows",
    "sparse_mla_decode",
    "sparse_mla_decode_reference",
    "sparse_mla_decode_torch",
    "sparse_mla_decode_triton",
    "tolerance",
    "triton_available",
]


# ---------------------------------------------------------------------------------------------
# argument checks and the FP8 row format
# ---------------------------------------------------------------------------------------------

def _is_fp8_rows(rows: torch.Tensor) -> bool:
    return rows.dtype == torch.uint8


def _check(q: torch.Tensor, rows: torch.Tensor, indices: torch.Tensor,
           out: Optional[torch.Tensor]) -> None:
    """Metadata checks shared by every implementation (shapes, dtypes, devices)."""
    if q.dim() != 3 or q.shape[2] != ROW:
        raise ValueError(f"sparse_mla_decode: q must be [B, H, {ROW}], got {tuple(q.shape)}")
    if q.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"sparse_mla_decode: q must be bf16, fp16 or fp32, got {q.dtype}")
    if _is_fp8_rows(rows):
        if rows.dim() != 2 or rows.shape[1] != FP8_ROW_BYTES:
            raise ValueError(f"sparse_mla_decode: uint8 rows are FP8 rows [N, {FP8_ROW_BYTES}], "
                             f"got {tuple(rows.shape)}")
        if q.dtype != torch.bfloat16:
            raise TypeError(f"sparse_mla_decode: FP8 rows need a bf16 q, got {q.dtype}")
        if rows.stride(0) % 16 or rows.data_ptr() % 16:
            raise ValueError("sparse_mla_decode: FP8 rows must start 16-byte aligned, with a "
                             "row stride that is a multiple of 16 bytes")
    else:
        if rows.dim() != 2 or rows.shape[1] != ROW:
            raise ValueError(f"sparse_mla_decode: rows must be [N, {ROW}] (or uint8 "
                             f"[N, {FP8_ROW_BYTES}] FP8 rows), got {tuple(rows.shape)}")
        if rows.dtype != q.dtype:
            raise TypeError(f"sparse_mla_decode: rows ({rows.dtype}) and q ({q.dtype}) must "
                            f"have one dtype")
    if rows.stride(1) != 1:
        raise ValueError("sparse_mla_decode: rows must have unit stride along a row")
    if indices.dtype != torch.int32 or indices.dim() != 2 or indices.shape[0] != q.shape[0]:
        raise ValueError(f"sparse_mla_decode: indices must be int32 [B, K] with B = "
                         f"{q.shape[0]}, got {indices.dtype} {tuple(indices.shape)}")
    if not (q.device == rows.device == indices.device):
        raise ValueError(f"sparse_mla_decode: q, rows and indices must be on one device, got "
                         f"{q.device}, {rows.device}, {indices.device}")
    if out is not None:
        want = (q.shape[0], q.shape[1], LATENT)
        if (tuple(out.shape) != want or out.dtype != q.dtype or out.device != q.device
                or out.stride(2) != 1):
            raise ValueError(f"sparse_mla_decode: out must be {q.dtype} {list(want)} on "
                             f"{q.device} with unit stride along a row, got {out.dtype} "
                             f"{list(out.shape)} on {out.device}")


def dequantize_fp8_rows(rows: torch.Tensor) -> torch.Tensor:
    """FP8 rows uint8 ``[N, 656]`` -> bf16 ``[N, 576]``: latent ``fp8 -> fp32``, times its
    group's fp32 scale, rounded once to bf16; rope copied. The kernel's FP8 path computes the
    same values (this is its definition)."""
    if rows.dtype != torch.uint8 or rows.dim() != 2 or rows.shape[1] != FP8_ROW_BYTES:
        raise ValueError(f"dequantize_fp8_rows: expected uint8 [N, {FP8_ROW_BYTES}], got "
                         f"{rows.dtype} {tuple(rows.shape)}")
    values = rows[:, :LATENT].view(torch.float8_e4m3fn).float()
    scales = rows[:, LATENT:LATENT + 4 * _FP8_SCALES].view(torch.float32)
    latent = (values.view(-1, _FP8_SCALES, FP8_GROUP) * scales[:, :, None]).view(-1, LATENT)
    rope = rows[:, LATENT + 4 * _FP8_SCALES:].view(torch.bfloat16)
    return torch.cat([latent.to(torch.bfloat16), rope], dim=1)


def quantize_fp8_rows(rows: torch.Tensor) -> torch.Tensor:
    """bf16 (or fp32) rows ``[N, 576]`` -> FP8 rows uint8 ``[N, 656]``: per 128 latent values
    the scale ``amax / 448`` (1 where the group is all zeros), the values divided by it and
    rounded to float8_e4m3fn; the rope part kept in bf16."""
    if rows.dim() != 2 or rows.shape[1] != ROW:
        raise ValueError(f"quantize_fp8_rows: expected [N, {ROW}], got {tuple(rows.shape)}")
    latent = rows[:, :LATENT].float().view(-1, _FP8_SCALES, FP8_GROUP)
    amax = latent.abs().amax(dim=2)
    scales = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    values = (latent / scales[:, :, None]).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    out = torch.empty(rows.shape[0], FP8_ROW_BYTES, dtype=torch.uint8, device=rows.device)
    out[:, :LATENT] = values.view(-1, LATENT).view(torch.uint8)
    out[:, LATENT:LATENT + 4 * _FP8_SCALES] = scales.contiguous().view(torch.uint8)
    out[:, LATENT + 4 * _FP8_SCALES:] = rows[:, LATENT:].to(torch.bfloat16).contiguous().view(
        torch.uint8)
    return out


def tolerance(dtype: torch.dtype) -> tuple[float, float]:
    """``(atol, rtol)`` within which the Triton kernel's output in ``dtype`` (q's) agrees with
    the reference computed in fp32 from the same inputs, elementwise ``|got - ref| <= atol +
    rtol * |ref|``. bf16: the output's rounding (half an ulp is 2^-9 relative) plus the
    probabilities' rounding to bf16 before ``P . V`` (2^-9 of a weighted mean of the rows,
    about 2e-3 for unit-variance rows); fp16 has 3 more bits; fp32: summation order and
    ``exp2``. FP8 rows are compared through ``dequantize_fp8_rows`` with bf16's tolerance."""
    if dtype == torch.float32:
        return 1e-5, 1e-5
    if dtype == torch.float16:
        return 1e-3, 5e-3
    return 5e-3, 2e-2


def _gather(rows: torch.Tensor, entries: torch.Tensor) -> torch.Tensor:
    """The rows at ``entries`` (int64, any shape) in fp32 ``[..., 576]``; FP8 rows gathered
    first, then dequantised (only the selected ones)."""
    if _is_fp8_rows(rows):
        picked = dequantize_fp8_rows(rows[entries.reshape(-1)])
        return picked.float().view(*entries.shape, ROW)
    return rows[entries].float()


# ---------------------------------------------------------------------------------------------
# torch: the reference (the definition) and the fallback
# ---------------------------------------------------------------------------------------------

def sparse_mla_decode_reference(q: torch.Tensor, rows: torch.Tensor, indices: torch.Tensor,
                                scale: float, out: Optional[torch.Tensor] = None
                                ) -> torch.Tensor:
    """The semantics, written plainly: per request, the rows of its valid (non-negative)
    entries, in fp32, ``softmax(q . kv^T * scale) . kv[:, :512]``; zeros where a request has no
    valid entry. Same signature and contract as ``sparse_mla_decode``. Slow (a Python loop over
    requests and a host synchronisation per request); for tests."""
    _check(q, rows, indices, out)
    result = torch.zeros(q.shape[0], q.shape[1], LATENT, dtype=torch.float32, device=q.device)
    for b in range(q.shape[0]):
        entries = indices[b]
        entries = entries[entries >= 0].long()
        if entries.numel() == 0:
            continue
        kv = _gather(rows, entries)  # [k, 576]
        scores = torch.matmul(q[b].float(), kv.t()) * scale  # [H, k]
        result[b] = torch.matmul(torch.softmax(scores, dim=-1), kv[:, :LATENT])
    if out is None:
        return result.to(q.dtype)
    return out.copy_(result)


def sparse_mla_decode_torch(q: torch.Tensor, rows: torch.Tensor, indices: torch.Tensor,
                            scale: float, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The torch implementation ``sparse_mla_decode`` uses on the CPU or without triton: the
    reference's operations over the whole batch at once (padding masked to ``-inf``, rows
    without a valid entry zeroed), fp32, no host synchronisation. It materialises the gathered
    rows (``B * K * 576`` fp32), which is fine for CPU shapes."""
    _check(q, rows, indices, out)
    valid = indices >= 0  # [B, K]
    kv = _gather(rows, indices.clamp(min=0).long())  # [B, K, 576]
    scores = torch.matmul(q.float(), kv.transpose(1, 2)) * scale  # [B, H, K]
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    probs = probs.masked_fill(~valid.any(dim=1)[:, None, None], 0.0)  # all padding: NaN -> 0
    result = torch.matmul(probs, kv[..., :LATENT])
    if out is None:
        return result.to(q.dtype)
    return out.copy_(result)


# ---------------------------------------------------------------------------------------------
# Triton: imported and compiled on first use
# ---------------------------------------------------------------------------------------------

triton = None  # the modules, bound by _triton_kernels() on first use
tl = None
_KERNELS = None
_LOG2E = 1.4426950408889634


def triton_available() -> bool:
    """Whether the Triton path can run here (``triton`` imports)."""
    try:
        _triton_kernels()
    except ImportError:
        return False
    return True


# The kernels below are plain functions until _triton_kernels() imports triton and wraps each in
# triton.jit (replacing the module global, which is how the kernels find their helpers); the
# annotations stay strings (``from __future__ import annotations``) and Triton reads
# "constexpr" from them.

def _load_latent(rows_ptr, row, valid, stride_row, col0, WIDTH: tl.constexpr,
                 BLOCK_N: tl.constexpr, D_V: tl.constexpr, FP8: tl.constexpr,
                 DTYPE: tl.constexpr):
    """Latent columns ``[col0, col0 + WIDTH)`` of the tile's rows ``[BLOCK_N, WIDTH]`` in the
    compute dtype, zeros for padding. FP8 rows (``rows_ptr`` their float8 view, strides in
    bytes) are dequantised here: fp8 -> fp32, times the row's float32 scale of each 128-value
    group (bytes ``D_V ..``), rounded once to bf16 (``dequantize_fp8_rows``)."""
    base = rows_ptr + row * stride_row
    cols = col0 + tl.arange(0, WIDTH)
    values = tl.load(base[:, None] + cols[None, :], mask=valid[:, None], other=0.0)
    if FP8:
        scale_ptr = (base + D_V).to(tl.pointer_type(tl.float32), bitcast=True)
        groups = col0 // 128 + tl.arange(0, WIDTH // 128)
        scales = tl.load(scale_ptr[:, None] + groups[None, :], mask=valid[:, None], other=0.0)
        grouped = tl.reshape(values.to(tl.float32), (BLOCK_N, WIDTH // 128, 128))
        values = tl.reshape(grouped * scales[:, :, None], (BLOCK_N, WIDTH)).to(DTYPE)
    return values


def _load_rope(rows_ptr, row, valid, stride_row, D_V: tl.constexpr, D_R: tl.constexpr,
               FP8: tl.constexpr):
    """The rope part ``[BLOCK_N, D_R]`` of the tile's rows (bf16 after the scales in FP8
    rows), zeros for padding."""
    base = rows_ptr + row * stride_row
    if FP8:
        rope_ptr = (base + D_V + 4 * (D_V // 128)).to(tl.pointer_type(tl.bfloat16), bitcast=True)
    else:
        rope_ptr = base + D_V
    return tl.load(rope_ptr[:, None] + tl.arange(0, D_R)[None, :], mask=valid[:, None],
                   other=0.0)


def _load_entries(idx_row, tile, end, BLOCK_N: tl.constexpr):
    """Tile ``tile``'s entries: ``BLOCK_N`` of them, -1 (padding) from position ``end`` on."""
    offs = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    return tl.load(idx_row + offs, mask=offs < end, other=-1)


def _gather_rows(rows_ptr, entry, stride_row, out0, other0, D_V: tl.constexpr,
                 D_R: tl.constexpr, BLOCK_N: tl.constexpr, DV_SPLIT: tl.constexpr,
                 FP8: tl.constexpr, DTYPE: tl.constexpr):
    """The rows of a tile's entries: ``(valid, latent, other, rope)``; ``latent`` the
    ``D_V / DV_SPLIT`` columns this program writes, ``other`` the other half (``DV_SPLIT`` 2;
    else ``rope`` again, unused)."""
    valid = entry >= 0
    row = tl.where(valid, entry, 0).to(tl.int64)
    latent = _load_latent(rows_ptr, row, valid, stride_row, out0, D_V // DV_SPLIT, BLOCK_N, D_V,
                          FP8, DTYPE)
    rope = _load_rope(rows_ptr, row, valid, stride_row, D_V, D_R, FP8)
    if DV_SPLIT == 2:
        other = _load_latent(rows_ptr, row, valid, stride_row, other0, D_V // DV_SPLIT, BLOCK_N,
                             D_V, FP8, DTYPE)
    else:
        other = rope
    return valid, latent, other, rope


def _attend_tile(q_out, q_other, q_rope, valid, latent, other, rope, m_i, l_i, acc,
                 scale_log2, DV_SPLIT: tl.constexpr, IEEE: tl.constexpr):
    """One tile of the online softmax: scores over all 576 columns, the running max ``m_i``
    and sum ``l_i`` (base 2), ``acc += P . latent``. Returns ``(m_i, l_i, acc)``."""
    if IEEE:
        scores = tl.dot(q_out, tl.trans(latent), input_precision="ieee")
        if DV_SPLIT == 2:
            scores = tl.dot(q_other, tl.trans(other), scores, input_precision="ieee")
        scores = tl.dot(q_rope, tl.trans(rope), scores, input_precision="ieee")
    else:
        scores = tl.dot(q_out, tl.trans(latent))
        if DV_SPLIT == 2:
            scores = tl.dot(q_other, tl.trans(other), scores)
        scores = tl.dot(q_rope, tl.trans(rope), scores)
    scores = tl.where(valid[None, :], scores * scale_log2, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no valid entry yet: no NaN
    alpha = tl.math.exp2(m_i - m_safe)
    p = tl.math.exp2(scores - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None]
    if IEEE:
        acc = tl.dot(p.to(latent.dtype), latent, acc, input_precision="ieee")
    else:
        acc = tl.dot(p.to(latent.dtype), latent, acc)
    return m_new, l_i, acc


def _split_kernel(q_ptr, rows_ptr, idx_ptr, out_ptr, part_o_ptr, part_lse_ptr,
                  scale_log2, H, K, tiles_per_split,
                  stride_qb, stride_qh, stride_row,
                  stride_ib, stride_ob, stride_oh, stride_pb, stride_ps, stride_ph,
                  D_V: tl.constexpr, D_R: tl.constexpr,
                  BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, DV_SPLIT: tl.constexpr,
                  PREFETCH: tl.constexpr, DIRECT: tl.constexpr, FP8: tl.constexpr,
                  IEEE: tl.constexpr):
    """One (head tile x latent part, K split, request): online softmax over the split's tiles
    of selected rows. With ``DV_SPLIT == 2`` a program computes the scores over all 576
    columns but the output of one half of the latent (256 columns), so its accumulator is half
    the size; the two halves' programs are neighbours in the grid and share the rows through
    L2. ``PREFETCH``: the next tile's rows are gathered into registers before this tile's
    products (launch with ``num_stages=1``); otherwise Triton pipelines the gathers through
    shared memory (``num_stages`` > 1). ``DIRECT`` (one split): write the normalised output;
    otherwise the normalised fp32 partial and its base-2 log-sum-exp (``-inf`` where the
    split had no valid entry)."""
    DV_OUT: tl.constexpr = D_V // DV_SPLIT
    pid_hd = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_b = tl.program_id(2).to(tl.int64)
    pid_h = pid_hd // DV_SPLIT
    out0 = tl.multiple_of((pid_hd % DV_SPLIT) * DV_OUT, DV_OUT)  # first column it writes
    other0 = tl.multiple_of(DV_OUT - out0, DV_OUT)  # DV_SPLIT == 2: the other half (scores)
    heads = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    head_ok = heads < H
    dv = tl.arange(0, DV_OUT)
    dr = tl.arange(0, D_R)
    q_rows = q_ptr + pid_b * stride_qb + heads[:, None] * stride_qh
    q_out = tl.load(q_rows + out0 + dv[None, :], mask=head_ok[:, None], other=0.0)
    if DV_SPLIT == 2:
        q_other = tl.load(q_rows + other0 + dv[None, :], mask=head_ok[:, None], other=0.0)
    else:
        q_other = q_out  # unused
    q_rope = tl.load(q_rows + D_V + dr[None, :], mask=head_ok[:, None], other=0.0)
    dtype = q_out.dtype

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, DV_OUT], tl.float32)
    idx_row = idx_ptr + pid_b * stride_ib
    first = pid_s * tiles_per_split
    last = first + tiles_per_split  # the host sizes splits to cover K; tiles past K are padding
    if PREFETCH:  # entries two tiles ahead, rows one tile ahead, in registers
        entry = _load_entries(idx_row, first, K, BLOCK_N)
        valid_n, latent_n, other_n, rope_n = _gather_rows(
            rows_ptr, entry, stride_row, out0, other0, D_V, D_R, BLOCK_N, DV_SPLIT, FP8, dtype)
        entry = _load_entries(idx_row, first + 1, tl.where(first + 1 < last, K, 0), BLOCK_N)
        for tile in range(first, last):
            valid, latent, other, rope = valid_n, latent_n, other_n, rope_n
            # the next tile's gathers (their entries are already here) and the entries after
            # it go out now and land during this tile's products
            valid_n, latent_n, other_n, rope_n = _gather_rows(
                rows_ptr, entry, stride_row, out0, other0, D_V, D_R, BLOCK_N, DV_SPLIT, FP8,
                dtype)
            entry = _load_entries(idx_row, tile + 2, tl.where(tile + 2 < last, K, 0), BLOCK_N)
            m_i, l_i, acc = _attend_tile(q_out, q_other, q_rope, valid, latent, other, rope,
                                         m_i, l_i, acc, scale_log2, DV_SPLIT, IEEE)
    else:
        for tile in range(first, last):
            entry = _load_entries(idx_row, tile, K, BLOCK_N)
            valid, latent, other, rope = _gather_rows(
                rows_ptr, entry, stride_row, out0, other0, D_V, D_R, BLOCK_N, DV_SPLIT, FP8,
                dtype)
            m_i, l_i, acc = _attend_tile(q_out, q_other, q_rope, valid, latent, other, rope,
                                         m_i, l_i, acc, scale_log2, DV_SPLIT, IEEE)

    has = l_i > 0.0
    result = acc / tl.where(has, l_i, 1.0)[:, None]  # zeros where nothing was valid
    cols = out0 + dv
    if DIRECT:
        out_rows = out_ptr + pid_b * stride_ob + heads[:, None] * stride_oh + cols[None, :]
        tl.store(out_rows, result.to(out_ptr.dtype.element_ty), mask=head_ok[:, None])
    else:
        part = part_o_ptr + pid_b * stride_pb + pid_s * stride_ps
        tl.store(part + heads[:, None] * stride_ph + cols[None, :], result,
                 mask=head_ok[:, None])
        if out0 == 0:  # one writer of the log-sum-exp per head
            lse = tl.where(has, m_i + tl.math.log2(tl.where(has, l_i, 1.0)), float("-inf"))
            tl.store(part_lse_ptr + (pid_b * tl.num_programs(1) + pid_s) * H + heads, lse,
                     mask=head_ok)


def _combine_kernel(part_o_ptr, part_lse_ptr, out_ptr, H, num_splits,
                    stride_pb, stride_ps, stride_ph, stride_ob, stride_oh,
                    D_V: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                    SPLITS: tl.constexpr):
    """out = sum_s w_s o_s / sum_s w_s with w_s = 2^(lse_s - max lse): one (latent slice, head
    tile, request) per program; zeros where every split was empty."""
    pid_d = tl.program_id(0)
    pid_h = tl.program_id(1)
    pid_b = tl.program_id(2).to(tl.int64)
    heads = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    head_ok = heads < H
    cols = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    splits = tl.arange(0, SPLITS)
    lse_rows = part_lse_ptr + pid_b * num_splits * H
    lse = tl.load(lse_rows + splits[:, None] * H + heads[None, :],
                  mask=(splits[:, None] < num_splits) & head_ok[None, :], other=float("-inf"))
    top = tl.max(lse, axis=0)
    top = tl.where(top == float("-inf"), 0.0, top)
    total = tl.sum(tl.math.exp2(lse - top[None, :]), axis=0)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for s in range(num_splits):
        weight = tl.math.exp2(tl.load(lse_rows + s * H + heads, mask=head_ok,
                                      other=float("-inf")) - top)
        part = tl.load(part_o_ptr + pid_b * stride_pb + s * stride_ps
                       + heads[:, None] * stride_ph + cols[None, :],
                       mask=head_ok[:, None], other=0.0)
        acc += weight[:, None] * part
    result = acc / tl.where(total > 0.0, total, 1.0)[:, None]
    tl.store(out_ptr + pid_b * stride_ob + heads[:, None] * stride_oh + cols[None, :],
             result.to(out_ptr.dtype.element_ty), mask=head_ok[:, None])


_JIT_FUNCTIONS = ("_load_latent", "_load_rope", "_load_entries", "_gather_rows",
                  "_attend_tile", "_split_kernel", "_combine_kernel")


def _triton_kernels():
    """Import triton (ImportError if it is missing) and wrap the kernels, once."""
    global triton, tl, _KERNELS
    if _KERNELS is None:
        import triton as _triton
        import triton.language as _tl
        triton, tl = _triton, _tl
        module = globals()
        for name in _JIT_FUNCTIONS:
            module[name] = triton.jit(module[name])
        _KERNELS = (module["_split_kernel"], module["_combine_kernel"])
    return _KERNELS


_SM_COUNT: dict = {}


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # the interpreter (TRITON_INTERPRET=1 on CPU tensors): an H100's count
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNT[index]


#: Launch configurations that fit an H100's shared memory (227 KB), checked by compiling for
#: sm_90 with Triton 3.6; ``benchmarks/bench_attn.py --sweep`` times each. ``block_h`` heads
#: and ``block_n`` selected rows a tile; ``dv_split`` 2: two programs a head tile, each writing
#: 256 of the 512 latent columns (half the fp32 accumulator, at the price of both computing the
#: scores); ``num_stages``: Triton's pipelining of the gathers through shared memory (3: rows
#: one tile ahead, 5: two tiles ahead; Triton issues them after the tile's products);
#: ``prefetch``: instead, the next tile's rows are gathered into registers before this tile's
#: products (``num_stages`` 1). Registers (255 a thread at most): no spills, except the ``-pf``
#: ones (``h128-n16``: 40 bytes with one split; ``h128-n32``: 56 to 128 bytes) and
#: ``h64-n64-w8-s2`` on FP8 rows with one split (24 bytes).
CANDIDATE_CONFIGS = {
    "h128-n32-dv2-w8-s3": {"block_h": 128, "block_n": 32, "dv_split": 2, "num_warps": 8,
                           "num_stages": 3, "prefetch": False},
    "h128-n32-dv2-w8-s2": {"block_h": 128, "block_n": 32, "dv_split": 2, "num_warps": 8,
                           "num_stages": 2, "prefetch": False},
    "h128-n16-dv2-w8-pf": {"block_h": 128, "block_n": 16, "dv_split": 2, "num_warps": 8,
                           "num_stages": 1, "prefetch": True},
    "h128-n32-dv2-w8-pf": {"block_h": 128, "block_n": 32, "dv_split": 2, "num_warps": 8,
                           "num_stages": 1, "prefetch": True},
    "h64-n64-w8-s2": {"block_h": 64, "block_n": 64, "dv_split": 1, "num_warps": 8,
                      "num_stages": 2, "prefetch": False},
    "h64-n32-dv2-w4-s5": {"block_h": 64, "block_n": 32, "dv_split": 2, "num_warps": 4,
                          "num_stages": 5, "prefetch": False},
}


def default_config(batch: int, heads: int, k: int, device: torch.device,
                   dtype: torch.dtype = torch.bfloat16) -> dict:
    """The launch configuration for a shape (a copy; see ``CANDIDATE_CONFIGS`` for the keys),
    with ``splits`` of K: enough programs to fill the SMs once, at least one tile per split.
    fp32 (exactness runs) takes small tiles: its ``tl.dot`` runs on FMA units, not tensor
    cores."""
    if dtype == torch.float32:
        cfg = {"block_h": 16, "block_n": 16, "dv_split": 2, "num_warps": 4, "num_stages": 1,
               "prefetch": False}
    elif heads > 64:
        cfg = dict(CANDIDATE_CONFIGS["h128-n32-dv2-w8-s3"])
    elif heads > 32:
        cfg = dict(CANDIDATE_CONFIGS["h64-n32-dv2-w4-s5"])
    else:  # below 64 heads a tile is too short for wgmma: Triton uses mma.sync
        cfg = {"block_h": max(16, _next_pow2(heads)), "block_n": 32, "dv_split": 2,
               "num_warps": 4, "num_stages": 3, "prefetch": False}
    cfg["splits"] = _default_splits(batch, heads, k, cfg, device)
    return cfg


# Each split writes an fp32 partial of H x 512 per request (256 KB at 128 heads) that the combine
# reads back: at 64 splits that is 7x the selected rows' 2.4 MB, so splits stop at 32.
_MAX_SPLITS = 32


def _default_splits(batch: int, heads: int, k: int, cfg: dict, device: torch.device) -> int:
    tiles = max(1, -(-k // cfg["block_n"]))
    programs = -(-heads // cfg["block_h"]) * cfg["dv_split"] * batch
    return max(1, min(tiles, _MAX_SPLITS, round(_sm_count(device) / programs)))


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def sparse_mla_decode_triton(q: torch.Tensor, rows: torch.Tensor, indices: torch.Tensor,
                             scale: float, out: Optional[torch.Tensor] = None,
                             config: Optional[dict] = None) -> torch.Tensor:
    """The Triton kernel (see the module docstring); ``config`` overrides entries of
    ``default_config`` (``block_h``, ``block_n``, ``dv_split``, ``prefetch``, ``splits``,
    ``num_warps``, ``num_stages``; a config without ``splits`` gets the default count for its
    tiles).
    CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1``. Allocates the split partials
    (fp32 ``[B, splits, H, 512]`` and ``[B, splits, H]``) when there is more than one split;
    no host synchronisation, so it can be captured in a CUDA graph."""
    _check(q, rows, indices, out)
    split_kernel, combine_kernel = _triton_kernels()
    B, H, _ = q.shape
    K = indices.shape[1]
    if out is None:
        out = torch.empty(B, H, LATENT, dtype=q.dtype, device=q.device)
    if B == 0 or H == 0:
        return out
    if q.stride(2) != 1:
        q = q.contiguous()
    if indices.stride(1) != 1:
        indices = indices.contiguous()
    cfg = default_config(B, H, K, q.device, q.dtype)
    cfg.update(config or {})
    if config and "splits" not in config:
        cfg["splits"] = _default_splits(B, H, K, cfg, q.device)
    block_h, block_n, dv_split = cfg["block_h"], cfg["block_n"], cfg["dv_split"]
    if dv_split not in (1, 2):
        raise ValueError(f"sparse_mla_decode_triton: dv_split must be 1 or 2, got {dv_split}")
    tiles = max(1, -(-K // block_n))
    tiles_per_split = -(-tiles // max(1, min(cfg["splits"], tiles)))
    splits = -(-tiles // tiles_per_split)  # no empty split
    fp8 = _is_fp8_rows(rows)
    rows_data = rows.view(torch.float8_e4m3fn) if fp8 else rows  # FP8: strides in bytes
    direct = splits == 1
    if direct:
        part_o = part_lse = out  # not read
        part_strides = (0, 0, 0)
    else:
        part_o = torch.empty(B, splits, H, LATENT, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(B, splits, H, dtype=torch.float32, device=q.device)
        part_strides = (part_o.stride(0), part_o.stride(1), part_o.stride(2))
    grid = (-(-H // block_h) * dv_split, splits, B)
    split_kernel[grid](
        q, rows_data, indices, out, part_o, part_lse,
        float(scale) * _LOG2E, H, K, tiles_per_split,
        q.stride(0), q.stride(1), rows_data.stride(0),
        indices.stride(0), out.stride(0), out.stride(1), *part_strides,
        D_V=LATENT, D_R=ROPE, BLOCK_H=block_h, BLOCK_N=block_n, DV_SPLIT=dv_split,
        PREFETCH=bool(cfg.get("prefetch", False)), DIRECT=direct, FP8=fp8,
        IEEE=q.dtype == torch.float32,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    if not direct:
        block_hc, block_d = 4, 128
        combine_kernel[(LATENT // block_d, -(-H // block_hc), B)](
            part_o, part_lse, out, H, splits, *part_strides, out.stride(0), out.stride(1),
            D_V=LATENT, BLOCK_H=block_hc, BLOCK_D=block_d, SPLITS=_next_pow2(splits),
            num_warps=4, num_stages=1)
    return out


def sparse_mla_decode(q: torch.Tensor, rows: torch.Tensor, indices: torch.Tensor, scale: float,
                      out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Sparse MLA decode attention (see the module docstring for the contract): the Triton
    kernel for CUDA tensors when ``triton`` imports, else ``sparse_mla_decode_torch``.
    Writes into ``out`` (``[B, H, 512]`` in ``q``'s dtype) when given and returns it."""
    if q.is_cuda and triton_available():
        return sparse_mla_decode_triton(q, rows, indices, scale, out)
    return sparse_mla_decode_torch(q, rows, indices, scale, out)
