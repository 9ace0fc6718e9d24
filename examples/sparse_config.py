"""The cache configuration of examples/sparse_decode.py, from its flags alone: the config
(``build_config``), its budgets (``budgets``) and the memory a run takes in parts
(``memory_parts``), so that the script refuses absurd flag values before allocating."""
from __future__ import annotations

import torch

import torch_kvcm2 as kv

from flags import Part  # examples/flags.py

KV_DTYPE = torch.float16  # the latent as stored; attention math runs in float32
KEY_DTYPE = torch.float32  # indexer keys as stored


def longest_prompt(args) -> int:
    """The longest prompt of the rows (``--prompt-lengths`` cycled over ``--rows``)."""
    return max(args.prompt_lengths[:args.rows])


def budgets(args) -> tuple:
    """(max_tokens_per_row, gpu_budget_bytes, host_budget_bytes) of the cache config, from the
    flags alone. Whole pages, for the longest row's tokens (every step accepting all T, plus the
    next step's T in flight) and the reserve of pages beyond them; the budgets hold every page of
    every row and the cells, plus generous slack for the batch's tables."""
    P, U, L, T = args.tokens_per_page, args.tokens_per_unit, args.layers, args.query_tokens
    groups = -(-L // args.group_size)
    max_tokens = -(-(longest_prompt(args) + args.steps * T + T + args.reserve_pages * P) // P) * P
    pages = args.rows * max_tokens // P
    host = pages * P * L * args.latent * KV_DTYPE.itemsize
    dense = pages * P * groups * args.index_dim * KEY_DTYPE.itemsize
    cells = args.rows * L * args.slots * U * args.latent * KV_DTYPE.itemsize
    tables = 64 * args.rows * (max_tokens // P + args.slots + T * args.topk + args.inflight) * groups
    return max_tokens, dense + cells + tables + (1 << 20), host + (1 << 20)


def memory_parts(args) -> list:
    """The memory a run of these flags takes, in parts (``flags.Part``), from the flags alone,
    so that absurd values are refused at once: the cache config's budgets (``budgets``: the
    manager's pools, cells and tables, filled by the run) and the script's own tensors: the
    dense reference, the weights, the sampling noise drawn up front (made in float64 on the
    host), and the prefill's activations at their peak (the indexer's scores of every prompt
    token against every position, or the attention's gathered units)."""
    R, L, T, N = args.rows, args.layers, args.query_tokens, longest_prompt(args)
    d, H, D, Di, V = args.d_model, args.heads, args.latent, args.index_dim, args.vocab
    W, U, groups = args.topk + 1, args.tokens_per_unit, -(-L // args.group_size)
    max_tokens, gpu, host = budgets(args)
    noise = (args.steps + 1 + args.steps * args.draft_tokens) * R * V
    indexer = 4 * R * N * (2 * max_tokens + 2 * max_tokens // U) + R * max_tokens * Di * 4
    attention = R * N * W * U * (6 * D + 12 * H + 9)
    activations = R * N * (4 * (4 * d + 2 * H * D + 2 * Di) + 24) + max(indexer, attention)
    # the flags that set the tokens per row (``budgets``' max_tokens), and so most parts
    lengths = ("--rows", "--prompt-lengths", "--steps", "--reserve-pages")
    return [
        Part("the cache's host pages", host, lengths + ("--layers", "--latent"), "host"),
        Part("the cache's GPU pools, cells and tables", gpu, lengths + ("--layers", "--slots"),
             "device"),
        Part("the dense reference", R * max_tokens * (L * D * 2 + groups * Di * 4 + 4),
             lengths + ("--layers", "--latent"), "device"),
        Part("the model's weights", 4 * (V * d + L * (2 * d * H * D + d * D) + groups * 2 * d * Di),
             ("--d-model", "--layers", "--heads", "--latent", "--vocab"), "device"),
        Part("the sampling noise", 4 * noise, ("--steps", "--rows", "--vocab", "--draft-tokens"),
             "device"),
        Part("drawing the sampling noise", 24 * noise,
             ("--steps", "--rows", "--vocab", "--draft-tokens"), "host"),
        Part("the prefill's activations", activations,
             lengths + ("--d-model", "--heads", "--latent"), "device"),
    ]


def build_config(args, device) -> kv.CacheConfig:
    P, U, L, T = args.tokens_per_page, args.tokens_per_unit, args.layers, args.query_tokens
    max_tokens, gpu_budget, host_budget = budgets(args)
    sparse = {}  # one SparseSpec per selection group; its layers share residency and resolve
    layers = []
    for i in range(L):
        group = f"g{i // args.group_size}"
        spec = sparse.setdefault(group, kv.SparseSpec(
            tokens_per_unit=U, width=args.topk + 1, slots=args.slots,
            max_inflight_tokens=args.inflight, max_query_tokens=T, selection_id=group))
        # Only a group's first layer runs the indexer: the others' indexer_k is zero-size, which
        # costs no memory and no copies (CFG-6).
        leader = i % args.group_size == 0
        index_bytes = args.index_dim * KEY_DTYPE.itemsize if leader else 0
        layers.append(kv.LayerSpec(f"layer{i}", [
            kv.BufferSpec("kv", args.latent * KV_DTYPE.itemsize, sparse=True),
            kv.BufferSpec("indexer_k", index_bytes)], sparse=spec))
    return kv.CacheConfig(tokens_per_page=P, layers=layers, max_rows=args.rows,
                          max_tokens_per_row=max_tokens, gpu_budget_bytes=gpu_budget,
                          host_budget_bytes=host_budget, device=device)
