"""How a DSA model's per-layer state maps onto torch_kvcm2 buffers (MOD-1).

Per model layer ``i`` one torch_kvcm2 layer ``layer{i}`` with

* ``latent`` (sparse: history in host pages, selected tokens in cells): per token the
  normalised latent (``kv_lora_rank``) then the rotated rope part (``qk_rope_head_dim``), in the
  model's dtype, one row of ``latent_dim`` elements -- the row a FlashMLA-style sparse decode
  kernel reads (512 + 64 for DeepSeek-V3.2);
* ``indexer_k`` (dense, a paged GPU pool), on layers with their own indexer: the indexer's key
  per token (``index_head_dim`` elements in the model's dtype).

Layers that share an indexer (GLM-5's "shared" layers and the "full" layer before them) are one
selection group, ``indexer{leader}``: one resolve per step fetches the selection into the cells
of every layer of the group. One unit is one token (the indexer selects tokens); the selection
width is ``index_topk``.
"""
from __future__ import annotations

from typing import Optional

import torch

import torch_kvcm2 as kv

from .support import ModelSpec

LATENT = "latent"
INDEXER_KEYS = "indexer_k"


def layer_name(layer: int) -> str:
    return f"layer{layer}"


def group_id(leader: int) -> str:
    return f"indexer{leader}"


def _ceil_to(value: int, step: int) -> int:
    return -(-value // step) * step


def latent_bytes(spec: ModelSpec) -> int:
    return spec.latent_dim * _itemsize(spec.dtype)


def indexer_bytes(spec: ModelSpec) -> int:
    return spec.index_head_dim * _itemsize(spec.dtype)


def _itemsize(dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def cache_config(spec: ModelSpec, *, max_rows: int, max_tokens_per_row: int,
                 tokens_per_page: int = 64, hot_tokens: Optional[int] = None, device="cpu",
                 host_tier_bytes: int = 0, gpu_history_tokens: int = 0) -> kv.CacheConfig:
    """The ``CacheConfig`` for ``spec``: budgets sized for ``max_rows`` requests of
    ``max_tokens_per_row`` tokens (plus the host tier's ``host_tier_bytes``), and
    ``hot_tokens`` cell slots per request and selection group (default twice ``index_topk``,
    rounded up to whole pages; at least ``index_topk`` + 2, which a step needs: the selection
    and the token in flight). ``gpu_history_tokens``: tokens of the batch's rows' sparse
    history kept in GPU pages as well (RSD-1; rounded up to whole pages of every layer's
    latent; 0: all offloaded)."""
    width = spec.index_topk
    slots = hot_tokens if hot_tokens is not None else 2 * width
    slots = _ceil_to(max(slots, width + 2), tokens_per_page)
    layers = []
    for i in range(spec.num_layers):
        buffers = [kv.BufferSpec(LATENT, latent_bytes(spec), sparse=True)]
        if spec.has_indexer(i):
            buffers.append(kv.BufferSpec(INDEXER_KEYS, indexer_bytes(spec)))
        sparse = kv.SparseSpec(tokens_per_unit=1, width=width, slots=slots,
                               max_inflight_tokens=1, selection_id=group_id(spec.leader[i]))
        layers.append(kv.LayerSpec(layer_name(i), buffers, sparse=sparse))
    tokens = -(-max_tokens_per_row // tokens_per_page) * tokens_per_page * max_rows
    dense = tokens * indexer_bytes(spec) * len(spec.leaders)
    sparse_host = tokens * latent_bytes(spec) * spec.num_layers
    cells = max_rows * slots * latent_bytes(spec) * spec.num_layers
    # tables, residency state and staging are small: a quarter more and 8 MiB cover them
    gpu_history = (-(-gpu_history_tokens // tokens_per_page) * tokens_per_page
                   * latent_bytes(spec) * spec.num_layers)
    gpu = (dense + cells + gpu_history) * 5 // 4 + (8 << 20)
    host = sparse_host * 5 // 4 + (8 << 20) + host_tier_bytes
    return kv.CacheConfig(tokens_per_page=tokens_per_page, layers=layers, max_rows=max_rows,
                          max_tokens_per_row=max_tokens_per_row, gpu_budget_bytes=gpu,
                          host_budget_bytes=host, device=device, gpu_history_bytes=gpu_history)
