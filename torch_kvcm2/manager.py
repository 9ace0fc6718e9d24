"""KVCacheManager: config -> storage -> caches and batches."""
from __future__ import annotations

import itertools

import torch

from ._util import refuse_during_capture
from .batch import Batch
from .cache import KVCache
from .config import CacheConfig
from .memory import BatchReserve, batch_memory_bytes
from .storage import Storage


class KVCacheManager:
    """Owns the storage of one config and creates the caches and batches that use it.

    The GPU and host budgets first reserve the memory of one batch of ``config.max_rows`` rows
    (``memory.batch_tensor_specs``: device tables, residency, cells; pinned staging); the pools
    get the rest (docs/DESIGN.md). Raises ``ValueError`` when a budget cannot hold one slot of
    each of its pool groups.
    """

    def __init__(self, config: CacheConfig):
        if not isinstance(config, CacheConfig):
            raise TypeError(f"KVCacheManager needs a CacheConfig, got {type(config).__name__}")
        refuse_during_capture(config.device, "KVCacheManager()")
        self.config = config
        self.storage = Storage(config)
        # A batch's memory is linear in its rows plus a few bytes per selection group, so the
        # reserve of max_rows one-row batches covers any split of max_rows rows over batches.
        one_row = batch_memory_bytes(config, len(self.storage.groups), 1)
        self._reserve = {medium: config.max_rows * n for medium, n in one_row.items()}
        for medium in ("gpu", "host"):
            budget = getattr(config, f"{medium}_budget_bytes")
            if self._reserve[medium] > budget:
                raise ValueError(
                    f"STO-4: the {medium} budget ({budget} bytes) is smaller than the memory of a "
                    f"batch of {config.max_rows} rows ({self._reserve[medium]} bytes)")
        self.storage.allocate(self._reserve)
        self.reserve = BatchReserve(self._reserve)
        self._ids = itertools.count()

    def create_cache(self) -> KVCache:
        """A new, empty request cache (capacity 0, history 0)."""
        return KVCache(self, next(self._ids))

    def create_batch(self, max_rows=None) -> Batch:
        """Same as ``Batch(manager, max_rows)``."""
        return Batch(self, max_rows)

    def buffer_view(self, layer: str, role: str, device_side: bool = True) -> torch.Tensor:
        """The pages of one buffer, ``uint8[num_slots*scale, chunks, P, B/chunks]``: page
        ``KVCache.host_pages(layer, role)[p]`` holds a request's tokens ``[p*P, (p+1)*P)``, token
        ``t`` at ``[.., :, t % P]`` (the same layout as a cell). ``device_side`` picks the tensor
        ops see (on CUDA, for a sparse buffer, the device-mapped view of the host pages) over the
        host tensor itself. The address never changes."""
        return self.storage.view(layer, role, device_side)

    def stats(self) -> dict:
        """Pool usage per pool group and per medium, plus the batch reserve in use (STO-4)."""
        stats = self.storage.stats()
        for medium in ("gpu", "host"):
            stats[medium]["batch_bytes_in_use"] = self.reserve.in_use[medium]
        return stats
