"""What operators see (OBS-1): the counters a manager keeps and the snapshot ``metrics()`` returns.

Host events are counted where they happen (``HostCounters``, owned by the manager). Device
counters (per selection group hits, misses, invalid selections; ``advance``'s refused and short
rows) live in one int64 tensor per batch and reach the host only through the batch's read-back
of its lengths (``readback``): ``metrics()`` reads the newest read-back that has arrived and
never the device, so it never synchronises. A closed (or collected) batch's last counters are
added to the manager's totals, so the figures are "since the manager started".

The snapshot is a plain dict; its schema is ``metrics()``'s docstring and docs/METRICS.md.
"""
from __future__ import annotations

import logging

import numpy as np

from . import lengths as rules
from .memory import sparse_buffers
from .ops import NUM_COUNTERS

logger = logging.getLogger(__name__)


class HostCounters:
    """Counts of host events since the manager started (every field an int)."""

    FIELDS = ("admissions_refused", "preemptions", "offloads", "resumes", "aborts",
              "allocations_failed",
              "flushed_bytes", "host_direct_bytes",
              "promotions", "demotions", "promoted_bytes")

    def __init__(self, config):
        for name in self.FIELDS:
            setattr(self, name, 0)
        groups = config.selection_groups
        # per selection group: bytes of one unit over every sparse buffer of its layers
        self.token_bytes = [sum(b.bytes_per_token for layer in g.layers
                                for b in sparse_buffers(config, layer)) for g in groups]
        self.unit_bytes = np.array([g.sparse.tokens_per_unit * n
                                    for g, n in zip(groups, self.token_bytes)], dtype=np.int64)
        self.shapes = [(g.sparse.tokens_per_unit, g.sparse.max_inflight_tokens) for g in groups]
        # device counters of batches closed or collected (memory.counter_words' layout)
        self.retired = np.zeros(NUM_COUNTERS * len(groups) + 2, dtype=np.int64)

    def retire(self, counters: np.ndarray) -> None:
        """A batch is gone: keep its last device counters."""
        self.retired += counters

    def declared(self, h: int, c: int, old: int, end: int) -> None:
        """A cache with lengths (h, c) declared host-direct tokens up to ``end`` (it had
        declared up to ``old``): per selection group, the tokens newly declared in its
        host-direct range ``[h, s0)`` times the group's bytes per token."""
        total = 0
        for shape, nbytes in zip(self.shapes, self.token_bytes):
            s0 = rules.inflight_start(h, c, shape, max)
            total += max(0, min(end, s0) - max(min(old, s0), h)) * nbytes
        self.host_direct_bytes += total


def flushed_tokens(new_written: np.ndarray, old_written: np.ndarray,
                   declared: np.ndarray) -> int:
    """Tokens a flush brought onto host pages: per row, how far the written watermark moved past
    both its old value and the declared host-direct range (which the watermark also covers)."""
    return int(np.maximum(new_written - np.maximum(old_written, declared), 0).sum())


def snapshot(manager) -> dict:
    """The metrics of ``manager`` (``KVCacheManager.metrics``' docstring has the schema)."""
    counts, config, storage = manager.counts, manager.config, manager.storage
    device = counts.retired.copy()
    seated = suspended = gpu_rows = gpu_bytes = 0
    for batch in list(manager.batches):
        device += batch.latest_counters()
        rows = batch.row_counts()
        seated += rows["seated"]
        suspended += rows["suspended"]
        gpu_rows += rows["gpu_history"]
        gpu_bytes += batch.gpu_history_bytes()
    n, G = NUM_COUNTERS, len(config.selection_groups)
    values, unit_bytes = device.tolist(), counts.unit_bytes.tolist()  # Python ints, one call each
    groups = {}
    for g, spec in enumerate(config.selection_groups):
        hits, misses, invalid = values[n * g:n * (g + 1)]
        groups[spec.name] = {"hits": hits, "misses": misses, "invalid": invalid,
                             "fetched_bytes": misses * unit_bytes[g]}
    pools, media = [], {m: {"used_bytes": 0, "cached_bytes": 0, "total_bytes": 0,
                            "committed_bytes": 0, "batch_bytes": manager.reserve.in_use[m]}
                        for m in ("gpu", "host")}
    for group in storage.groups:
        slot = group.slot_bytes
        cached = group.cached_slots
        used = group.num_slots - group.free_slots - cached
        entry = {"index": group.index, "medium": group.medium, "used_bytes": used * slot,
                 "cached_bytes": cached * slot, "total_bytes": group.num_slots * slot,
                 "committed_bytes": min(group.committed_bytes, group.nbytes)}
        pools.append(entry)
        for key in ("used_bytes", "cached_bytes", "total_bytes", "committed_bytes"):
            media[group.medium][key] += entry[key]
    prefix = storage.prefix
    return {
        "selection_groups": groups,
        "flushed_bytes": counts.flushed_bytes,
        "host_direct_bytes": counts.host_direct_bytes,
        "prefix": {"queries": prefix.queries, "queried_tokens": prefix.queried_tokens,
                   "hit_tokens": prefix.matched_tokens, "evicted_slots": prefix.evicted_slots},
        "admissions_refused": counts.admissions_refused,
        "preemptions": counts.preemptions,
        "offloads": counts.offloads,
        "resumes": counts.resumes,
        "aborts": counts.aborts,
        "allocations_failed": counts.allocations_failed,
        "advance": {"refused_rows": values[n * G], "short_rows": values[n * G + 1]},
        "pool_groups": pools,
        "media": media,
        "cached_prefix_bytes": sum(p["cached_bytes"] for p in pools),
        "rows": {"seated": seated, "suspended": suspended},
        "gpu_history": {"rows": gpu_rows, "bytes": gpu_bytes, "promotions": counts.promotions,
                        "demotions": counts.demotions, "promoted_bytes": counts.promoted_bytes},
    }
