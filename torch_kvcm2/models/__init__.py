"""Real models through the cache (MOD-1..5, docs/MODELS.md): transformers' own
``DeepseekV32ForCausalLM`` and ``GlmMoeDsaForCausalLM`` decoding with their sparse latents in
host pages and cells and their indexer keys in a dense GPU pool.

* ``Generator``: batched generation (requests join and leave, chunked prefill, greedy or
  sampled), the quick way in;
* ``SparseMLACache``: the cache object a model takes as ``past_key_values`` over a
  ``torch_kvcm2.Batch``, with ``install(model)`` giving the model's attention modules the
  forward that uses it;
* ``cache_config``: the ``CacheConfig`` of a model (``describe(model)``);
* ``reference``: the stock model with its dense cache, and the comparison.

Needs the ``[models]`` extra (transformers, imported on first use: ``import torch_kvcm2`` and
this package never need it).
"""
from .attention import install, installed
from .dsa_cache import SparseMLACache
from .generation import Generator, Request, last_logits
from .layout import INDEXER_KEYS, LATENT, cache_config, group_id, layer_name
from .support import (SUPPORTED_ARCHITECTURES, TESTED_TRANSFORMERS, ModelSpec, describe,
                      import_transformers, stock_caches_latents)
from .tiny import tiny_config, tiny_model

__all__ = [
    "Generator",
    "INDEXER_KEYS",
    "LATENT",
    "ModelSpec",
    "Request",
    "SUPPORTED_ARCHITECTURES",
    "SparseMLACache",
    "TESTED_TRANSFORMERS",
    "cache_config",
    "describe",
    "group_id",
    "import_transformers",
    "install",
    "installed",
    "last_logits",
    "layer_name",
    "stock_caches_latents",
    "tiny_config",
    "tiny_model",
]
