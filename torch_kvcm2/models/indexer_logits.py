"""The DSA indexer's decode logits over a paged pool of FP8 keys (P-SERVE's indexer).

DeepSeek-V3.2's lightning indexer scores every token of a request's history for one query
token, and the top-K of those scores is what sparse attention reads::

    logits[r, t] = sum_h weights[r, h] * relu(q[r, h, :] . k_t)      for t < lengths[r]
                 = -inf                                              otherwise

* ``q`` bf16 ``[R, H, 128]``: the indexer's query (``wq_b`` of the query LoRA's output; H = 64
  heads in the real model);
* ``weights`` fp32 ``[R, H]``: the per-head weights (``weights_proj(x) * H^-0.5``) times the
  softmax scale ``128^-0.5``, folded by the caller (transformers applies the scale to the dot
  product; relu commutes with a positive factor, so the logits are the same);
* ``k_t`` the key of token ``t``: token ``t % P`` of page ``page_table[r, t // P]`` of ``keys``
  ``uint8[pages, P, 132]`` (a page's ``P * 132`` bytes contiguous, any stride between pages),
  laid out as ``layout`` says (below);
* ``lengths`` ``[R]``: each request's history length; columns from it on are ``-inf`` and read
  nothing (their page-table entries may be anything).

The result is fp32 ``[R, npages * P]`` with ``npages = page_table.shape[1]``.

FP8 keys (the format DeepSeek-V3.2's engines keep the indexer's cache in, 132 bytes a token):
128 float8_e4m3fn values and one float32 scale, ``k_t = fp8 * scale``. Two layouts of a page:

* ``"token"``: token by token, each token's 128 values then its scale (row ``i`` of the
  ``[P, 132]`` page is token ``i``): what ``quantize_index_keys`` returns, one row a token;
* ``"page"``: the page's ``P x 128`` values first (token ``i`` at bytes ``128 i``), then its
  ``P`` scales (token ``i``'s at ``128 P + 4 i``): the layout the engines' paged FP8 MQA-logits
  kernels read (DeepGEMM's ``fp8_paged_mqa_logits``, with pages of 64), whose values are 16-byte
  aligned; ``to_page_layout`` converts a pool of the first into the second.

The kernel computes ``relu(scale * (q . fp8))`` with the FP8 values converted exactly to bf16
and the products accumulated in fp32. ``quantize_index_keys`` writes a key (scale
``amax / 448``).

Dispatch: ``indexer_logits`` runs the Triton kernel on CUDA tensors when ``triton`` imports
(and on CPU tensors under ``TRITON_INTERPRET=1``, as the tests do), else ``indexer_logits_torch``
(vectorised over rows, no host synchronisation). ``indexer_logits_reference`` is the definition,
one request at a time, in fp32. Triton is imported on first use.

The Triton kernel (``DEFAULT_CONFIG``): one program per (block of pages, request); it loads the request's query
``[H, 128]`` once, then for each page of its block gathers the page's 64 keys ``[64, 128]`` (the
FP8 bytes bitcast and converted to bf16 in registers; in the page layout 16-byte loads, in the
token layout 4-byte ones, a row of 132 bytes being 4-byte aligned), scores them with one ``tl.dot``
(``[H, 128] x [128, 64]``, fp32 accumulate), applies the keys' scales and relu, and reduces
over heads with the weights. Pages past the request's length load nothing.
"""
from __future__ import annotations

import os
from typing import Optional

import torch

INDEX_DIM = 128  # the indexer's head dim
KEY_BYTES = INDEX_DIM + 4  # 128 float8_e4m3fn + one float32 scale
_FP8_MAX = 448.0

LAYOUTS = ("token", "page")

__all__ = ["INDEX_DIM", "KEY_BYTES", "LAYOUTS", "dequantize_index_keys", "indexer_logits",
           "indexer_logits_reference", "indexer_logits_torch", "quantize_index_keys",
           "to_page_layout"]


