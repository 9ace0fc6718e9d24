"""torch_kvcm2: a KV-cache manager for sparse-attention decoding with host-resident history.

Importing the package loads the native op library (``torch_kvcm2._C``) first; a failed load is
an error, never a silent fallback. The public API is the configuration (``CacheConfig`` and its
parts), ``KVCacheManager``, ``KVCache``, ``Batch``, ``FetchStream`` and ``CacheRecord``; the
per-step custom ops live in ``torch_kvcm2.ops`` and under ``torch.ops.torch_kvcm2``.
"""
import torch  # noqa: F401  (the op library links against torch)

from . import _C  # noqa: F401  (registers every op; must precede ops)
from . import ops
from ._util import has_cuda_kernels, missing_for
from .batch import Batch
from .cache import KVCache
from .config import BAD, BufferSpec, CacheConfig, LayerSpec, SparseSpec
from .manager import KVCacheManager
from .overlap import FetchStream
from .transfer import CacheRecord

__all__ = [
    "BAD",
    "Batch",
    "BufferSpec",
    "CacheConfig",
    "CacheRecord",
    "FetchStream",
    "KVCache",
    "KVCacheManager",
    "LayerSpec",
    "SparseSpec",
    "has_cuda_kernels",
    "missing_for",
    "ops",
]

