"""DeepSeek-V4's KV per request, with its compressed sparse attention (CSA) history in HBM
against on host pages behind a working set of cells, and the concurrency each gives on one GPU
(issue: DeepSeek-V4 through the cache, deliverable 3). Arithmetic from the model's shapes, not
a measurement: the library does not run V4 yet (streams with a compression rate are specified
by STR-1..2 and modelled in tests/stream_reference.py).

What a request holds per layer (``layer_types``, ``compress_rates`` of the config; the row
formats engines use, docs/DESIGN.md cites them):

* every layer: the sliding window's raw tokens, ``sliding_window`` x 584 B (FP8 latent 448 B +
  bf16 rope 64 B + scales and pad), and its compressor's state, bf16: the tail of pending
  tokens (at most rate - 1) with their kv and gate projections, and for CSA the previous
  window's overlap slice (``rate`` tokens x head_dim, kv and gate) and the indexer's own
  compressor at ``index_head_dim``;
* CSA (rate 4): one compressed entry per 4 tokens, 584 B, selected by the lightning indexer
  (top ``index_topk``), and the indexer's compressed key per entry, 128 FP8 + a 4-B scale;
* HCA (rate 128): one compressed entry per 128 tokens, 584 B, all of them attended.

"HBM" keeps everything on the GPU. "CSA on host" keeps the CSA entries in host pages and, per
CSA layer, ``hot`` cells of them on the GPU (default 2 x index_topk, as the DSA models'
default); the indexer keys, HCA entries, windows and states stay on the GPU (the indexer reads
every key each step). Usage::

    python benchmarks/v4_capacity.py [--kv-gb 100] [--contexts 131072,1048576] [--hot N]
"""
from __future__ import annotations

import argparse
import sys

ENTRY_BYTES = 584  # a compressed entry or a window token: 448 FP8 + 64 bf16 rope + 7 scales + 1
INDEX_KEY_BYTES = 128 + 4  # an indexer key: 128 FP8 + one fp32 scale
BF16 = 2


def v4_shape(config=None) -> dict:
    """The shapes the arithmetic needs, from a ``DeepseekV4Config`` (transformers; its defaults
    are DeepSeek-V4-Flash-Base's) or a dict of the same fields."""
    if config is None:
        from transformers import DeepseekV4Config  # the [models] extra

        config = DeepseekV4Config()
    get = config.get if isinstance(config, dict) else lambda k: getattr(config, k)
    types = list(get("layer_types"))
    return {"csa": types.count("compressed_sparse_attention"),
            "hca": types.count("heavily_compressed_attention"),
            "layers": len(types), "window": get("sliding_window"), "head_dim": get("head_dim"),
            "index_head_dim": get("index_head_dim"), "index_topk": get("index_topk"),
            "csa_rate": get("compress_rates")["compressed_sparse_attention"],
            "hca_rate": get("compress_rates")["heavily_compressed_attention"]}


def state_bytes(rate: int, dim: int, overlap: bool) -> int:
    """A compressor's per-request state, bf16: the tail (rate - 1 tokens, kv and gate of
    2 x dim with the overlap, dim without) and, with the overlap, the previous window's slice
    (rate tokens x dim, kv and gate)."""
    width = 2 * dim if overlap else dim
    tail = (rate - 1) * 2 * width * BF16
    return tail + (rate * 2 * dim * BF16 if overlap else 0)


def per_request(shape: dict, tokens: int, hot: int) -> dict:
    """Bytes of one request of ``tokens`` tokens: ``{"hbm": GPU bytes with everything in HBM,
    "gpu": GPU bytes with the CSA entries on host, "host": their host bytes}``."""
    csa_entries = tokens // shape["csa_rate"]
    hca_entries = tokens // shape["hca_rate"]
    window = shape["window"] * ENTRY_BYTES * shape["layers"]
    states = (shape["csa"] * (state_bytes(shape["csa_rate"], shape["head_dim"], True)
                              + state_bytes(shape["csa_rate"], shape["index_head_dim"], True))
              + shape["hca"] * state_bytes(shape["hca_rate"], shape["head_dim"], False))
    index_keys = csa_entries * INDEX_KEY_BYTES * shape["csa"]
    hca = hca_entries * ENTRY_BYTES * shape["hca"]
    csa = csa_entries * ENTRY_BYTES * shape["csa"]
    cells = min(hot, csa_entries) * ENTRY_BYTES * shape["csa"]
    common = window + states + index_keys + hca
    return {"hbm": common + csa, "gpu": common + cells, "host": csa,
            "parts": {"window": window, "states": states, "index_keys": index_keys, "hca": hca,
                      "csa": csa, "cells": cells}}


def table(shape: dict, contexts: list, kv_gb: float, hot: int) -> list:
    rows = []
    for tokens in contexts:
        r = per_request(shape, tokens, hot)
        budget = kv_gb * 1e9
        rows.append({"tokens": tokens, **r, "hbm_requests": int(budget // r["hbm"]),
                     "gpu_requests": int(budget // r["gpu"])})
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kv-gb", type=float, default=100.0,
                   help="GPU memory for KV per GPU (an H200 has 141 GB; what weights and "
                        "activations leave depends on the deployment)")
    p.add_argument("--contexts", default="131072,1048576", help="tokens, comma-separated")
    p.add_argument("--hot", type=int, default=None,
                   help="cells per CSA layer and request (default 2 x index_topk)")
    args = p.parse_args(argv)
    if args.kv_gb <= 0:
        p.error("argument --kv-gb: must be > 0")
    shape = v4_shape()
    hot = 2 * shape["index_topk"] if args.hot is None else args.hot
    contexts = [int(c) for c in args.contexts.split(",")]
    print(f"DeepSeek-V4 ({shape['layers']} layers: {shape['csa']} CSA rate {shape['csa_rate']}, "
          f"{shape['hca']} HCA rate {shape['hca_rate']}; window {shape['window']}; index top-"
          f"{shape['index_topk']}; {hot} cells per CSA layer); {args.kv_gb:g} GB of KV per GPU")
    print("| tokens | per request, all in HBM | per request, CSA on host: GPU / host | "
          "requests per GPU: HBM / CSA on host |")
    print("|---|---|---|---|")
    for r in table(shape, contexts, args.kv_gb, hot):
        print(f"| {r['tokens']:,} | {r['hbm'] / 1e6:,.1f} MB | {r['gpu'] / 1e6:,.1f} MB / "
              f"{r['host'] / 1e6:,.1f} MB | {r['hbm_requests']} / {r['gpu_requests']} "
              f"({r['gpu_requests'] / max(r['hbm_requests'], 1):.1f}x) |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