def quantize_index_keys(keys: torch.Tensor) -> torch.Tensor:
    """bf16 or fp32 keys ``[N, 128]`` -> FP8 keys uint8 ``[N, 132]``: the scale ``amax / 448``
    (1 for an all-zero key), the values divided by it and rounded to float8_e4m3fn."""
    if keys.dim() != 2 or keys.shape[1] != INDEX_DIM:
        raise ValueError(f"quantize_index_keys: expected [N, {INDEX_DIM}], got {tuple(keys.shape)}")
    k = keys.float()
    amax = k.abs().amax(dim=1, keepdim=True)
    scale = torch.where(amax > 0, amax / _FP8_MAX, torch.ones_like(amax))
    out = torch.empty(k.shape[0], KEY_BYTES, dtype=torch.uint8, device=k.device)
    out[:, :INDEX_DIM] = (k / scale).clamp(-_FP8_MAX, _FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    out[:, INDEX_DIM:] = scale.contiguous().view(torch.uint8)
    return out


def dequantize_index_keys(keys: torch.Tensor) -> torch.Tensor:
    """FP8 keys uint8 ``[..., 132]`` -> fp32 ``[..., 128]``: ``fp8 * scale``."""
    if keys.dtype != torch.uint8 or keys.shape[-1] != KEY_BYTES:
        raise ValueError(f"dequantize_index_keys: expected uint8 [..., {KEY_BYTES}], got "
                         f"{keys.dtype} {tuple(keys.shape)}")
    values = keys[..., :INDEX_DIM].contiguous().view(torch.float8_e4m3fn).float()
    return values * keys[..., INDEX_DIM:].contiguous().view(torch.float32)


def to_page_layout(keys: torch.Tensor) -> torch.Tensor:
    """A pool of FP8 keys ``uint8[pages, P, 132]`` in the ``"token"`` layout -> the same keys in
    the ``"page"`` layout (a new tensor of the same shape)."""
    n, P = keys.shape[:2]
    return torch.cat([keys[..., :INDEX_DIM].reshape(n, P * INDEX_DIM),
                      keys[..., INDEX_DIM:].reshape(n, P * 4)], dim=1).view(n, P, KEY_BYTES)


def _gather_keys(keys: torch.Tensor, page: torch.Tensor, token: torch.Tensor,
                 layout: str) -> torch.Tensor:
    """uint8[..., 132]: the token-layout bytes of the keys of tokens ``token`` of pages
    ``page`` (int64, broadcast)."""
    if layout == "token":
        return keys[page, token]
    P = keys.shape[1]
    flat = keys.flatten(1)  # a page's bytes
    values = flat[page[..., None], token[..., None] * INDEX_DIM + torch.arange(INDEX_DIM, device=keys.device)]
    scale = flat[page[..., None], P * INDEX_DIM + token[..., None] * 4 + torch.arange(4, device=keys.device)]
    return torch.cat([values, scale], dim=-1)


def _check(q, weights, keys, page_table, lengths, out, layout="token") -> tuple:
    """Shapes, dtypes and devices every implementation accepts; returns (R, H, P, npages)."""
    if q.dim() != 3 or q.shape[2] != INDEX_DIM or q.dtype != torch.bfloat16:
        raise ValueError(f"indexer_logits: q must be bf16 [R, H, {INDEX_DIM}], got {q.dtype} "
                         f"{tuple(q.shape)}")
    R, H = q.shape[:2]
    if weights.shape != (R, H) or weights.dtype != torch.float32:
        raise ValueError(f"indexer_logits: weights must be fp32 [{R}, {H}], got {weights.dtype} "
                         f"{tuple(weights.shape)}")
    if keys.dtype != torch.uint8 or keys.dim() != 3 or keys.shape[2] != KEY_BYTES:
        raise ValueError(f"indexer_logits: keys must be uint8 [pages, P, {KEY_BYTES}], got "
                         f"{keys.dtype} {tuple(keys.shape)}")
    if keys.stride(2) != 1 or keys.stride(1) != KEY_BYTES:
        raise ValueError("indexer_logits: a page's keys must be contiguous rows of "
                         f"{KEY_BYTES} bytes")
    if layout not in LAYOUTS:
        raise ValueError(f"indexer_logits: layout must be one of {LAYOUTS}, got {layout!r}")
    if weights.stride(1) != 1:
        raise ValueError("indexer_logits: weights must have unit stride along a row")
    if page_table.dim() != 2 or page_table.shape[0] != R or page_table.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"indexer_logits: page_table must be int32/int64 [{R}, npages], got "
                         f"{page_table.dtype} {tuple(page_table.shape)}")
    if lengths.shape != (R,) or lengths.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"indexer_logits: lengths must be int32/int64 [{R}], got "
                         f"{lengths.dtype} {tuple(lengths.shape)}")
    if len({t.device for t in (q, weights, keys, page_table, lengths)}) != 1:
        raise ValueError("indexer_logits: every tensor must be on one device")
    P, npages = keys.shape[1], page_table.shape[1]
    if out is not None and (out.shape != (R, npages * P) or out.dtype != torch.float32
                            or out.device != q.device or out.stride(1) != 1):
        raise ValueError(f"indexer_logits: out must be fp32 [{R}, {npages * P}] on {q.device} "
                         f"with contiguous rows, got {out.dtype} {tuple(out.shape)}")
    return R, H, P, npages


def indexer_logits_reference(q, weights, keys, page_table, lengths, out=None,
                             layout: str = "token") -> torch.Tensor:
    """The definition (module docstring), one request at a time in fp32; slow, for tests."""
    R, H, P, npages = _check(q, weights, keys, page_table, lengths, out, layout)
    result = torch.full((R, npages * P), float("-inf"), dtype=torch.float32, device=q.device)
    for r in range(R):
        n = int(lengths[r])
        t = torch.arange(n, device=q.device)
        k = dequantize_index_keys(_gather_keys(keys, page_table[r, t // P].long(), t % P, layout))
        scores = torch.relu(q[r].float() @ k.t())  # [H, n]
        result[r, :n] = weights[r] @ scores
    return result if out is None else out.copy_(result)


def indexer_logits_torch(q, weights, keys, page_table, lengths, out=None,
                         layout: str = "token") -> torch.Tensor:
    """The definition over all rows at once (every page gathered, the dead columns masked); it
    materialises ``R * npages * P * 128`` fp32 keys, so it is for CPU shapes and GPUs without
    triton."""
    R, H, P, npages = _check(q, weights, keys, page_table, lengths, out, layout)
    t = torch.arange(npages * P, device=q.device)
    live = t[None, :] < lengths[:, None]
    pages = torch.where(live, page_table.long().repeat_interleave(P, dim=1), 0)
    k = dequantize_index_keys(_gather_keys(keys, pages, (t % P)[None, :], layout))  # [R, T, 128]
    scores = torch.relu(torch.matmul(q.float(), k.transpose(1, 2)))  # [R, H, T]
    result = torch.einsum("rh,rht->rt", weights, scores).masked_fill(~live, float("-inf"))
    return result if out is None else out.copy_(result)


# ---------------------------------------------------------------------------------------------
# Triton: imported and compiled on first use (as torch_kvcm2.models.sparse_mla)
# ---------------------------------------------------------------------------------------------

triton = None
tl = None
_KERNEL = None


def _logits_kernel(q, w, keys, page_table, lengths, out, npages, Q_R, Q_H, W_R, K_PAGE, PT_R,
                   O_R, H: tl.constexpr, H_PAD: tl.constexpr, P: tl.constexpr,
                   D: tl.constexpr, PAGES: tl.constexpr, PAGE_LAYOUT: tl.constexpr):
    block, r = tl.program_id(0), tl.program_id(1).to(tl.int64)
    length = tl.load(lengths + r)
    h = tl.arange(0, H_PAD)
    d = tl.arange(0, D)
    tok = tl.arange(0, P)
    qv = tl.load(q + r * Q_R + h[:, None] * Q_H + d[None, :], mask=h[:, None] < H, other=0.0)
    wv = tl.load(w + r * W_R + h, mask=h < H, other=0.0)
    for i in range(PAGES):
        pg = block * PAGES + i
        pos = pg * P + tok
        live = (pos < length) & (pg < npages)
        page = tl.load(page_table + r * PT_R + pg, mask=(pg < npages) & (pg * P < length), other=0)
        base = keys + page.to(tl.int64) * K_PAGE
        if PAGE_LAYOUT:  # the page's P x 128 values, then its P scales
            values = base + tok * D
            scales = base + P * D + tok * 4
        else:  # token by token: 128 values, then the scale
            values = base + tok * (D + 4)
            scales = values + D
        raw = tl.load(values[:, None] + d[None, :], mask=live[:, None], other=0)
        k = raw.to(tl.float8e4nv, bitcast=True).to(tl.bfloat16)  # exact
        scale = tl.load(scales.to(tl.pointer_type(tl.float32), bitcast=True), mask=live,
                        other=0.0)
        s = tl.dot(qv, tl.trans(k))  # [H_PAD, P] fp32
        s = tl.maximum(s * scale[None, :], 0.0)
        logits = tl.sum(s * wv[:, None], 0)
        tl.store(out + r * O_R + pos, tl.where(live, logits, float("-inf")), mask=pg < npages)


def _triton_kernel():
    global triton, tl, _KERNEL
    if _KERNEL is None:
        import triton as _triton
        import triton.language as _tl
        triton, tl = _triton, _tl
        globals()["_logits_kernel"] = _KERNEL = triton.jit(_logits_kernel)
    return _KERNEL


def _use_triton(q: torch.Tensor, P: int) -> bool:
    if q.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return False
    if P < 16 or P & (P - 1):  # tl.dot needs a power-of-two tile of at least 16
        return False
    try:
        _triton_kernel()
    except ImportError:
        return False
    return True


#: the launch: pages a program scores, its warps, Triton's pipeline stages. The fastest of
#: ``benchmarks/bench_indexer.py --sweep``'s 24 in the page layout at both contexts (H100,
#: 2026-12-07: 377 us for 116 rows at 32K, 0.46 of the HBM bound; 370 us for 30 rows at 128K;
#: the former default, 4 pages, 4 warps, 2 stages, took 459 and 454 us)
DEFAULT_CONFIG = {"pages": 8, "num_warps": 4, "num_stages": 1}


def indexer_logits(q, weights, keys, page_table, lengths, out: Optional[torch.Tensor] = None,
                   config: Optional[dict] = None, layout: str = "token") -> torch.Tensor:
    """The indexer's logits (module docstring) over keys in ``layout``: the Triton kernel where
    it can run, else ``indexer_logits_torch``. ``out`` is written when given (a captured
    graph's fixed output); ``config`` overrides entries of ``DEFAULT_CONFIG``."""
    R, H, P, npages = _check(q, weights, keys, page_table, lengths, out, layout)
    if not _use_triton(q, P):
        return indexer_logits_torch(q, weights, keys, page_table, lengths, out, layout)
    cfg = {**DEFAULT_CONFIG, **(config or {})}
    if q.stride(2) != 1:
        q = q.contiguous()
    if out is None:
        out = torch.empty(R, npages * P, dtype=torch.float32, device=q.device)
    if R and npages:
        grid = (-(-npages // cfg["pages"]), R)
        _logits_kernel[grid](q, weights, keys, page_table, lengths, out, npages, q.stride(0),
                             q.stride(1), weights.stride(0), keys.stride(0), page_table.stride(0),
                             out.stride(0), H=H, H_PAD=max(16, 1 << (H - 1).bit_length()), P=P,
                             D=INDEX_DIM, PAGES=cfg["pages"], PAGE_LAYOUT=layout == "page",
                             num_warps=cfg["num_warps"],
                             num_stages=cfg["num_stages"])
    return out
